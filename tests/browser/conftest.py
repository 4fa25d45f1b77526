"""Real-browser harness: a JupyterLab server on localhost driven by headless Chromium.

The session-scoped ``lab`` fixture starts JupyterLab from this venv (its own kernel spec, settings,
workspaces and runtime files in a temporary folder, so nothing leaks in or out) and Debian's
Chromium through playwright's sync API. A test writes or copies a notebook, runs all of its cells as
a person would from the Run menu, and asserts on what the output area shows::

    @pytest.mark.browser
    def test_view(lab):
        page = lab.run_notebook(["print('hi')"], name="hi")
        expect(lab.output(page, 0)).to_contain_text("hi")
        lab.screenshot(page, "hi")

Also: ``lab.open_notebook(path)`` (an existing .ipynb, run afresh), ``lab.cell(page, i)`` and
``lab.output(page, i)`` (locators; markdown cells count), ``lab.output_text(page, i)``,
``lab.run_cell(page, source)`` (append a cell, run it, return its output area: to check the kernel's
side after clicking a widget), and ``lab.screenshot(page_or_locator, name)``. A cell that raises fails
the test with its traceback unless ``allow_errors=True``.

``run_notebook`` and ``open_notebook`` also take ``viewport=(width, height)`` (the window size, e.g.
``(900, 1000)`` for a narrow window; default 1400x1000), ``theme=DARK`` (JupyterLab's own dark
theme, set in the user settings before the page loads and removed after the test) and
``ui=NOTEBOOK7``: the same server's Notebook 7 front end (the ``notebook`` package, a server
extension next to JupyterLab) at ``/notebooks/<path>`` instead of JupyterLab at ``/lab/tree/<path>``.
Notebook 7 is built from JupyterLab's components, so ``cell``/``output`` and the page scripts work in
both. ``lab.open_saved(path, ui=...)`` opens a notebook as saved, outputs kept and nothing run (a
file that was not run here is untrusted); ``lab.open_tree()`` opens Notebook 7's file browser.

Every test under tests/browser is marked ``browser``. A failing test leaves a screenshot of each
page it opened, plus the page's console, in test-artifacts/. Timeouts are generous and every wait
is for a condition, never a fixed sleep, because CI shares two cores.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import nbformat
import pytest
from labserver import LabServer  # tests/browser is on sys.path (pytest's default import mode)

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = os.environ.get("NBDEBUG_CHROMIUM", "/usr/bin/chromium")
# Without the background-networking flags Chromium keeps calling home, which a closed network refuses.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--disable-dev-shm-usage",  # containers often mount a tiny /dev/shm
]
KERNEL_READY_S = 300.0
LIGHT = "JupyterLab Light"
DARK = "JupyterLab Dark"
LAB = "lab"  # JupyterLab 4: /lab/tree/<path>
NOTEBOOK7 = "notebook7"  # Notebook 7 on the same server: /tree, /notebooks/<path>
VIEWPORT = (1400, 1000)
RUN_S = 900.0
ACTION_MS = 120_000  # default timeout of every playwright action and expect()

_HERE = Path(__file__).resolve().parent

# JavaScript run in the page. JupyterLab exposes its app as window.jupyterapp (expose_app_in_browser).
_FIND = """
  const findPanel = (p) => {
    const app = window.jupyterapp;
    if (!app || !app.shell) return null;
    for (const w of app.shell.widgets('main')) {
      if (w.context && w.context.path === p && w.content) return w;
    }
    return null;
  };
"""
# JupyterLab marks the applied theme on <body> (data-jp-theme-name) once its CSS is loaded.
_JS_THEME = """(name) => document.body.dataset.jpThemeName === name"""
# The notebook panel is there with its cells (outputs as saved), whatever the kernel does.
_JS_PANEL_READY = """(path) => {""" + _FIND + """
  const w = findPanel(path);
  return !!w && w.context.isReady && w.content.widgets.length > 0;
}
"""
_JS_KERNEL_READY = """(path) => {""" + _FIND + """
  const w = findPanel(path);
  if (!w || !w.context.isReady) return false;
  const k = w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!k && k.status === 'idle' && w.content.widgets.length > 0;
}
"""
_JS_RUN_ALL = """(path) => {""" + _FIND + """
  const w = findPanel(path);
  // Remember a crash even if the kernel is back to idle before the next poll.
  const trouble = (window.__tndKernelTrouble = window.__tndKernelTrouble || {});
  trouble[path] = null;
  const changed = (window.__tndStatusAt = window.__tndStatusAt || {});
  changed[path] = Date.now();
  w.sessionContext.statusChanged.connect((_, status) => {
    changed[path] = Date.now();
    if (['dead', 'restarting', 'autorestarting'].includes(status)) trouble[path] = status;
  });
  window.jupyterapp.shell.activateById(w.id);
  // Same command as the menu's Run > Run All Cells; not awaited, the caller polls for the end.
  void window.jupyterapp.commands.execute('notebook:run-all-cells');
  return true;
}
"""
# Done = kernel idle, no [*] prompt, and every non-empty code cell has an execution count
# (or a cell failed, after which Run All stops and leaves the rest unexecuted).
_JS_RUN_STATE = """(path) => {""" + _FIND + """
  const w = findPanel(path);
  if (!w) return {done: false, why: 'notebook panel not found'};
  const k = w.sessionContext.session && w.sessionContext.session.kernel;
  const status = k ? k.status : 'no kernel';
  const cells = w.content.widgets;
  const errors = [];
  let missing = 0;
  cells.forEach((c, i) => {
    if (c.model.type !== 'code') return;
    // A cell tagged raises-exception is meant to fail; Run All goes on past it (as nbclient does).
    const expected = (c.model.getMetadata('tags') || []).includes('raises-exception');
    if (c.model.sharedModel.getSource().trim() !== '' && c.model.executionCount === null) missing++;
    const outs = c.model.outputs;
    for (let j = 0; j < outs.length; j++) {
      const o = outs.get(j).toJSON();
      if (o.output_type === 'error' && !expected) {
        errors.push({cell: i, ename: o.ename, evalue: o.evalue, traceback: (o.traceback || []).join('\\n')});
      }
    }
  });
  const busy = Array.from(w.node.querySelectorAll('.jp-InputArea-prompt'))
    .some((p) => p.textContent.includes('*'));
  const done = status === 'idle' && !busy && (missing === 0 || errors.length > 0);
  const crashed = (window.__tndKernelTrouble || {})[path] || null;
  return {done, status, busy, missing, errors, crashed};
}
"""
# Widget updates from a click go to the kernel as comm messages, and ipywidgets holds back all but
# one until the kernel answers: a cell run right after a click could overtake them. So a cell is
# only appended once the kernel has been idle, with no status change, for half a second.
_JS_KERNEL_SETTLED = """(path) => {""" + _FIND + """
  const w = findPanel(path);
  const k = w.sessionContext.session && w.sessionContext.session.kernel;
  const at = (window.__tndStatusAt || {})[path] || 0;
  return !!k && k.status === 'idle' && Date.now() - at > 500;
}
"""
_JS_APPEND_AND_RUN = """([path, source]) => {""" + _FIND + """
  const w = findPanel(path);
  const notebook = w.content;
  const index = notebook.model.cells.length;
  notebook.model.sharedModel.insertCell(index, {cell_type: 'code', source});
  notebook.activeCellIndex = index;
  void window.jupyterapp.commands.execute('notebook:run-cell');
  return index;
}
"""
_JS_CELL_STATE = """([path, index]) => {""" + _FIND + """
  const w = findPanel(path);
  const k = w.sessionContext.session && w.sessionContext.session.kernel;
  const cell = w.content.widgets[index];
  const errors = [];
  for (let j = 0; j < cell.model.outputs.length; j++) {
    const o = cell.model.outputs.get(j).toJSON();
    if (o.output_type === 'error') {
      errors.push({cell: index, ename: o.ename, evalue: o.evalue, traceback: (o.traceback || []).join('\\n')});
    }
  }
  const busy = cell.node.querySelector('.jp-InputArea-prompt').textContent.includes('*');
  const done = !!k && k.status === 'idle' && !busy && cell.model.executionCount !== null;
  return {done, errors};
}
"""

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _clean_notebook(nb: Any) -> Any:
    """Drop stored outputs and counts so 'every cell has a count' means 'ran in this browser'."""
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    return nb


class Lab:
    """What browser tests use: notebooks opened and run in JupyterLab in headless Chromium."""

    def __init__(self, server: LabServer, context: Any) -> None:
        self.server = server
        self.context = context
        self.pages: list[Any] = []  # pages opened by the current test
        self.console: dict[int, list[str]] = {}
        self._paths: dict[int, str] = {}  # id(page) -> notebook path in the server root
        self._count = 0

    # ----- public API -------------------------------------------------------------------------
    def run_notebook(self, cells: list[str], name: str, *, timeout: float = RUN_S,
                     allow_errors: bool = False, viewport: tuple[int, int] | None = None,
                     theme: str | None = None, ui: str = LAB) -> Any:
        """Write a notebook of these code cells as ``<name>.ipynb``, open it, run all cells, return the page."""
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for src in cells])
        return self._open_and_run(_clean_notebook(nb), f"{name}.ipynb", timeout, allow_errors, viewport, theme, ui)

    def open_notebook(self, path: str | os.PathLike[str], *, timeout: float = RUN_S,
                      allow_errors: bool = False, viewport: tuple[int, int] | None = None,
                      theme: str | None = None, ui: str = LAB) -> Any:
        """Copy an existing notebook into the server root (outputs dropped), open it and run all cells."""
        src = _in_repo(path)
        nb = nbformat.read(src, as_version=4)
        return self._open_and_run(_clean_notebook(nb), src.name, timeout, allow_errors, viewport, theme, ui)

    def open_saved(self, path: str | os.PathLike[str], *, viewport: tuple[int, int] | None = None,
                   ui: str = LAB) -> Any:
        """Copy a notebook file as it is (outputs kept, no signature added) into the server root and open
        it without running a cell: what a person sees on opening a notebook someone else saved (untrusted,
        since this server never ran it). Returns the page once the notebook shows its cells."""
        src = _in_repo(path)
        shutil.copyfile(src, self.server.root / src.name)
        page = self._new_page(viewport)
        self._paths[id(page)] = src.name
        self._goto(page, src.name, ui)
        self._wait(page, _JS_PANEL_READY, src.name, KERNEL_READY_S, f"{src.name}: notebook open")
        self._wait(page, _JS_THEME, LIGHT, KERNEL_READY_S, f"{src.name}: theme {LIGHT}")
        page.evaluate("() => window.jupyterapp.shell.collapseLeft()")
        return page

    def open_tree(self, *, viewport: tuple[int, int] | None = None) -> Any:
        """Notebook 7's file browser (``/tree``) on the server root; returns the page once it lists files."""
        page = self._new_page(viewport)
        page.goto(f"{self.server.url}/tree?token={self.server.token}", wait_until="domcontentloaded")
        page.locator(".jp-DirListing-content").wait_for(timeout=KERNEL_READY_S * 1000)
        return page

    def run_cell(self, page: Any, source: str, *, timeout: float = RUN_S,
                 allow_errors: bool = False) -> Any:
        """Append a code cell to the page's notebook, run it, wait for it; return its output area.

        For checking the kernel's side after clicking in a widget (e.g. a trait synced back)."""
        path = self._paths[id(page)]
        page.wait_for_timeout(500)  # let a click's comm message reach the kernel and make it busy
        self._wait(page, _JS_KERNEL_SETTLED, path, KERNEL_READY_S, f"{path}: widget messages to settle")
        index = int(page.evaluate(_JS_APPEND_AND_RUN, [path, source]))
        deadline = time.monotonic() + timeout
        while True:
            state = page.evaluate(_JS_CELL_STATE, [path, index])
            if state["done"]:
                break
            if time.monotonic() > deadline:
                self.screenshot(page, f"TIMEOUT-{Path(path).stem}-cell{index}")
                raise AssertionError(f"{path}: cell {index} still running after {timeout:.0f}s")
            page.wait_for_timeout(200)
        self._check_errors(page, path, state["errors"], allow_errors)
        return self.output(page, index)

    def screenshot(self, target: Any, name: str) -> Path:
        """Save a PNG of a page (what the window shows) or of one element (a Locator, e.g. an output
        area, scrolled into view) as test-artifacts/<name>.png; return its path."""
        ARTIFACTS.mkdir(exist_ok=True)
        out = ARTIFACTS / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.png"
        target.screenshot(path=str(out))
        return out

    @staticmethod
    def cell(page: Any, index: int) -> Any:
        """Locator of the index-th cell (markdown cells count) of the open notebook."""
        return page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").nth(index)

    def output(self, page: Any, index: int) -> Any:
        """Locator of the output area of the index-th cell: what a person sees under it."""
        return self.cell(page, index).locator(".jp-OutputArea")

    def output_text(self, page: Any, index: int) -> str:
        return str(self.output(page, index).inner_text())

    # ----- internals --------------------------------------------------------------------------
    def _goto(self, page: Any, filename: str, ui: str) -> None:
        self._count += 1
        if ui == LAB:
            # A fresh workspace per page, so JupyterLab restores no tab from an earlier test.
            url = f"{self.server.url}/lab/workspaces/t{self._count}/tree/{quote(filename)}"
        elif ui == NOTEBOOK7:
            url = f"{self.server.url}/notebooks/{quote(filename)}"  # one notebook per page: nothing to restore
        else:
            raise ValueError(f"ui must be {LAB!r} or {NOTEBOOK7!r}, not {ui!r}")
        page.goto(f"{url}?token={self.server.token}", wait_until="domcontentloaded")

    def _open_and_run(self, nb: Any, filename: str, timeout: float, allow_errors: bool,
                      viewport: tuple[int, int] | None = None, theme: str | None = None, ui: str = LAB) -> Any:
        nbformat.validate(nb)
        nbformat.write(nb, self.server.root / filename)
        self.server.set_theme(theme)  # read by the page as it loads; removed again by close_pages
        page = self._new_page(viewport)
        self._paths[id(page)] = filename
        self._goto(page, filename, ui)
        self._wait(page, _JS_KERNEL_READY, filename, KERNEL_READY_S,
                   f"{filename}: notebook open with an idle kernel")
        self._wait(page, _JS_THEME, theme or LIGHT, KERNEL_READY_S, f"{filename}: theme {theme or LIGHT}")
        page.evaluate("() => window.jupyterapp.shell.collapseLeft()")  # room for the outputs
        page.evaluate(_JS_RUN_ALL, filename)
        state = self._wait_for_run(page, filename, timeout)
        self._check_errors(page, filename, state["errors"], allow_errors)
        return page

    def _check_errors(self, page: Any, path: str, errors: list[dict[str, Any]], allow: bool) -> None:
        if not errors or allow:
            return
        self.screenshot(page, f"ERROR-{Path(path).stem}")
        detail = "\n\n".join(f"cell {e['cell']}: {e['ename']}: {e['evalue']}\n"
                             f"{_ANSI.sub('', e['traceback'])}" for e in errors)
        raise AssertionError(f"{path}: a cell raised in the browser kernel\n{detail}")

    def _new_page(self, viewport: tuple[int, int] | None = None) -> Any:
        page = self.context.new_page()
        width, height = viewport or VIEWPORT
        page.set_viewport_size({"width": width, "height": height})
        lines = self.console.setdefault(id(page), [])
        page.on("console", lambda msg: lines.append(f"{msg.type}: {msg.text}"))
        page.on("pageerror", lambda err: lines.append(f"pageerror: {err}"))
        self.pages.append(page)
        return page

    def _wait(self, page: Any, js: str, arg: str, timeout_s: float, what: str) -> None:
        try:
            page.wait_for_function(js, arg=arg, timeout=timeout_s * 1000, polling=250)
        except Exception as exc:
            self.screenshot(page, f"TIMEOUT-{Path(arg).stem}")
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}; server log:\n"
                                 f"{self.server.log_tail()}") from exc

    def _wait_for_run(self, page: Any, filename: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        state: dict[str, Any] = {}
        while time.monotonic() < deadline:
            state = page.evaluate(_JS_RUN_STATE, filename)
            if state["done"]:
                return state
            if state["crashed"]:  # e.g. out of memory: fail now, not after the timeout
                self.screenshot(page, f"KERNEL-{Path(filename).stem}")
                raise AssertionError(f"{filename}: the kernel died while running ({state['crashed']});"
                                     f" server log:\n{self.server.log_tail()}")
            page.wait_for_timeout(300)  # let the page work between polls
        self.screenshot(page, f"TIMEOUT-{Path(filename).stem}")
        raise AssertionError(f"{filename}: cells still running after {timeout_s:.0f}s (last state {state})")

    def close_pages(self) -> None:
        for page in self.pages:
            self.console.pop(id(page), None)
            self._paths.pop(id(page), None)
            try:
                page.close()
            except Exception:  # a crashed page is already gone
                pass
        self.pages.clear()
        self.server.set_theme(None)  # the next page loads with the default (light) theme


def _in_repo(path: str | os.PathLike[str]) -> Path:
    src = Path(path)
    return src if src.is_absolute() else REPO / src


def _require_browser() -> None:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} not found: browser tests use Debian's chromium; run ./dev test "
                    "(it installs it) or apt-get install chromium", pytrace=False)


@pytest.fixture(scope="session")
def lab() -> Iterator[Lab]:
    """One JupyterLab server and one headless Chromium for the whole test session."""
    _require_browser()
    from playwright.sync_api import sync_playwright

    # Failure captures from an earlier run would be mistaken for this run's.
    for stale in ARTIFACTS.glob("*"):
        if stale.name.startswith(("FAILED-", "ERROR-", "TIMEOUT-", "KERNEL-")):
            stale.unlink()
    base = Path(tempfile.mkdtemp(prefix="nbdebug-lab-"))
    server = LabServer(base)
    pw = None
    context = None
    try:
        server.start()
        pw = sync_playwright().start()
        context = pw.chromium.launch_persistent_context(
            str(base / "chromium-profile"), executable_path=CHROMIUM, headless=True,
            args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1000})
        context.set_default_timeout(ACTION_MS)
        from playwright.sync_api import expect

        expect.set_options(timeout=ACTION_MS)
        yield Lab(server, context)
    finally:
        if context is not None:
            context.close()
        if pw is not None:
            pw.stop()
        server.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"_report_{report.when}", report)


@pytest.fixture(autouse=True)
def _browser_test_cleanup(request: Any, lab: Lab) -> Iterator[None]:
    """After each browser test: screenshots and console logs if it failed; close pages; stop kernels."""
    yield
    failed = any(getattr(request.node, f"_report_{when}", None) is not None
                 and getattr(request.node, f"_report_{when}").failed for when in ("setup", "call"))
    if failed:
        stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", request.node.name)
        for i, page in enumerate(lab.pages):
            try:
                lab.screenshot(page, f"FAILED-{stem}-{i}")
                (ARTIFACTS / f"FAILED-{stem}-{i}.console.txt").write_text(
                    "\n".join(lab.console.get(id(page), [])))
            except Exception:  # a crashed page cannot be captured; the failure itself is reported
                pass
    lab.close_pages()
    lab.server.shutdown_kernels()


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.browser)
