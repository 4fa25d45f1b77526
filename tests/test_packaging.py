"""The extension as a user installs and loads it: every magic registered and removed, help, the wheel."""
from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from torch_nbdebug.magics import _FEATURES

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "torch_nbdebug"

# The magics the issues promise users, as (kind, name); each feature's MAGICS may add more.
PROMISED = {
    ("cell", "nanwatch"),
    ("line", "graph"), ("cell", "graph"),
    ("line", "grads"), ("cell", "grads"),
    ("line", "cudamem"), ("cell", "cudamem"),
    ("line", "explain"), ("cell", "explain"),
    ("cell", "repro"),
}


def _magics_classes() -> dict[str, Any]:
    return {name: importlib.import_module(f"torch_nbdebug.magics.{name}").MAGICS for name in _FEATURES}


def _declared() -> set[tuple[str, str]]:
    """(kind, name) of every magic the feature modules declare."""
    return {(kind, name) for cls in _magics_classes().values()
            for kind, names in cls.magics.items() for name in names}


def _magic_function(kind: str, name: str) -> Any:
    for cls in _magics_classes().values():
        method = cls.magics.get(kind, {}).get(name)
        if method is not None:
            return getattr(cls, method)
    raise AssertionError(f"no {kind} magic {name}")


@pytest.fixture
def shell() -> Iterator[Any]:
    """A real IPython shell with torch_nbdebug NOT loaded; left unloaded afterwards."""
    from IPython.testing.globalipapp import get_ipython

    ip = get_ipython()
    if "torch_nbdebug" in ip.extension_manager.loaded:
        ip.run_line_magic("unload_ext", "torch_nbdebug")
    yield ip
    if "torch_nbdebug" in ip.extension_manager.loaded:
        ip.run_line_magic("unload_ext", "torch_nbdebug")


def _registered(ip: Any, kind: str, name: str) -> bool:
    return name in ip.magics_manager.magics[kind]


def test_every_feature_declares_magics() -> None:
    assert set(_FEATURES) == {"nanwatch", "graph", "grads", "memory", "explain", "repro"}
    for feature, cls in _magics_classes().items():
        assert any(cls.magics[kind] for kind in ("line", "cell")), f"{feature}.MAGICS declares no magic"
    missing = PROMISED - _declared()
    assert not missing, f"magics promised to users but not declared: {sorted(missing)}"


def test_load_ext_registers_and_unload_ext_removes_every_magic(shell: Any) -> None:
    declared = _declared()
    for kind, name in declared:
        assert not _registered(shell, kind, name), f"{kind} magic {name} present before %load_ext"
    for _ in range(2):  # load, unload, and again: a reload leaves nothing behind either
        shell.run_line_magic("load_ext", "torch_nbdebug")
        unregistered = sorted((k, n) for k, n in declared if not _registered(shell, k, n))
        assert not unregistered, f"not registered by %load_ext: {unregistered}"
        shell.run_line_magic("unload_ext", "torch_nbdebug")
        left = sorted((k, n) for k, n in declared if _registered(shell, k, n))
        assert not left, f"still registered after %unload_ext: {left}"
        names = {cls.__name__ for cls in _magics_classes().values()}
        assert not names & set(shell.magics_manager.registry), "Magics classes left in the registry"


def _help(shell: Any, capsys: Any, query: str) -> str:
    capsys.readouterr()
    shell.run_cell(query)
    return str(capsys.readouterr().out)


def test_nanwatch_question_mark_shows_full_help(shell: Any, capsys: Any) -> None:
    shell.run_line_magic("load_ext", "torch_nbdebug")
    text = _help(shell, capsys, "%nanwatch?")
    assert "not found" not in text, "`%nanwatch?` must find the magic (register it for line and cell)"
    assert "%nanwatch" in text or "%%nanwatch" in text
    for flag in ("--raise", "-o"):
        assert flag in text, f"%nanwatch? does not document {flag}"


@pytest.mark.parametrize("kind,name", sorted(PROMISED))
def test_help_lists_every_option(shell: Any, capsys: Any, kind: str, name: str) -> None:
    shell.run_line_magic("load_ext", "torch_nbdebug")
    prefix = "%" if kind == "line" else "%%"
    text = _help(shell, capsys, f"{prefix}{name}?")
    assert "not found" not in text, f"{prefix}{name}? found nothing"
    parser = getattr(_magic_function(kind, name), "parser", None)
    assert parser is not None, f"{prefix}{name} should use IPython's magic_arguments so help lists options"
    options = [opt for action in parser._actions for opt in action.option_strings]
    assert "-o" in options, f"{prefix}{name} should return its result object with -o (%timeit -o style)"
    undocumented = [opt for opt in options if opt not in text]
    assert not undocumented, f"{prefix}{name}? does not show {undocumented}"
    # A description, not only a usage line.
    assert len(text.split()) > 30, f"{prefix}{name}? help is too short:\n{text}"


def _build_wheel(dest: Path) -> zipfile.ZipFile:
    """Build the wheel from a copy of the sources, so the checkout gets no build/ or egg-info."""
    src = dest / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, src / name)
    shutil.copytree(PACKAGE, src / "torch_nbdebug",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    out = dest / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
         "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"wheel build failed:\n{proc.stdout}\n{proc.stderr}"
    wheels = list(out.glob("torch_nbdebug-*.whl"))
    assert len(wheels) == 1, wheels
    return zipfile.ZipFile(wheels[0])


def test_wheel_ships_code_static_assets_and_py_typed(tmp_path: Path) -> None:
    with _build_wheel(tmp_path) as wheel:
        names = set(wheel.namelist())
        metadata = next(wheel.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    static = PACKAGE / "render" / "static"
    assets = sorted(p.name for p in static.iterdir() if p.suffix in {".js", ".css"})
    assert any(a.endswith(".js") for a in assets), "no widget ES module in render/static"
    missing = [a for a in assets if f"torch_nbdebug/render/static/{a}" not in names]
    assert not missing, f"static files missing from the wheel: {missing}"
    assert "torch_nbdebug/py.typed" in names
    sources = sorted(p.relative_to(REPO).as_posix() for p in PACKAGE.rglob("*.py")
                     if "__pycache__" not in p.parts)
    assert [s for s in sources if s not in names] == [], "modules missing from the wheel"
    assert not [n for n in names if n.startswith("tests/")], "tests must not ship in the wheel"
    assert "Requires-Dist: torch" in metadata and "Requires-Dist: anywidget" in metadata


def test_pinned_requirements_install_on_debian_12_python() -> None:
    """`./dev` must work with Debian 12's own python3 (3.11.2), not only with a newer 3.11."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    pins = [Requirement(line.split("#")[0]) for line in
            (REPO / "requirements" / "dev.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert any(p.name == "torch" and str(p.specifier) == "==2.13.0" for p in pins)
    too_new = []
    for pin in pins:
        assert len(pin.specifier) == 1 and next(iter(pin.specifier)).operator == "==", f"{pin} is not exact"
        try:
            dist = metadata.distribution(pin.name)
        except metadata.PackageNotFoundError:
            continue  # the venv is checked against the pins by ./dev, not here
        if not pin.specifier.contains(dist.version.split("+")[0]):
            continue
        requires = dist.metadata.get("Requires-Python")
        if requires and not SpecifierSet(requires).contains("3.11.2"):
            too_new.append(f"{pin} needs Python {requires}")
    assert not too_new, too_new
