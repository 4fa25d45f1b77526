"""The extension as a user installs and loads it: every magic registered and removed, help, the wheel."""
from __future__ import annotations

import importlib
import re
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
    ("cell", "monitor"),
    ("line", "profile"), ("cell", "profile"),
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
    assert set(_FEATURES) == {"nanwatch", "graph", "grads", "memory", "explain", "repro", "monitor", "profile"}
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


_REST_MARKUP = [
    (re.compile(r"``"), "double backticks"),
    (re.compile(r":(param|returns?|raises?|type|rtype)\b[^:\n]*:"), "a :param:-style field"),
    (re.compile(r":(class|func|meth|mod|attr|obj|data|exc|ref|doc):`"), "a Sphinx role"),
    (re.compile(r"^\s*\.\. [\w-]+::", re.M), "a .. directive"),
]


@pytest.mark.parametrize("kind,name", sorted(PROMISED))
def test_help_reads_as_plain_text(shell: Any, capsys: Any, kind: str, name: str) -> None:
    """`%nanwatch?` is read in a pager or a notebook, where reST markup shows raw."""
    shell.run_line_magic("load_ext", "torch_nbdebug")
    prefix = "%" if kind == "line" else "%%"
    text = _help(shell, capsys, f"{prefix}{name}?")
    found = [f"{what}: {m.group(0)!r}" for pattern, what in _REST_MARKUP for m in pattern.finditer(text)]
    assert not found, f"{prefix}{name}? shows raw reST markup: {found}\n{text}"


def test_plain_text_check_finds_rest_markup() -> None:
    sample = "Stored as ``_x``.\n:param line: the line\nSee :class:`Foo`.\n.. note::\n   hi\n"
    assert [what for pattern, what in _REST_MARKUP if pattern.search(sample)] == \
        ["double backticks", "a :param:-style field", "a Sphinx role", "a .. directive"]


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


def _dev_wants_browser(*args: str) -> bool:
    """Ask ./dev's own wants_browser (sourcing ./dev defines its functions and runs nothing)."""
    proc = subprocess.run(["bash", "-c", 'source ./dev && wants_browser "$@"', "dev", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode == 0


@pytest.mark.parametrize("args,browser", [
    ((), True),                                                   # the whole suite, as CI runs it
    (("-x", "-q"), True),
    (("-k", "tour"), True),                                       # -k may pick browser tests
    (("tests",), True),
    (("tests/browser/test_tour_browser.py::test_tour",), True),
    (("tests/test_packaging.py", "tests/browser"), True),
    (("-m", "not browser or slow"), True),
    (("tests/test_core.py",), False),                             # no apt-get chromium for this
    (("tests/test_core.py::test_x", "tests/test_packaging.py", "-x"), False),
    (("-m", "not browser"), False),
    (("-mnot browser",), False),
])
def test_dev_test_installs_chromium_only_for_browser_tests(args: tuple[str, ...], browser: bool) -> None:
    assert _dev_wants_browser(*args) is browser


def test_ci_runs_the_readme_test_command() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^exec \./dev test\b", ci, re.M), ci
    dev = (REPO / "dev").read_text()
    cmd_test = dev[dev.index("cmd_test() {"):]
    cmd_test = cmd_test[:cmd_test.index("\n}\n")]
    assert "wants_browser" in cmd_test and "setup_browser" in cmd_test


def test_ci_also_runs_the_suite_against_the_newest_torch() -> None:
    """Issue 29: CI runs ``./dev test`` and then ``./dev test-newest`` (each stops CI when it fails), and
    ``test-newest`` installs requirements/newest.txt's torch into a venv of its own (never ``.venv``)."""
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    runs = [line for line in ci if re.match(r"(exec )?\./dev ", line)]
    assert [re.sub(r"^exec ", "", r).split(" <")[0] for r in runs] == ["./dev test", "./dev test-newest"], runs
    assert "set -euo pipefail" in ci
    dev = (REPO / "dev").read_text()
    assert re.search(r"^    test-newest\) shift; cmd_test_newest", dev, re.M)
    use = dev[dev.index("use_newest_torch() {"):]
    use = use[:use.index("\n}\n")]
    assert 'VENV="$ROOT/.venv-newest"' in use and "TORCH_PIN=requirements/newest.txt" in use
    proc = subprocess.run(["./dev", "help"], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert "./dev test-newest" in proc.stdout, proc.stdout


def _canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _with_requirements(names: set[str]) -> set[str]:
    """``names`` and everything their installed distributions require (no extras), recursively."""
    from importlib import metadata

    from packaging.requirements import Requirement

    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = _canon(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def test_notebooks_extra_brings_what_the_course_imports() -> None:
    """`pip install torch_nbdebug[notebooks]` is enough to run every notebook of the course."""
    import tomllib
    from importlib import metadata

    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extra = [Requirement(d) for d in project["optional-dependencies"]["notebooks"]]
    # notebook 03 renders torchviz's DOT with graphviz-pure's `dot`-compatible binary (no system Graphviz)
    assert {"torchviz", "graphviz-pure"} <= {_canon(r.name) for r in extra}
    installed = _with_requirements({Requirement(d).name for d in project["dependencies"]} | {r.name for r in extra})
    by_module = metadata.packages_distributions()
    missing = []
    for source in sorted((REPO / "notebooks" / "src").glob("[0-9][0-9]_*.py")):
        for match in re.finditer(r"^\s*(?:import|from)\s+([A-Za-z_]\w*)", source.read_text(), re.M):
            module = match.group(1)
            if module in sys.stdlib_module_names or module == "torch_nbdebug":
                continue
            dists = {_canon(d) for d in by_module.get(module, [module])}
            if not dists & installed:
                missing.append(f"{source.name}: import {module} ({', '.join(sorted(dists))})")
    assert not missing, f"not brought by the dependencies or the [notebooks] extra: {missing}"
