"""The layering of DESIGN.md section 1, proven in fresh interpreters."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "torch_nbdebug"


def _modules(layer: str) -> list[str]:
    """Every module of the layer, those in its tools' folders (record/grads/...) too."""
    return sorted(".".join(("torch_nbdebug",) + p.relative_to(PKG).with_suffix("").parts)
                  for p in (PKG / layer).rglob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("layer", ["record", "data", "process"])
def test_lower_layers_do_not_import_ipython_or_render(layer: str) -> None:
    modules = _modules(layer)
    assert modules, f"no modules found in torch_nbdebug/{layer}"
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m == 'IPython' or m.startswith(('IPython.', 'ipywidgets', "
        "'anywidget', 'torch_nbdebug.render', 'torch_nbdebug.magics')))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"torch_nbdebug.{layer} pulled in {out}"


def test_render_never_imports_record() -> None:
    offenders = [str(p.relative_to(PKG)) for p in (PKG / "render").rglob("*.py")
                 if "torch_nbdebug.record" in p.read_text()]
    assert offenders == []


def test_only_magics_import_ipython() -> None:
    offenders = []
    for path in PKG.rglob("*.py"):
        if "magics" in path.parts:
            continue
        for line in path.read_text().splitlines():
            stripped = line.strip()
            if stripped.startswith(("import IPython", "from IPython")):
                offenders.append(f"{path.relative_to(PKG)}: {stripped}")
    assert offenders == []


def test_import_package_is_cheap() -> None:
    code = "import sys, torch_nbdebug; print(any(m.startswith(('IPython', 'anywidget')) for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"
