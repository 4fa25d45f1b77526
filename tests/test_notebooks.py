"""Every teaching notebook in ``notebooks/`` runs headless, top to bottom, and stays what it teaches.

Each notebook is executed in a fresh ``python3`` kernel of this environment (nbclient). Any error
fails the test, except in cells tagged ``raises-exception`` (those show an error on purpose, and
must still raise it). The notebooks' own ``assert`` cells check the results that matter (the birth
found is the right op, the leak is found, gradcheck passes...), so a notebook cannot silently rot.

Besides execution: the committed ``.ipynb`` files are the ones ``notebooks/_build.py`` generates from
``notebooks/src/`` (no hand edits drifting from the reviewed source), they carry their outputs (so
GitHub shows figures and static views), stay small, and the Binder environment stays CPU-only.
"""
from __future__ import annotations

import importlib.util
import json
import re
import time
from pathlib import Path
from typing import Any

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
EXPECTED = [
    "00_tour", "01_reading_errors", "02_hunting_nans", "03_seeing_the_graph",
    "04_watching_gradients", "05_memory", "06_reproducibility_numerics", "07_code_that_debugs_itself",
]
TIMEOUT_S = 300          # per cell; a whole notebook is meant to take well under a minute
NOTEBOOK_TIMEOUT_S = 480  # per notebook, kernel start included (CI shares two cores)
MAX_NOTEBOOK_BYTES = 2 * 1024 * 1024
# Binder gives a session ~2 GB; the kernel must leave room for the Jupyter server and the browser.
MAX_KERNEL_RSS_MB = 1400
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def _load_build() -> Any:
    spec = importlib.util.spec_from_file_location("notebooks_build", NOTEBOOKS / "_build.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _notebook_paths() -> list[Path]:
    return sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))


def _code_cells(nb: Any) -> list[Any]:
    return [cell for cell in nb.cells if cell.cell_type == "code"]


def _tagged(cell: Any, tag: str) -> bool:
    return tag in cell.get("metadata", {}).get("tags", [])


def _errors(cell: Any) -> list[Any]:
    return [out for out in cell.get("outputs", []) if out.output_type == "error"]


_RSS_PROBE = (
    "import resource as _r, sys as _s\n"
    "_kb = _r.getrusage(_r.RUSAGE_SELF).ru_maxrss\n"
    "print('PEAK_RSS_MB', (_kb / 1024 / 1024) if _s.platform == 'darwin' else _kb / 1024)"
)


@pytest.mark.notebook
@pytest.mark.timeout(NOTEBOOK_TIMEOUT_S)
@pytest.mark.parametrize("name", EXPECTED)
def test_notebook_executes_headless(name: str) -> None:
    """Run the notebook in a fresh kernel; only cells tagged raises-exception may (and must) fail."""
    from nbclient import NotebookClient

    path = NOTEBOOKS / f"{name}.ipynb"
    assert path.exists(), f"{path.name} is missing: run `python notebooks/_build.py --execute {name}`"
    nb = nbformat.read(path, as_version=4)
    for cell in _code_cells(nb):
        cell.outputs = []
    nb.cells.append(nbformat.v4.new_code_cell(_RSS_PROBE))
    client = NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3", allow_errors=False,
                            resources={"metadata": {"path": str(NOTEBOOKS)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError on an error in any untagged cell
    elapsed = time.perf_counter() - start

    for cell in _code_cells(nb):
        if _tagged(cell, "raises-exception"):
            assert _errors(cell), f"cell tagged raises-exception no longer raises:\n{cell.source}"
        for out in cell.outputs:  # every live widget comes with a static view for GitHub/nbconvert
            data = out.get("data", {})
            if WIDGET_MIME in data:
                assert {"text/html", "image/png", "image/svg+xml"} & set(data), cell.source
    probe = "".join(out.get("text", "") for out in nb.cells[-1].outputs)
    peak_mb = float(re.search(r"PEAK_RSS_MB ([\d.]+)", probe).group(1))  # type: ignore[union-attr]
    print(f"{name}: {elapsed:.1f} s, kernel peak RSS {peak_mb:.0f} MB")
    assert peak_mb < MAX_KERNEL_RSS_MB, f"{name} peaks at {peak_mb:.0f} MB: too much for Binder"


def test_every_notebook_is_there_and_nothing_else() -> None:
    assert [p.stem for p in _notebook_paths()] == EXPECTED


@pytest.mark.parametrize("name", EXPECTED)
def test_committed_notebook_matches_its_source(name: str) -> None:
    """The .ipynb cells are exactly what _build.py makes of notebooks/src/<name>.py."""
    build = _load_build()
    expected = build.notebook_for(NOTEBOOKS / "src" / f"{name}.py")
    committed = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    assert [(c.cell_type, c.source, c.get("metadata", {}).get("tags", [])) for c in committed.cells] == \
        [(c.cell_type, c.source, c.get("metadata", {}).get("tags", [])) for c in expected.cells], \
        f"{name}.ipynb differs from notebooks/src/{name}.py: run `python notebooks/_build.py --execute {name}`"
    assert committed.metadata["kernelspec"]["name"] == "python3"


@pytest.mark.parametrize("name", EXPECTED)
def test_committed_notebook_carries_its_outputs(name: str) -> None:
    """GitHub shows what is stored: every code cell ran, in order, and only tagged cells failed."""
    path = NOTEBOOKS / f"{name}.ipynb"
    nb = nbformat.read(path, as_version=4)
    cells = _code_cells(nb)
    counts = [cell.execution_count for cell in cells]
    assert all(counts), f"{name}: cells without an execution count (not executed): {counts}"
    assert counts == sorted(counts), f"{name}: cells executed out of order: {counts}"
    for cell in cells:
        assert bool(_errors(cell)) == _tagged(cell, "raises-exception"), cell.source
    assert path.stat().st_size < MAX_NOTEBOOK_BYTES, f"{name}: {path.stat().st_size} bytes"


@pytest.mark.parametrize("name", EXPECTED)
def test_committed_outputs_show_without_a_kernel(name: str) -> None:
    """No stored output depends on a live kernel: nbconvert would render a widget view as nothing."""
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    for cell in _code_cells(nb):
        for out in cell.outputs:
            assert WIDGET_MIME not in out.get("data", {}), \
                f"{name}: a stored widget view (run notebooks/_build.py, which keeps the static view):\n{cell.source}"
    if any("%load_ext torch_nbdebug" in cell.source for cell in _code_cells(nb)):
        static = [out["data"]["text/html"] for cell in _code_cells(nb) for out in cell.outputs
                  if "text/html" in out.get("data", {})]
        assert any("tnd" in html for html in static), f"{name}: no torch_nbdebug static view stored"


def test_binder_is_cpu_only_and_installs_the_package() -> None:
    requirements = (ROOT / "binder" / "requirements.txt").read_text()
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in requirements
    assert re.search(r"^torch==[\d.]+\+cpu$", requirements, re.M), "pin a CPU build of torch"
    post_build = ROOT / "binder" / "postBuild"
    assert post_build.stat().st_mode & 0o111, "binder/postBuild must be executable"
    assert "pip install" in post_build.read_text() and " -e ." in post_build.read_text()
    for package in ("anywidget", "ipywidgets", "jupyterlab", "matplotlib"):
        assert re.search(rf"^{package}\b", requirements, re.M), package


def test_build_script_parses_tags_and_markdown() -> None:
    build = _load_build()
    cells = build.parse(
        "# %% [markdown]\n# # Title\n#\n# text\n\n# %%\nx = 1\n\n"
        '# %% tags=["raises-exception"]\nraise ValueError\n'
    )
    assert [c.cell_type for c in cells] == ["markdown", "code", "code"]
    assert cells[0].source == "# Title\n\ntext"
    assert cells[1].source == "x = 1"
    assert cells[2].metadata["tags"] == ["raises-exception"]
    assert json.loads(nbformat.writes(nbformat.v4.new_notebook(cells=cells)))["nbformat"] == 4
