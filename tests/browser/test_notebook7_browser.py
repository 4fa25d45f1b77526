"""Notebook 7 (the `notebook` package, JupyterLab's components in a one-notebook page): the same server
as the other browser tests, its ``/tree`` file browser and ``/notebooks/<path>`` pages.

- In a 900-px window every view (nanwatch card, graph, memory timeline and memory now, gradient
  stepper and flow chart, explain, repro, monitor) renders, fits its output area (a wide part scrolls
  inside the view) and responds to a click; Tab reaches a nanwatch row and a graph node with a visible
  focus, and Enter acts on them. Then Settings > Theme > JupyterLab Dark: every view turns dark with
  readable text, the graph's canvas too.
- A committed teaching notebook opened from ``/tree`` as saved (untrusted: this server never ran it)
  shows every figure (``<img>`` decoded, naturalWidth > 0) and its views' key text.

One kernel run for all the live views, to keep the suite short. Screenshots: test-artifacts/nb7_*.png.
"""
from __future__ import annotations

import re
from typing import Any

import nbformat
import pytest
from conftest import _JS_PANEL_READY, DARK, LIGHT, NOTEBOOK7, REPO
from gallery import CELLS, JS_COLOURS, JS_OVERFLOW, STATIC_VIEWS, VIEWS, dark_problems
from playwright.sync_api import expect

pytestmark = pytest.mark.browser

NARROW = (900, 1000)
# view -> (cell index, selector of its root in that cell's output area): the gallery's views, and
# for explain the live widget (the one with buttons), not the static card printed with the traceback.
NB7_VIEWS = {**VIEWS, **STATIC_VIEWS,
             "explain": (VIEWS["explain"][0], ".tnd-explain-view:has(button.xp-toggle)")}

FOCUS_RING = "e => { const s = getComputedStyle(e); return s.outlineStyle !== 'none' && parseFloat(s.outlineWidth) >= 1; }"


def _view(lab: Any, page: Any, name: str) -> Any:
    cell, selector = NB7_VIEWS[name]
    return lab.output(page, cell).locator(selector).first


def _click_each_view(lab: Any, page: Any) -> None:
    """One click per view, and what it must change."""
    nanwatch = _view(lab, page, "nanwatch")
    title = nanwatch.locator(".nw-card .nw-title")
    expect(title).to_contain_text("Inf born in backward: SqrtBackward0")
    nanwatch.locator("tr.nw-event").nth(1).click()
    expect(title).to_contain_text("Inf born in forward: aten.exp.default")

    graph = _view(lab, page, "graph")
    node = graph.locator("g.node.op[aria-label='details of sqrt']")  # in view at the first zoom
    node.click()
    expect(graph.locator("g.node.selected")).to_have_count(1)
    expect(node).to_have_class(re.compile(r"\bselected\b"))
    expect(graph.locator(".tnd-graph-details table")).to_be_visible()

    memory = _view(lab, page, "memory_timeline")
    hi = memory.get_attribute("data-hi")
    memory.locator("button[data-action='in']").click()  # zoom in: the kernel re-decimates
    expect(memory).not_to_have_attribute("data-hi", hi or "")

    state = _view(lab, page, "memory_state")
    state.locator("table.tensors tr[tabindex]").first.click()
    expect(state.locator(".tip")).to_contain_text(" on cpu")

    grads = _view(lab, page, "grads")
    label = grads.locator(".tnd-layer-name")
    expect(label).to_have_text("1/7 deep.0")
    grads.locator("button.tnd-next").click()
    expect(label).to_have_text("2/7 deep.2")

    explain = _view(lab, page, "explain")
    toggle = explain.locator("button.xp-toggle")
    opened = toggle.get_attribute("aria-expanded")
    toggle.click()
    expect(toggle).not_to_have_attribute("aria-expanded", opened or "")

    repro = _view(lab, page, "repro")  # static HTML: its <details> opens on a click
    preflight = repro.locator("details")
    preflight.locator("summary").click()
    expect(preflight).to_have_attribute("open", "")
    expect(preflight.locator("li").first).to_be_visible()

    monitor = _view(lab, page, "monitor")
    expect(monitor.locator(".tnd-title")).to_contain_text("30 steps recorded")
    curve = monitor.locator("path.tnd-smooth").first
    before = curve.get_attribute("d")
    monitor.locator("input.tnd-log").check()
    expect(monitor.locator("path.tnd-smooth").first).not_to_have_attribute("d", before or "")


def _keyboard(lab: Any, page: Any) -> None:
    """Tab to a nanwatch row and to a graph node: visible focus, Enter acts, the notebook stays in
    command mode (the keys went to the view, not to Notebook 7's shortcuts)."""
    nanwatch = _view(lab, page, "nanwatch")
    title = nanwatch.locator(".nw-card .nw-title")
    nanwatch.locator("tr.nw-event").nth(1).focus()
    page.keyboard.press("Shift+Tab")
    first = nanwatch.locator("tr.nw-event[data-index='0']")
    expect(first).to_be_focused()
    assert first.evaluate(FOCUS_RING), "no visible focus on the nanwatch row"
    page.keyboard.press("Enter")
    expect(title).to_contain_text("Inf born in backward: SqrtBackward0")
    expect(nanwatch.locator("tr.nw-event[data-index='0']")).to_have_attribute("aria-current", "true")
    lab.screenshot(nanwatch, "nb7_nanwatch_focus")

    graph = _view(lab, page, "graph")
    graph.locator("input.tnd-graph-search").focus()
    for _ in range(40):  # Tab through the toolbar into the graph, to the first node
        page.keyboard.press("Tab")
        if page.evaluate("() => !!(document.activeElement && document.activeElement.matches"
                         " && document.activeElement.matches('.tnd-graph-widget g.node'))"):
            break
    else:
        raise AssertionError("Tab never reached a node of the graph")
    focused = graph.locator("g.node:focus")
    ring = focused.evaluate("el => { const r = el.querySelector('rect'); const s = getComputedStyle(r);"
                            " return [s.strokeWidth, getComputedStyle(el).outlineStyle]; }")
    assert float(ring[0].rstrip("px")) >= 2.5 or ring[1] not in ("none", ""), f"no visible focus: {ring}"
    node_id = focused.get_attribute("data-id")
    expect(focused).not_to_have_class(re.compile(r"\bselected\b"))  # Enter must be what selects it
    page.keyboard.press("Enter")
    expect(graph.locator(f"g.node.selected[data-id='{node_id}']")).to_have_count(1)
    name = graph.locator(f"g.node[data-id='{node_id}'] text").first.text_content() or ""
    expect(graph.locator(".tnd-graph-details")).to_contain_text(name.strip())
    lab.screenshot(graph, "nb7_graph_focus")
    assert page.evaluate("() => window.jupyterapp.shell.currentWidget.content.mode") == "command"


def test_every_view_in_notebook7_fits_900_px_responds_and_follows_dark(lab: Any) -> None:
    page = lab.run_notebook(CELLS, name="nb7_views", allow_errors=True, viewport=NARROW, ui=NOTEBOOK7)
    # Notebook 7, not JupyterLab: its own application on its own URL.
    assert page.evaluate("() => window.jupyterapp.name") == "Jupyter Notebook"
    assert "/notebooks/nb7_views.ipynb" in page.url
    assert page.evaluate("() => window.innerWidth") == NARROW[0]

    cut_off = {}
    for view in NB7_VIEWS:
        root = _view(lab, page, view)
        expect(root).to_be_visible()
        root.scroll_into_view_if_needed()
        found = root.evaluate(JS_OVERFLOW)
        assert 500 < found["areaWidth"] < NARROW[0], (view, found)  # the output is narrower than the window
        if found["offenders"] or found["rootScrollWidth"] > found["areaWidth"]:
            cut_off[view] = found
        lab.screenshot(root, f"nb7_{view}_900")
    assert not cut_off, f"views that run past the output area in Notebook 7 at 900 px: {cut_off}"

    _click_each_view(lab, page)
    _keyboard(lab, page)
    lab.screenshot(page, "nb7_page_900")

    # Settings > Theme > JupyterLab Dark, as a person would switch it in Notebook 7.
    page.evaluate("(t) => window.jupyterapp.commands.execute('apputils:change-theme', {theme: t})", DARK)
    page.wait_for_function("() => document.body.dataset.jpThemeLight === 'false'")
    page.wait_for_timeout(300)  # the theme's stylesheet applies on the next frame
    problems = []
    for view in NB7_VIEWS:
        root = _view(lab, page, view)
        root.scroll_into_view_if_needed()
        found = root.evaluate(JS_COLOURS)
        assert found["texts"], f"{view}: no text found"
        problems += dark_problems(view, found)
        lab.screenshot(root, f"nb7_dark_{view}")
    canvas = _view(lab, page, "graph").locator(".tnd-graph-port").evaluate(JS_COLOURS)["surfaces"][0]
    assert canvas["bg"] < 0.1, f"the graph's canvas stays light: {canvas}"
    assert not problems, "\n".join(problems)
    page.evaluate("(t) => window.jupyterapp.commands.execute('apputils:change-theme', {theme: t})", LIGHT)


# Committed notebooks with figures, and text each must show from its tools' static views (01, 06 and
# 08 also show that the course uses %explain, %%repro and %%monitor; 01 and 06 have figures too).
SAVED = {
    "01_reading_errors.ipynb": ("Shape mismatch: cnn.fc expects 128 input features but gets 2048",),
    "03_seeing_the_graph.ipynb": ("graph of net(...): 52 autograd nodes", "Boxes:"),
    "04_watching_gradients.ipynb": ("gradients of model: 9 layers", "Gradient flow per layer"),
    "05_memory.ipynb": ("memory timeline (cpu): peak", "memory now (cpu)"),
    "06_reproducibility_numerics.ipynb": ("repro: the runs differ - cause: rng", "first difference"),
    "08_monitoring_training.ipynb": ("150 steps recorded", "Inf born in forward"),
}
_JS_IMAGES = """(root) => Array.from(root.querySelectorAll('.jp-OutputArea-output img')).map((i) => ({
  natural: i.naturalWidth, shown: i.getBoundingClientRect().width, complete: i.complete}))"""
_JS_TRUSTED = """() => window.jupyterapp.shell.currentWidget.content.widgets
  .filter((c) => c.model.type === 'code' && c.model.outputs.length).map((c) => c.model.trusted)"""


def _figures(name: str) -> int:
    nb = nbformat.read(REPO / "notebooks" / name, as_version=4)
    return sum("image/png" in out.get("data", {}) for cell in nb.cells for out in cell.get("outputs", []))


def test_untrusted_committed_notebooks_in_notebook7_show_their_figures(lab: Any) -> None:
    for name in SAVED:  # as a clone has them: outputs saved, never run on this server
        (lab.server.root / name).write_bytes((REPO / "notebooks" / name).read_bytes())
    tree = lab.open_tree()
    problems = []
    for name, texts in SAVED.items():
        # The file browser lists the notebook and opens it in its own /notebooks/ page.
        item = tree.locator(".jp-DirListing-item", has_text=name)
        expect(item).to_be_visible()
        with lab.context.expect_page() as opened:
            item.dblclick()
        page = opened.value
        lab.pages.append(page)
        page.set_viewport_size({"width": 1200, "height": 1000})
        page.wait_for_function(_JS_PANEL_READY, arg=name, timeout=240_000, polling=250)
        assert f"/notebooks/{name}" in page.url
        trusted = page.evaluate(_JS_TRUSTED)
        assert trusted and not any(trusted), f"{name} must open untrusted: {trusted}"
        notebook = page.locator(".jp-NotebookPanel .jp-Notebook")
        for text in texts:
            expect(notebook).to_contain_text(text)
        page.wait_for_function(
            "() => Array.from(document.querySelectorAll('.jp-OutputArea-output img')).every((i) => i.complete)",
            timeout=60_000)
        images = notebook.evaluate(_JS_IMAGES)
        shown = [i for i in images if i["natural"] > 0]
        want = _figures(name)
        assert want > 0, f"{name} has no figure to check"
        if len(shown) < want or len(shown) < len(images):
            problems.append(f"{name}: {len(shown)} of {want} figures decoded ({images})")
        text = notebook.inner_text()
        if "<svg" in text or "base64" in text or "IPython.core.display" in text:
            problems.append(f"{name}: markup or an object repr shows as text")
        first = notebook.locator(".jp-OutputArea-output img").first
        first.scroll_into_view_if_needed()
        lab.screenshot(page, f"nb7_untrusted_{name[:2]}")
        page.close()
    lab.screenshot(tree, "nb7_tree")
    assert not problems, "\n".join(problems)
