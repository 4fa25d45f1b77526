"""%%profile in a real JupyterLab: the verdict and the bars render, dragging across the timeline zooms it
(and "whole step" resets it), a row of the lines table opens its line with the code around it."""
from __future__ import annotations

import pytest
from playwright.sync_api import expect

pytestmark = pytest.mark.browser

SETUP = """
import torch
from torch import nn
from torch_nbdebug.magics.profile import MAGICS
get_ipython().register_magics(MAGICS)  # only %profile: this test does not depend on the other features
torch.set_num_threads(1)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(16, 32), torch.randn(16, 8)
"""

CELL = """%%profile -o --steps 4
for step in range(5):
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    tally = sorted(str(k) for k in range(60000))
"""


def _range(svg) -> tuple[float, float]:
    return float(svg.get_attribute("data-lo")), float(svg.get_attribute("data-hi"))


def test_verdict_bars_timeline_zoom_and_a_line_that_opens(lab) -> None:
    page = lab.run_notebook([SETUP, CELL], name="profile_view")
    out = lab.output(page, 1)
    widget = out.locator(".tnd-profile-widget")
    expect(widget).to_be_visible()
    expect(widget.locator(".tnd-verdict")).to_contain_text("Verdict: host")
    expect(widget.locator("svg.plot rect").first).to_be_attached()  # the stacked bars
    timeline = widget.locator("svg.tnd-timeline")
    lo, hi = _range(timeline)
    assert lo == 0 and hi > 0
    lab.screenshot(out, "profile_full")

    box = timeline.bounding_box()
    yy = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] * 0.40, yy)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.70, yy, steps=5)
    page.mouse.up()
    expect(widget.locator("svg.tnd-timeline")).not_to_have_attribute("data-hi", f"{hi:.4f}")
    lo2, hi2 = _range(widget.locator("svg.tnd-timeline"))
    assert lo < lo2 < hi2 < hi

    widget.locator("button[data-action='reset']").click()
    expect(widget.locator("svg.tnd-timeline")).to_have_attribute("data-hi", f"{hi:.4f}")

    row = widget.locator("tr.tnd-row", has_text="tally = sorted(")
    row.click()
    source = widget.locator("pre.tnd-source")
    expect(source).to_contain_text("tally = sorted(str(k) for k in range(60000))")
    expect(source).to_contain_text("opt.step()")  # the lines around it
    lab.screenshot(out, "profile_line_open")
    widget.locator("tr.tnd-row", has_text="tally = sorted(").press("Enter")  # the keyboard closes it again
    expect(widget.locator("pre.tnd-source")).to_have_count(0)
