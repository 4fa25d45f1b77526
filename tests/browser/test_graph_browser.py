"""%graph in a real JupyterLab: open a collapsed module in place, select a node and read its details,
close the module again, find a hidden parameter with the search box; the first view is readable
(labels of at least ~10 px, the output in view), the widget follows JupyterLab Dark, and a module box
opens from the keyboard."""
from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import expect

pytestmark = pytest.mark.browser

SETUP = """
import torch
from torch import nn
from torch_nbdebug.magics.graph import MAGICS
get_ipython().register_magics(MAGICS)  # only %graph: this test does not depend on the other features

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(6))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)

net = Net()
x = torch.randn(2, 4)
"""

GRAPH = "g = %graph -o --expand net,net.head net(x).sum()\ng"

# Notebook 03's transformer-like stack: its text promises one collapsed `blocks.0..3 ×4 Block` box.
NOTEBOOK_03_NET = """
import torch
from torch import nn
from torch_nbdebug.magics.graph import MAGICS
get_ipython().register_magics(MAGICS)

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, h):
        return h + self.mlp(self.norm(h))


class Net(nn.Module):
    def __init__(self, d=16, depth=4):
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, 1)

    def forward(self, inputs):
        h = self.embed(inputs)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


net = Net()
tokens = torch.randn(2, 5, 8)
"""
# A bare tensor's graph (modules inferred), 24 layers deep: taller than any output area at 100 %.
DEEP = """
deep = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(24)])
loss = deep(torch.randn(3, 8)).pow(2).mean()
"""

# The smallest on-screen size of the graph's main labels (font size times the zoom the screen shows).
_LABEL_PX = """(stage) => {
  const sizes = [];
  for (const t of stage.querySelectorAll('svg g[data-id] > text:first-of-type')) {
    const box = t.getBBox(), r = t.getBoundingClientRect();
    if (!box.height) continue;
    sizes.push(parseFloat(getComputedStyle(t).fontSize) * r.height / box.height);
  }
  return sizes.length ? Math.min(...sizes) : 0;
}"""


def _inside(inner: Any, outer: Any) -> bool:
    a, b = inner.bounding_box(), outer.bounding_box()
    assert a is not None and b is not None
    return (a["x"] >= b["x"] - 1 and a["y"] >= b["y"] - 1 and a["x"] + a["width"] <= b["x"] + b["width"] + 1
            and a["y"] + a["height"] <= b["y"] + b["height"] + 1)


def _rgb(css: str) -> tuple[float, ...]:
    """0-255 channels of a computed colour: ``rgb(a, b, c)``, ``rgba(...)`` or ``color(srgb r g b)`` (0-1)."""
    inner = css[css.index("(") + 1:css.index(")")]
    if css.startswith("color("):
        return tuple(255 * float(v) for v in inner.split()[1:4])
    return tuple(float(v) for v in inner.split(",")[:3])


def _luminance(css: str) -> float:
    r, g, b = _rgb(css)
    return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255


def test_click_module_to_expand_and_node_for_details(lab) -> None:
    page = lab.run_notebook([SETUP, GRAPH], name="graph_explorer")
    out = lab.output(page, 1)
    widget = out.locator(".tnd-graph-widget")
    expect(widget).to_be_visible()
    blocks = widget.locator("g.group[data-id='m:net.blocks']")
    expect(blocks).to_contain_text("blocks.0..5 ×6 Sequential")
    expect(widget.locator("[data-id='m:net.blocks.3']")).to_have_count(0)

    stage = widget.locator(".tnd-graph-stage").element_handle()
    before = stage.evaluate("el => el.style.transform")
    widget.locator(".tnd-graph-port").hover()
    page.mouse.wheel(0, -400)  # zoom in around the pointer
    page.wait_for_function("([el, old]) => el.style.transform !== old", arg=[stage, before])
    assert "scale(" in stage.evaluate("el => el.style.transform")
    widget.locator("button", has_text="fit").click()

    blocks.click()  # open in place: the six blocks appear, the repeated box goes
    expect(widget.locator("g.group[data-id='m:net.blocks.3']")).to_be_visible()
    expect(widget.locator("g.cluster[data-id='m:net.blocks']")).to_have_count(1)
    expect(widget.locator("g.group[data-id='m:net.blocks']")).to_have_count(0)
    lab.screenshot(page, "graph_expanded")

    weight = widget.locator("g.node.param[data-id]").filter(has_text="weight").first
    weight.click()
    details = widget.locator(".tnd-graph-details")
    expect(details).to_contain_text("net.head.weight")
    expect(details).to_contain_text("[2, 4] float32")
    expect(details).to_contain_text("AccumulateGrad")

    widget.locator("g.cluster[data-id='m:net.blocks'] text.title").click()  # click again: closed
    expect(widget.locator("g.group[data-id='m:net.blocks']")).to_be_visible()
    expect(lab.run_cell(page, "print(sorted(g.expanded))")).to_contain_text("['m:net', 'm:net.head']")

    # search finds a parameter hidden in a closed block; picking it opens the block and selects it
    widget.locator("input.tnd-graph-search").fill("blocks.4.0.weight")
    match = widget.locator(".tnd-graph-match").first
    expect(match).to_contain_text("net.blocks.4.0.weight")
    match.click()
    expect(details).to_contain_text("net.blocks.4.0.weight")
    expect(widget.locator("g.node.param.selected")).to_have_count(1)
    expect(widget.locator("g.cluster[data-id='m:net.blocks.4']")).to_have_count(1)
    lab.screenshot(page, "graph_search_reveal")

    # export the current view: SVG and PNG made in the browser, DOT asked from the kernel
    for button, name, head in (("SVG", "graph.svg", b"<svg"), ("PNG", "graph.png", b"\x89PNG"),
                               ("DOT", "graph.dot", b"digraph")):
        with page.expect_download() as download:
            widget.locator("button", has_text=button).click()
        assert download.value.suggested_filename == name
        data = open(download.value.path(), "rb").read()
        assert data.startswith(head), (name, data[:40])
        if name == "graph.dot":
            assert b'subgraph "cluster_m:net.blocks.4"' in data  # the opened block is a cluster


def test_first_view_is_readable_with_the_output_in_view(lab) -> None:
    page = lab.run_notebook([NOTEBOOK_03_NET, "%graph net --input tokens", DEEP, "%graph loss"], name="graph_scale")
    for cell, shot in ((1, "graph_initial_modules"), (3, "graph_initial_deep")):
        widget = lab.output(page, cell).locator(".tnd-graph-widget")
        expect(widget).to_be_visible()
        port = widget.locator(".tnd-graph-port")
        output = widget.locator("g.node.output")
        expect(output).to_have_count(1)
        page.wait_for_function("(el) => el.style.transform.includes('scale(')",
                               arg=widget.locator(".tnd-graph-stage").element_handle())
        port.scroll_into_view_if_needed()
        lab.screenshot(widget, shot)
        px = widget.locator(".tnd-graph-stage").evaluate(_LABEL_PX)
        assert px >= 9.5, f"{shot}: labels drawn {px:.1f} px high"
        assert _inside(output, port), f"{shot}: the output node is cut off"
    # notebook 03 promises the four identical blocks as one closed box
    blocks = lab.output(page, 1).locator("g.group[data-id='m:net.blocks']")
    expect(blocks).to_contain_text("blocks.0..3 ×4 Block")


def _set_theme(page: Any, theme: str) -> None:
    page.evaluate("(t) => window.jupyterapp.commands.execute('apputils:change-theme', {theme: t})", theme)
    light = "false" if "Dark" in theme else "true"
    page.wait_for_function("(v) => document.body.dataset.jpThemeLight === v", arg=light)


def test_dark_theme_canvas_and_text(lab) -> None:
    page = lab.run_notebook([SETUP, GRAPH], name="graph_dark")
    try:
        _set_theme(page, "JupyterLab Dark")
        widget = lab.output(page, 1).locator(".tnd-graph-widget")
        port = widget.locator(".tnd-graph-port")
        page.wait_for_timeout(300)  # the theme's stylesheet applies on the next frame
        lab.screenshot(widget, "graph_dark")
        canvas = port.evaluate("el => getComputedStyle(el).backgroundColor")
        assert _luminance(canvas) < 0.3, f"canvas background {canvas} under JupyterLab Dark"
        label = widget.locator("g.node.op > text").first.evaluate("el => getComputedStyle(el).fill")
        assert _luminance(label) > 0.6, f"node label {label} under JupyterLab Dark"
        edge = widget.locator("path.edge").first.evaluate("el => getComputedStyle(el).stroke")
        assert _luminance(edge) > 0.35, f"edge colour {edge} on a dark canvas"
        fill = widget.locator("g.node.op > rect").first.evaluate("el => getComputedStyle(el).fill")
        assert _luminance(fill) < 0.45, f"op box fill {fill} under JupyterLab Dark"
    finally:
        _set_theme(page, "JupyterLab Light")


def test_keyboard_opens_a_module_and_buttons_are_labelled(lab) -> None:
    page = lab.run_notebook([SETUP, GRAPH], name="graph_keyboard")
    widget = lab.output(page, 1).locator(".tnd-graph-widget")
    for button in widget.locator(".tnd-graph-toolbar button").all():
        assert (button.get_attribute("aria-label") or "").strip(), button.inner_text()
    widget.locator("input.tnd-graph-search").focus()
    blocks = "g.group[data-id='m:net.blocks']"
    for _ in range(40):  # Tab through the toolbar into the graph, to the repeated blocks' box
        page.keyboard.press("Tab")
        focused = page.evaluate("() => document.activeElement && document.activeElement.dataset"
                                " && document.activeElement.dataset.id")
        if focused == "m:net.blocks":
            break
    else:
        raise AssertionError("Tab never reached the module box m:net.blocks")
    ring = widget.locator(blocks).evaluate(
        "el => { const r = el.querySelector('rect:last-of-type'); const s = getComputedStyle(r);"
        " return [s.strokeWidth, getComputedStyle(el).outlineStyle]; }")
    assert float(ring[0].rstrip("px")) >= 2.5 or ring[1] not in ("none", ""), f"no visible focus: {ring}"
    lab.screenshot(widget, "graph_keyboard_focus")
    page.keyboard.press("Enter")
    expect(widget.locator("g.cluster[data-id='m:net.blocks']")).to_have_count(1)
    expect(widget.locator("g.group[data-id='m:net.blocks.3']")).to_be_visible()
    # focus stays on the opened module (its frame), so a second Enter closes it again
    page.wait_for_function("() => document.activeElement && document.activeElement.dataset"
                           " && document.activeElement.dataset.id === 'm:net.blocks'")
    page.keyboard.press("Enter")
    expect(widget.locator(blocks)).to_be_visible()
    # Space on a node selects it: its details show
    for _ in range(40):
        page.keyboard.press("Tab")
        if page.evaluate("() => !!(document.activeElement && document.activeElement.matches"
                         "&& document.activeElement.matches('g.node'))"):
            break
    page.keyboard.press(" ")
    expect(widget.locator(".tnd-graph-details table")).to_be_visible()
    expect(widget.locator("g.node.selected")).to_have_count(1)


NAN_MODEL = """
import torch
from torch import nn
%load_ext torch_nbdebug

class Normalize(nn.Module):
    def forward(self, x):
        return x / x.norm(dim=-1, keepdim=True)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = Normalize()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.norm(x))

x = torch.randn(3, 4)
x[-1] = 0.0
model = Net()
"""


def test_nan_mark_stays_red_inside_an_opened_module_and_says_where_from(lab) -> None:
    page = lab.run_notebook([NAN_MODEL, "%%nanwatch\nloss = model(x).sum()", "%graph model --input x"],
                            name="graph_nan_mark")
    widget = lab.output(page, 2).locator(".tnd-graph-widget")
    expect(widget).to_contain_text("from %%nanwatch, In [2]")  # where the red mark comes from
    widget.locator("g.group.nan[data-id='m:model.norm']").click()
    expect(widget.locator("g.cluster[data-id='m:model.norm']")).to_have_count(1)
    marked = widget.locator("g.node.op.nan").first
    expect(marked).to_contain_text("div")
    fill = marked.locator("rect").first.evaluate("el => getComputedStyle(el).stroke")
    r, g, b = _rgb(fill)
    assert r > 150 and g < 90 and b < 90, f"the birth op is drawn {fill} once its module is open, not red"
    lab.screenshot(widget, "graph_nan_opened")
    marked.click()
    expect(widget.locator(".tnd-graph-details")).to_contain_text("first birth here (from %%nanwatch, In [2])")
    # a repaired model's graph is not red
    fixed = lab.run_cell(page, "class Normalize(nn.Module):\n    def forward(self, x):\n"
                               "        return nn.functional.normalize(x, dim=-1)\n\nmodel = Net()\n"
                               "%graph model --input x")
    expect(fixed.locator(".tnd-graph-widget g.node.output")).to_be_visible()
    expect(fixed.locator(".tnd-graph-widget g.nan")).to_have_count(0)


GPT_LOSS = """
import torch
from torch import nn
from torch_nbdebug.magics.graph import MAGICS
get_ipython().register_magics(MAGICS)

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)

    def forward(self, h):
        return h + self.proj(torch.relu(self.fc(self.ln(h))))

class Body(nn.Module):
    def __init__(self, d=8, n=6):
        super().__init__()
        self.wte = nn.Embedding(50, d)
        self.wpe = nn.Embedding(16, d)
        self.h = nn.ModuleList(Block(d) for _ in range(n))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)

class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer = Body()
        self.lm_head = nn.Linear(8, 50)

    def forward(self, idx):
        return self.lm_head(self.transformer(idx))

gpt = GPT()
idx = torch.randint(0, 50, (2, 5))
loss = nn.functional.cross_entropy(gpt(idx).flatten(0, 1), idx.flatten())
"""


def test_a_models_loss_opens_on_the_module_overview_all_in_view(lab) -> None:
    page = lab.run_notebook([GPT_LOSS, "%graph loss"], name="graph_overview")
    widget = lab.output(page, 1).locator(".tnd-graph-widget")
    expect(widget).to_be_visible()
    page.wait_for_function("(el) => el.style.transform.includes('scale(')",
                           arg=widget.locator(".tnd-graph-stage").element_handle())
    port = widget.locator(".tnd-graph-port")
    port.scroll_into_view_if_needed()
    lab.screenshot(widget, "graph_overview")
    expect(widget.locator("g.group[data-id='m:gpt.transformer.h']")).to_contain_text("autograd nodes")
    boxes = widget.locator("g[data-id]:not(.cluster)")
    assert boxes.count() >= 8
    cut = [b.get_attribute("data-id") for b in boxes.all() if not _inside(b, port)]
    assert not cut, f"boxes of the first view cut off: {cut}"  # the first node (input side) included
    px = widget.locator(".tnd-graph-stage").evaluate(_LABEL_PX)
    assert px >= 9.5, f"labels drawn {px:.1f} px high"


def test_a_narrow_panel_puts_the_details_under_the_graph(lab) -> None:
    page = lab.run_notebook([SETUP, GRAPH], name="graph_narrow", viewport=(580, 1000))
    widget = lab.output(page, 1).locator(".tnd-graph-widget")
    expect(widget).to_be_visible()
    widget.locator("g.node.param[data-id]").filter(has_text="weight").first.click()
    details = widget.locator(".tnd-graph-details")
    expect(details).to_contain_text("net.head.weight")
    port, area = widget.locator(".tnd-graph-port").bounding_box(), widget.bounding_box()
    assert port and area and port["width"] >= 0.9 * area["width"], (port, area)  # not squeezed beside the panel
    assert details.bounding_box()["y"] >= port["y"] + port["height"] - 1
    assert widget.evaluate("(w) => w.scrollWidth <= w.clientWidth + 1")
    lab.screenshot(widget, "graph_narrow")
