"""%%cudamem in a real JupyterLab: the timeline renders, zooming changes the visible range, hover shows details."""
from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

pytestmark = pytest.mark.browser

SETUP = """
import torch
from torch import nn
from torch_nbdebug.magics.memory import MAGICS
get_ipython().register_magics(MAGICS)  # only %cudamem: this test does not depend on the other features
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
"""

CELL = """%%cudamem -o --device cpu
losses = []
for step in range(6):
    out = model(torch.randn(16, 32))
    loss = out.pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss)
"""


def _range(widget) -> tuple[int, int]:
    return int(widget.get_attribute("data-lo")), int(widget.get_attribute("data-hi"))


def test_timeline_renders_and_zooms(lab) -> None:
    page = lab.run_notebook([SETUP, CELL], name="memory_timeline")
    out = lab.output(page, 1)
    widget = out.locator(".tnd-memory-widget")
    expect(widget).to_be_visible()
    expect(widget.locator("svg.chart polygon[data-category='parameters']")).to_have_count(1)
    expect(widget.locator("svg.chart polygon[data-category='gradients']")).to_have_count(1)
    expect(widget.locator("svg.chart rect[fill='#fde7d3']").first).to_be_attached()  # a backward phase
    expect(widget).to_contain_text("peak")
    expect(widget).to_contain_text("losses")  # the leak card names the holder
    lo, hi = _range(widget)
    assert lo == 0 and hi > 50
    lab.screenshot(out, "memory_timeline_full")

    widget.locator("button[data-action='in']").click()  # zoom in: half the range, kernel re-decimates
    expect(widget).not_to_have_attribute("data-hi", str(hi))
    lo2, hi2 = _range(widget)
    assert lo2 > lo and hi2 < hi and (hi2 - lo2) <= (hi - lo) // 2 + 1
    expect(widget.locator(".range")).to_contain_text(f"events {lo2}–{hi2}")
    first_tick = widget.locator("svg.chart text.xtick").first
    expect(first_tick).to_have_text(str(lo2))

    # Drag across the middle of the plot: the range becomes the dragged span.
    box = widget.locator("svg.chart").bounding_box()
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] * 0.40, y)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.60, y, steps=5)
    page.mouse.up()
    expect(widget).not_to_have_attribute("data-hi", str(hi2))
    lo3, hi3 = _range(widget)
    assert lo2 < lo3 < hi3 < hi2

    widget.locator("svg.chart").hover(position={"x": box["width"] * 0.5, "y": box["height"] / 2})
    expect(widget.locator(".tip")).to_contain_text(re.compile(r"event \d+ · t="))
    widget.locator("tr.alloc").first.hover()
    expect(widget.locator(".detail")).to_contain_text("phase")
    lab.screenshot(out, "memory_timeline_zoomed")

    widget.locator("button[data-action='reset']").click()
    expect(widget).to_have_attribute("data-hi", str(hi))
    # -o made the timeline the cell's output: the kernel holds it as ``_``, with the leak found.
    expect(lab.run_cell(page, "print(type(_).__name__, _.leaks[0].holder, len(losses))")).to_contain_text(
        "MemoryTimeline losses 6")


LEAKY = """%%cudamem --device cpu
kept = []
big = [torch.randn(256, 256) for _ in range(4)]  # larger than the leak, and freed
for step in range(6):
    loss = model(torch.randn(16, 32)).pow(2).mean()
    kept.append(loss)
del big
"""


def test_narrow_panel_keeps_chart_text_readable_and_leak_rows_first(lab) -> None:
    """In a ~500 px panel the 760-px chart was shrunk (10-px labels drawn at ~6 px); the leak came last."""
    page = lab.run_notebook([SETUP, LEAKY], name="memory_narrow", viewport=(580, 1000))
    widget = lab.output(page, 1).locator(".tnd-memory-widget")
    expect(widget).to_be_visible()
    chart = widget.locator("svg.chart")
    chart.scroll_into_view_if_needed()
    sizes = chart.evaluate("""(svg) => [...svg.querySelectorAll('text')].map((t) =>
        parseFloat(getComputedStyle(t).fontSize) * svg.getBoundingClientRect().width / svg.viewBox.baseVal.width)""")
    assert sizes and min(sizes) >= 9.5, f"chart text drawn {min(sizes):.1f} px high in a narrow panel"
    area = widget.evaluate("(w) => w.closest('.jp-OutputArea-output').clientWidth")
    box = chart.bounding_box()
    assert box is not None and box["width"] <= area + 1, (box, area)
    lab.screenshot(widget, "memory_narrow")
    # the leak first: its card above the table, its allocations the table's first rows, marked
    card = widget.locator(".card").filter(has_text="Leak:").first
    table = widget.locator("table.allocs")
    assert card.bounding_box()["y"] < table.bounding_box()["y"]
    expect(table.locator("tr.alloc").first).to_have_class(re.compile(r"\bleak\b"))
    expect(table.locator("tr.alloc").first).to_contain_text("kept")
