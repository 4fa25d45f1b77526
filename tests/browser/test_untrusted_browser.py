"""A saved notebook shows every figure without a kernel and without being trusted (issue 10, part 1).

The notebook is executed headless (nbclient, as notebooks/_build.py does for the committed ones), its
live-widget views dropped exactly as ``keep_static_views`` drops them, and saved unsigned: the
"saved" notebook (what a user's own notebook holds). The "split" notebook has, in addition, each
output's figures as separate ``image/png`` outputs (``render.bundle.split_figures``), for readers
that drop ``<img>`` from HTML. Then:

- JupyterLab opens each without trusting it and without running a cell: its sanitizer strips inline
  ``<svg>`` and ``<style>``; every figure must still be an ``<img>`` that decoded (naturalWidth > 0)
  and every view's key text must be visible;
- nbconvert exports the split notebook with ``sanitize_html=True`` (it escapes ``<img>`` inside HTML
  into text, so only the split notebook can show pictures there) and Chromium opens the HTML;
- Chromium opens nbconvert's plain HTML of the saved notebook with JavaScript disabled (roughly what
  GitHub shows: no script, no widget, only what the file holds).

Screenshots go to test-artifacts/untrusted_*.png (before the change: before_untrusted_*.png).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import quote

import nbformat
import pytest
from conftest import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, REPO
from gallery import EXPLAIN, GRADS, MEMORY, NANWATCH, REPRO, SETUP

PREFIX = os.environ.get("NBDEBUG_UNTRUSTED_PREFIX", "untrusted")  # "before_untrusted" for the baseline

GRAPH = "%graph model(xb).sum()"
# view -> (source, texts a person must be able to read in its static view, figures it must show)
VIEWS: dict[str, tuple[str, tuple[str, ...], int]] = {
    "graph": (GRAPH, ("query_key_value_projection", "sqrt"), 1),
    "nanwatch": (NANWATCH, ("sqrt", "query_key_value_projection"), 0),
    "memory": (MEMORY, ("peak", "activations", "validation_losses_kept_with_their_graphs"), 1),
    "grads": (GRADS, ("Gradient flow", "Linear", ".grad values"), 4),
    "repro": (REPRO, ("randn",), 0),
    "explain": (EXPLAIN, ("mat1 and mat2", "features"), 0),
}
# The %%explain cell fails on purpose (the error it explains): it comes last.
ORDER = ["graph", "nanwatch", "memory", "grads", "repro", "explain"]

_JS_OPEN = """(path) => {
  const app = window.jupyterapp;
  if (!app || !app.shell) return false;
  for (const w of app.shell.widgets('main')) {
    if (w.context && w.context.path === path && w.context.isReady && w.content
        && w.content.widgets.length > 0) return true;
  }
  return false;
}"""
_JS_TRUSTED = """(path) => {
  for (const w of window.jupyterapp.shell.widgets('main')) {
    if (w.context && w.context.path === path)
      return w.content.widgets.filter((c) => c.model.type === 'code').map((c) => c.model.trusted);
  }
  return null;
}"""
# Every <img> of an output: decoded (naturalWidth > 0) and laid out (visible width > 0).
_JS_IMAGES = """(root) => Array.from(root.querySelectorAll('img')).map((i) => ({
  alt: i.alt, natural: i.naturalWidth, shown: i.getBoundingClientRect().width, complete: i.complete}))"""


def _keep_static_views() -> Any:
    """The committed notebooks' own rule for dropping widget views (notebooks/_build.py)."""
    spec = importlib.util.spec_from_file_location("nb_build", REPO / "notebooks" / "_build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.keep_static_views


def build_notebook(path: Path) -> Path:
    """Execute the views' cells headless, keep their static views, save unsigned (= untrusted)."""
    from nbclient import NotebookClient

    cells = [SETUP] + [VIEWS[v][0] for v in ORDER]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    NotebookClient(nb, timeout=600, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(REPO)}}).execute()
    _keep_static_views()(nb, split=False)  # one output per view, as a live session saves it
    for cell in nb.cells:  # a kernel-side failure other than the intended one would hide a view
        for out in cell.outputs:
            if out.output_type == "error":
                assert cell.source == EXPLAIN, f"{cell.source!r} raised {out.ename}: {out.evalue}"
    path.write_text(nbformat.writes(nb))  # no signature: JupyterLab treats its outputs as untrusted
    return path


def split_notebook(source: Path, path: Path) -> Path:
    """The same notebook with every figure as its own ``image/png`` output, in place."""
    from torch_nbdebug.render.bundle import split_figures

    nb = nbformat.read(source, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = [nbformat.from_dict(piece) for out in cell.outputs for piece in split_figures(dict(out))]
    nbformat.validate(nb)
    path.write_text(nbformat.writes(nb))
    return path


@pytest.fixture(scope="module")
def notebooks(tmp_path_factory: Any) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("untrusted")
    saved = build_notebook(folder / "untrusted_saved.ipynb")
    return {"saved": saved, "split": split_notebook(saved, folder / "untrusted_split.ipynb")}


def _cell_output(page: Any, view: str) -> Any:
    index = 1 + ORDER.index(view)
    return page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").nth(index).locator(".jp-OutputArea")


@pytest.mark.parametrize("kind", ["saved", "split"])
def test_untrusted_notebook_in_jupyterlab_shows_every_figure(lab: Any, notebooks: dict[str, Path], kind: str) -> None:
    from playwright.sync_api import expect

    name = notebooks[kind].name
    (lab.server.root / name).write_text(notebooks[kind].read_text())
    page = lab._new_page(viewport=(1400, 2400))  # tall: a whole view fits in one element screenshot
    page.goto(f"{lab.server.url}/lab/workspaces/untrusted-{kind}/tree/{quote(name)}?token={lab.server.token}",
              wait_until="domcontentloaded")
    page.wait_for_function(_JS_OPEN, arg=name, timeout=240_000, polling=250)
    page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
    assert page.evaluate(_JS_TRUSTED, name) == [False] * (1 + len(ORDER)), "the notebook must open untrusted"
    problems = []
    for view in ORDER:
        _, texts, figures = VIEWS[view]
        out = _cell_output(page, view)
        out.scroll_into_view_if_needed()
        for text in texts:
            expect(out).to_contain_text(text)
        page.wait_for_function("(root) => Array.from(root.querySelectorAll('img')).every((i) => i.complete)",
                               arg=out.element_handle(), timeout=60_000)
        images = out.evaluate(_JS_IMAGES)
        lab.screenshot(out, f"{PREFIX}_lab_{view}" + ("_split" if kind == "split" else ""))
        shown = [i for i in images if i["natural"] > 0 and i["shown"] > 0]
        if len(shown) < figures or any(i["natural"] == 0 for i in images):
            problems.append(f"{view}: {len(shown)} of {figures} figures visible ({images})")
        if kind == "saved" and not all(i["alt"] for i in images):  # (a split image/png output has none)
            problems.append(f"{view}: a figure has no alt text ({images})")
        if "<svg" in out.inner_text() or "tnd-" in out.inner_text():
            problems.append(f"{view}: markup shows as text")
    lab.screenshot(page, f"{PREFIX}_lab_page" + ("_split" if kind == "split" else ""))
    assert not problems, "\n".join(problems)


def _nbconvert_html(notebook: Path, sanitize: bool) -> Path:
    subprocess.run([sys.executable, "-m", "nbconvert", "--to", "html", f"--HTMLExporter.sanitize_html={sanitize}",
                    "--output-dir", str(notebook.parent), str(notebook)], check=True, capture_output=True, timeout=300)
    return notebook.with_suffix(".html")


# Chromium in its own process: the session's browser (the ``lab`` fixture) has JavaScript on and
# playwright's sync API runs one instance per thread. Prints, per code cell, its text and its images.
_RENDER = """
import json, sys
from playwright.sync_api import sync_playwright
html, javascript, shots, chromium, args = sys.argv[1], sys.argv[2] == "1", sys.argv[3], sys.argv[4], sys.argv[5:]
with sync_playwright() as pw:
    browser = pw.chromium.launch(executable_path=chromium, headless=True, args=args)
    page = browser.new_context(java_script_enabled=javascript, viewport={"width": 1200, "height": 1000}).new_page()
    page.goto("file://" + html, wait_until="load")
    cells = []
    for i, cell in enumerate(page.locator(".jp-Cell.jp-CodeCell").all()):
        out = cell.locator(".jp-Cell-outputWrapper")
        if out.count() == 0:
            cells.append({"text": "", "html": "", "images": []})
            continue
        out.screenshot(path=f"{shots}_{i}.png")
        html = "".join(h.inner_html() for h in out.locator('[data-mime-type="text/html"]').all())
        cells.append({"text": out.text_content(), "html": html, "images": out.evaluate(IMAGES)})
    page.screenshot(path=f"{shots}_page.png", full_page=True)
    browser.close()
print(json.dumps(cells))
"""


@pytest.mark.parametrize("javascript", [True, False], ids=["nbconvert", "nojs"])
def test_nbconvert_html_shows_every_figure(notebooks: dict[str, Path], javascript: bool) -> None:
    """nbconvert --sanitize_html of the split notebook (JavaScript on), and nbconvert's plain HTML of
    the saved notebook with JavaScript off."""
    html = _nbconvert_html(notebooks["split"], sanitize=True) if javascript else \
        _nbconvert_html(notebooks["saved"], sanitize=False)
    label = "nbconvert" if javascript else "nojs"
    ARTIFACTS.mkdir(exist_ok=True)
    shots = ARTIFACTS / f"{PREFIX}_{label}"
    script = f"IMAGES = {_JS_IMAGES!r}\n" + _RENDER
    done = subprocess.run([sys.executable, "-c", script, str(html), "1" if javascript else "0", str(shots),
                           CHROMIUM, *CHROMIUM_ARGS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    cells = json.loads(done.stdout)
    problems = []
    for view in ORDER:
        _, texts, figures = VIEWS[view]
        index = 1 + ORDER.index(view)
        cell = cells[index]
        Path(f"{shots}_{index}.png").replace(f"{shots}_{view}.png")
        problems += [f"{view}: {t!r} not shown" for t in texts if t not in cell["text"]]
        shown = [i for i in cell["images"] if i["natural"] > 0 and i["shown"] > 0]
        if len(shown) < figures:
            problems.append(f"{view}: {len(shown)} of {figures} figures visible ({cell['images']})")
        # nbconvert's sanitizer escapes tags it does not know (<th>, <h3>, even the <tbody> every table
        # gets): those show as text, as for any HTML output. Never pictures' data, SVG or CSS.
        leaked = ("base64" in cell["text"] or "<img" in cell["text"] or "<svg" in cell["text"]
                  or "<style" in cell["text"] or "font-family" in cell["text"] or ".tnd" in cell["text"])
        if leaked or (not javascript and "&lt;" in cell["html"]):
            problems.append(f"{view}: markup shows as text")
    assert not problems, "\n".join(problems)
