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
    "08_monitoring_training", "09_finding_slow_steps",
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


# The course: each of these notebooks ends with an exercise (see test_course_notebook_ends_with_an_exercise).
COURSE = EXPECTED[:8]
_SOLUTION = "<details><summary>Solution</summary>"
_FENCED_PYTHON = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def _solution_cells(cell: Any) -> list[str]:
    """The code cells of a folded solution (one per fenced block of a markdown cell), or []."""
    if cell.cell_type != "markdown" or _SOLUTION not in cell.source:
        return []
    return [block.strip("\n") for block in _FENCED_PYTHON.findall(cell.source)]


def _with_solutions_run(nb: Any) -> Any:
    """A copy of ``nb`` with each folded solution's code blocks as cells right after it, so running
    the notebook proves every solution fixes its exercise (the solutions assert that they do)."""
    cells = []
    for cell in nb.cells:
        cells.append(cell)
        for code in _solution_cells(cell):
            solution = nbformat.v4.new_code_cell(code)
            solution.metadata["tags"] = ["solution"]
            cells.append(solution)
    copy = nbformat.from_dict(dict(nb))
    copy.cells = cells
    return copy


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
    nb = _with_solutions_run(nbformat.read(path, as_version=4))
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


_LOCAL_PATH = re.compile(r"(?<![\w.])/(?:work|tmp|home|root)/[^\s\"'\\]*")


@pytest.mark.parametrize("path", _notebook_paths(), ids=lambda p: p.stem)
def test_committed_notebook_carries_no_local_paths(path: Path) -> None:
    """A reader sees `.../site-packages/torch/...`, never where the notebook happened to be built."""
    found = sorted(set(_LOCAL_PATH.findall(path.read_text(encoding="utf-8"))))
    assert not found, (f"{path.name} shows local machine paths (rebuild with notebooks/_build.py, which "
                       f"rewrites them): {found[:5]}")


def test_build_rewrites_machine_paths_in_outputs_and_widget_state() -> None:
    build = _load_build()
    repo = Path("/work/checkout")
    tb = ("File \x1b[0;32m/work/checkout/.venv/lib/python3.11/site-packages/torch/nn/modules/module.py:1778\x1b[0m\n"
          "File /root/.pyenv/versions/3.11.7/lib/python3.11/contextlib.py:158\n"
          "> /tmp/ipykernel_7336/3428801331.py(9)forward()\n"
          "/work/checkout/torch_nbdebug/record/explain/indices.py:86 and /home/u/env/lib/python3.12/site-packages/a.py")
    assert build.neutral_paths(tb, repo) == (
        "File \x1b[0;32m.../site-packages/torch/nn/modules/module.py:1778\x1b[0m\n"
        "File .../lib/python3.11/contextlib.py:158\n"
        "> .../ipykernel_7336/3428801331.py(9)forward()\n"
        "./torch_nbdebug/record/explain/indices.py:86 and .../site-packages/a.py")
    png = "iVBORw0KGgo/tmp/ipykernel_1/AAAA"  # base64 images are never rewritten
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x", outputs=[
        nbformat.v4.new_output("error", ename="E", evalue="in /tmp/ipykernel_9/1.py", traceback=[tb]),
        nbformat.v4.new_output("display_data", data={
            "text/plain": "cell /tmp/ipykernel_9/1.py", "image/png": png,
            "application/json": {"line": {"filename": "/tmp/ipykernel_9/1.py"}}}),
    ])])
    nb.metadata["widgets"] = {"state": {"m": {"/tmp/ipykernel_9/2.py": {"filename": "/work/checkout/x.py"}}}}
    build.strip_machine_paths(nb, repo)
    nbformat.validate(nb)
    error, shown = nb.cells[0].outputs
    assert error.evalue == "in .../ipykernel_9/1.py" and "/work/" not in error.traceback[0]
    assert shown.data["text/plain"] == "cell .../ipykernel_9/1.py" and shown.data["image/png"] == png
    assert shown.data["application/json"]["line"]["filename"] == ".../ipykernel_9/1.py"
    assert nb.metadata["widgets"]["state"]["m"] == {".../ipykernel_9/2.py": {"filename": "./x.py"}}


@pytest.mark.parametrize("name", COURSE)
def test_course_notebook_ends_with_an_exercise(name: str) -> None:
    """Exercise heading, the broken cell (tagged raises-exception when it raises: the headless run
    checks that it does), then its solution folded below it, with code the headless run executes."""
    cells = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4).cells
    heading, broken, solution = cells[-3:]
    assert heading.cell_type == "markdown" and heading.source.startswith("## Exercise"), heading.source
    assert broken.cell_type == "code" and broken.source.strip()
    assert solution.cell_type == "markdown" and solution.source.startswith(_SOLUTION), solution.source
    assert solution.source.rstrip().endswith("</details>")
    code = "\n".join(_solution_cells(solution))
    assert code.strip() and code.strip() != broken.source.strip(), "the solution must change the cell"
    assert "assert" in code, "a solution checks that it fixed the exercise"


def test_solutions_are_found_and_inserted_after_their_cell() -> None:
    build = _load_build()
    cells = build.parse(
        '# %% [markdown]\n# ## Exercise\n\n# %% tags=["raises-exception"]\nraise ValueError\n\n'
        "# %% [markdown]\n# <details><summary>Solution</summary>\n#\n# Why.\n#\n# ```python\n"
        "# x = 1\n#\n# y = 2\n# ```\n#\n# ```python\n# assert x == 1\n# ```\n#\n# </details>\n")
    nb = _with_solutions_run(nbformat.v4.new_notebook(cells=cells))
    assert [c.cell_type for c in nb.cells] == ["markdown", "code", "markdown", "code", "code"]
    assert [c.source for c in nb.cells[-2:]] == ["x = 1\n\ny = 2", "assert x == 1"]
    assert nb.cells[-1].metadata["tags"] == ["solution"]
