"""The gradient stepper in a real JupyterLab: next/keyboard move layer by layer, the histogram follows."""
from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

pytestmark = pytest.mark.browser

CELL = """
import torch
from torch import nn
from torch_nbdebug import record_gradients

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
opt = torch.optim.SGD(net.parameters(), lr=0.05)
x, y = torch.randn(32, 4), torch.randn(32, 2)
with record_gradients(net, layer=0) as rec:
    for _ in range(4):
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
view = rec.widget()
view
"""


def test_next_moves_to_the_next_layer_and_redraws_the_histogram(lab) -> None:
    page = lab.run_notebook([CELL], name="grads_stepper")
    out = lab.output(page, 0)
    root = out.locator(".tnd-grads")
    label = root.locator(".tnd-layer-name")
    expect(label).to_have_text("1/3 net.0")
    hist = root.locator("svg.tnd-hist").first
    expect(hist).to_have_attribute("data-param", "net.0.weight")
    before = hist.inner_html()
    expect(root.locator("svg.tnd-flow g.tnd-flow-layer")).to_have_count(3)
    expect(root.locator("canvas.tnd-heatmap")).to_be_visible()

    root.locator("button.tnd-next").click()
    expect(label).to_have_text("2/3 net.2")
    expect(hist).to_have_attribute("data-param", "net.2.weight")
    assert hist.inner_html() != before  # a different layer's gradient values, redrawn
    expect(lab.run_cell(page, "print('layer in python:', view.layer)")).to_contain_text("layer in python: 1")

    # Keyboard: → moves to the next layer, ↓ to the previous step; clicking the flow plot jumps.
    root.focus()
    page.keyboard.press("ArrowRight")
    expect(label).to_have_text("3/3 net.4")
    step = root.locator(".tnd-step-name")
    expect(step).to_have_text("step 3 (4/4)")
    page.keyboard.press("ArrowDown")
    expect(step).to_have_text("step 2 (3/4)")
    root.locator("svg.tnd-flow g.tnd-flow-layer").first.click()
    expect(label).to_have_text("1/3 net.0")

    root.locator("input.tnd-log").check()
    expect(lab.run_cell(page, "print('log in python:', view.log_scale)")).to_contain_text("log in python: True")
    lab.screenshot(page, "grads_stepper")


# A gradient that is the numbers -0.001 .. 1: zero falls a quarter pixel from the left end, where a
# "0" label would sit on top of the "-0.001" one.
SKEWED = """
import torch
from torch import nn
from torch_nbdebug import record_gradients

lin = nn.Linear(200, 1, bias=False)
target = torch.linspace(-0.001, 1.0, 200)
with record_gradients(lin) as rec:
    for _ in range(2):
        lin.zero_grad()
        (lin.weight[0] * target).sum().backward()
rec.widget()
"""

JS_LABEL_BOXES = """(svg) => Array.from(svg.querySelectorAll('text')).map((t) => {
  const b = t.getBBox(); return {text: t.textContent, left: b.x, right: b.x + b.width};
})"""


def test_histogram_axis_labels_do_not_collide(lab) -> None:
    page = lab.run_notebook([SKEWED], name="grads_hist_labels")
    hist = lab.output(page, 0).locator("svg.tnd-hist").first
    expect(hist).to_be_visible()
    boxes = sorted(hist.evaluate(JS_LABEL_BOXES), key=lambda b: b["left"])
    texts = [b["text"] for b in boxes]
    assert texts[0] == "-0.001" and texts[-1] == "1", texts
    width = float(hist.get_attribute("width"))
    for a, b in zip(boxes, boxes[1:]):
        assert a["right"] + 2 <= b["left"], f"labels overlap: {a} {b}"
    assert boxes[0]["left"] >= 0 and boxes[-1]["right"] <= width + 0.5, boxes
    # Zero is still marked, by the dashed line (its tooltip says 0).
    expect(hist.locator("line[stroke-dasharray] title")).to_have_text("0")
    lab.screenshot(hist, "grads_hist_labels")



def test_layers_and_steps_are_numbered_one_way(lab) -> None:
    """A layer, like a step, is named from 0 (layer #1 is ``view.layer == 1``; step 3 had 3 steps before
    it), then placed among the recorded ones (2/3): "layer #1 (2 of 3)" beside "2/3" read as two layers."""
    page = lab.run_notebook([CELL], name="grads_numbering")
    root = lab.output(page, 0).locator(".tnd-grads")
    root.locator("button.tnd-next").click()
    expect(root.locator(".tnd-layer-name")).to_have_text("2/3 net.2")
    expect(root.locator(".tnd-layer-name")).to_have_attribute("title", "layer #1 (2/3): counted from 0; layer 2 of 3")
    expect(root.locator(".tnd-detail")).to_contain_text("net.2 (Linear) — layer #1 (2/3)")
    assert root.locator("svg.tnd-flow g.tnd-flow-layer").nth(1).get_attribute("aria-label") == "layer #1 (2/3): net.2"
    expect(root.locator("svg.tnd-flow")).to_contain_text("layer # (from 0; click one)")
    step = root.locator(".tnd-step-name")
    expect(step).to_have_text("step 3 (4/4)")
    expect(step).to_have_attribute("title", "step 3 (4/4): 3 optimizer steps completed before it (counted from 0); "
                                            "recorded step 4 of 4")
    expect(root.locator("input.tnd-layer-slider")).to_have_attribute("aria-valuetext", "layer #1 (2/3): net.2")
    expect(root.locator("input.tnd-step-slider")).to_have_attribute("aria-valuetext", "step 3 (4/4)")


HUGE = """
import torch
from torch import nn
from torch_nbdebug import record_gradients

torch.manual_seed(0)
deep = nn.Sequential(*[nn.Linear(16, 16) for _ in range(12)], nn.Linear(16, 2))
opt = torch.optim.SGD(deep.parameters(), lr=1e-22)
with record_gradients(deep) as rec:
    for _ in range(3):
        opt.zero_grad()
        (deep(torch.randn(8, 16)).sum() * 1e20).backward()
        opt.step()
rec.widget()
"""


@pytest.mark.parametrize("width", [900, 580])
def test_numbers_are_written_one_way_and_the_view_fits(lab, width: int) -> None:
    """Gradients of 1e20 were written 100000000000000000000 (the statistics write 1e+20) and the stats
    table ran past a ~500 px side panel; the flow chart scrolled there."""
    page = lab.run_notebook([HUGE], name=f"grads_numbers_{width}", viewport=(width, 1000))
    root = lab.output(page, 0).locator(".tnd-grads")
    stats = root.locator(".tnd-detail .tnd-stats").first
    expect(stats).to_be_visible()
    text = stats.inner_text()
    assert "e+" in text and "e-" in text, text  # gradients ~1e20, update ratios ~1e-4: exponents
    assert not re.search(r"\d{7}", text), f"a long run of digits in the layer's statistics: {text}"
    root.scroll_into_view_if_needed()
    area = root.evaluate("(r) => r.closest('.jp-OutputArea-output').clientWidth")
    for part in (root, root.locator(".tnd-detail"), root.locator(".tnd-flow-box")):
        sizes = part.evaluate("(e) => [e.scrollWidth, e.clientWidth]")
        assert sizes[0] <= sizes[1] + 1, f"{part} scrolls sideways at {width} px: {sizes}"
    for box in (stats.bounding_box(), root.locator("svg.tnd-flow").bounding_box()):
        assert box is not None and box["width"] <= area + 1, (box, area)
    lab.screenshot(root, f"grads_numbers_{width}")


WIDE = """
import torch
from torch import nn
from torch_nbdebug import grads

wide = nn.Linear(4, 4, bias=False).double()
wide.weight.grad = torch.full((4, 4), 1e38, dtype=torch.float64)
grads(wide).widget()
"""


def test_a_norm_beyond_float32_is_shown_as_it_is(lab) -> None:
    """A float64 gradient's norm of 4e38 (past float32's 3.4e38) was sent as float32 bytes: the widget
    showed inf where the text and HTML views said 4e+38."""
    page = lab.run_notebook([WIDE], name="grads_wide")
    root = lab.output(page, 0).locator(".tnd-grads")
    stats = root.locator(".tnd-detail .tnd-stats").first
    expect(stats).to_contain_text("4e+38")
    values = stats.inner_text().split("\n")[1::2]  # label, value, label, value...
    assert values[:2] == ["4e+38", "1e+38"] and not [v for v in values if "inf" in v.lower() or "∞" in v], values
    expect(root).to_contain_text("exploding")
    expect(root).not_to_contain_text("non-finite")
