"""%%monitor in a real JupyterLab: the view updates while the cell is still running, Stop keeps the
data (the final view replaces the live one), and the final view's controls sync back to Python."""
from __future__ import annotations

import re
import time

import pytest
from conftest import _JS_APPEND_AND_RUN, _JS_CELL_STATE  # tests/browser is on sys.path
from playwright.sync_api import expect

pytestmark = pytest.mark.browser

SETUP = """
import time
import torch
from torch import nn
%load_ext torch_nbdebug
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.05)
x, y = torch.randn(32, 4), torch.randn(32, 1)
"""

# About a minute if nobody stops it; the test stops it after watching a few updates.
SLOW_LOOP = """%%monitor loss, opt.param_groups[0]["lr"]
for step in range(1200):
    loss = nn.functional.mse_loss(net(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(0.05)
"""

SHORT_LOOP = """%%monitor loss
for step in range(60):
    loss = nn.functional.mse_loss(net(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def _steps(text: str) -> int:
    return int(text.split()[0].replace(",", ""))


def _wait_for_more_steps(page, steps, than: int, timeout_s: float = 120.0) -> None:
    """Poll the live header (re-rendered at each update, so re-read through the locator)."""
    deadline = time.monotonic() + timeout_s
    while _steps(steps.inner_text()) <= than:
        assert time.monotonic() < deadline, f"the live view stayed at {than} steps for {timeout_s:.0f}s"
        page.wait_for_timeout(250)


def test_live_view_updates_while_running_and_stop_keeps_the_data(lab) -> None:
    page = lab.run_notebook([SETUP], name="monitor_live")
    index = int(page.evaluate(_JS_APPEND_AND_RUN, ["monitor_live.ipynb", SLOW_LOOP]))
    out = lab.output(page, index)
    steps = out.locator(".tnd-live .live-steps")
    expect(steps).to_have_text(re.compile(r"^[1-9][\d,]* steps?$"))  # shown and updated while running
    first = _steps(steps.inner_text())
    expect(out.locator(".tnd-live .live-panel h3").first).to_have_text("loss")
    _wait_for_more_steps(page, steps, first)  # a later update, still in the same running cell
    state = page.evaluate(_JS_CELL_STATE, ["monitor_live.ipynb", index])
    assert not state["done"], "the cell should still be running while its view updates"
    lab.screenshot(out, "monitor_live_running")

    page.evaluate("() => window.jupyterapp.commands.execute('notebook:interrupt-kernel')")  # Stop
    page.wait_for_function(f"""() => {{ const s = ({_JS_CELL_STATE})(["monitor_live.ipynb", {index}]);
                                return s.done; }}""", timeout=120_000)
    final = out.locator(".tnd-monitor")
    expect(final.locator(".tnd-title")).to_contain_text("stopped at step")
    expect(out.locator(".tnd-live")).to_have_count(0)  # the final view replaced the live one
    expect(out).to_contain_text("KeyboardInterrupt")  # Stop still stops the cell
    title = final.locator(".tnd-title").inner_text()
    recorded = int(re.search(r"(\d+) steps recorded", title).group(1))  # type: ignore[union-attr]
    assert recorded >= first
    check = lab.run_cell(page, "h = _monitor.history\nprint('kept', len(h), h.status, bool((h.grad_norm > 0).all()))")
    expect(check).to_contain_text(f"kept {recorded} stopped True")
    lab.screenshot(out, "monitor_live_stopped")


def test_final_view_smoothing_log_scale_zoom_and_layer_panel(lab) -> None:
    page = lab.run_notebook([SETUP, SHORT_LOOP, "view = _monitor.widget()\nview"], name="monitor_final")
    view = lab.output(page, 2).locator(".tnd-monitor")
    expect(view.locator(".tnd-title")).to_contain_text("60 steps recorded")
    expect(view.locator("svg.tnd-chart")).to_have_count(2)  # loss, and the per-layer chart
    expect(view).not_to_contain_text("null")  # an absent part leaves nothing behind
    smooth_before = view.locator("path.tnd-smooth").first.get_attribute("d")

    slider = view.locator("input.tnd-smoothing")
    slider.fill("0.95")
    slider.dispatch_event("change")
    expect(view.locator("path.tnd-smooth").first).not_to_have_attribute("d", smooth_before or "")
    view.locator("input.tnd-log").check()
    view.locator("select.tnd-panel").select_option("ratio")
    expect(view.locator(".tnd-layers h3")).to_contain_text("per layer")

    chart = view.locator("svg.tnd-chart").first
    box = chart.bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] * 0.3, box["y"] + box["height"] / 2)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.6, box["y"] + box["height"] / 2, steps=5)
    page.mouse.up()
    expect(view.locator("button.tnd-reset-zoom")).to_be_enabled()
    synced = lab.run_cell(page, "print('state', view.smoothing, view.log_scale, view.panel, len(view.zoom))")
    expect(synced).to_contain_text("state 0.95 True ratio 2")
    view.locator("button.tnd-reset-zoom").click()
    expect(view.locator("button.tnd-reset-zoom")).to_be_disabled()
    lab.screenshot(view, "monitor_final")


FIXED_LR = """%%monitor loss, opt.param_groups[0]["lr"]
for step in range(30):
    loss = nn.functional.mse_loss(net(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

DIVERGING = """%%monitor loss
deep = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(4, 4), nn.Tanh())], nn.Linear(4, 1))
deep_opt = torch.optim.SGD(deep.parameters(), lr=0.003)
for step in range(8):
    scale = 1e6 if step == 3 else (float("nan") if step >= 4 else 1.0)  # explodes, then NaN
    loss = nn.functional.mse_loss(deep(x) * scale, y)
    deep_opt.zero_grad()
    loss.backward()
    deep_opt.step()
"""


def _path_ys(d: str) -> list[float]:
    return [float(y) for y in re.findall(r"[ML][\d.]+,([\d.]+)", d)]


def test_a_fixed_learning_rate_is_flat_its_ticks_distinct_and_hover_shows_values(lab) -> None:
    page = lab.run_notebook([SETUP, FIXED_LR], name="monitor_flat")
    view = lab.output(page, 1).locator(".tnd-monitor")
    lr_chart = view.locator(".tnd-series").nth(1).locator("svg.tnd-chart")
    expect(view.locator(".tnd-series").nth(1).locator("h3")).to_have_text('opt.param_groups[0]["lr"]')
    for cls in ("path.tnd-smooth", "path.tnd-raw"):
        ys = _path_ys(lr_chart.locator(cls).get_attribute("d") or "")
        assert len(ys) == 30 and max(ys) - min(ys) < 0.5, (cls, ys)  # one flat line, not a zig-zag
    ticks = lr_chart.locator("text.tnd-ytick").all_text_contents()
    assert len(ticks) == 3 and len(set(ticks)) == 3 and "0.05" in ticks, ticks  # SETUP trains at lr 0.05
    loss_ticks = view.locator(".tnd-series").first.locator("text.tnd-ytick").all_text_contents()
    assert len(set(loss_ticks)) == len(loss_ticks), loss_ticks

    box = lr_chart.bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] / 2)
    tip = lr_chart.locator("text.tnd-hover")
    expect(tip).to_be_visible()
    expect(tip).to_contain_text(re.compile(r"step \d+"))
    expect(tip).to_contain_text("value 0.05")
    lab.screenshot(view, "monitor_flat_hover")
    page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] + 200)
    expect(tip).to_be_hidden()


def test_a_divergence_lists_one_row_per_step_and_kind_the_nan_loss_first(lab) -> None:
    page = lab.run_notebook([SETUP, DIVERGING], name="monitor_alerts")
    view = lab.output(page, 1).locator(".tnd-monitor")
    rows = view.locator("ul.tnd-alerts > li")
    expect(rows).to_have_count(3)  # loss nan; 5 layers exploding; 5 layers non-finite
    expect(rows.first).to_contain_text(re.compile(r"non-finite step \d+: loss is nan"))
    folded = view.locator("ul.tnd-alerts details")
    expect(folded).to_have_count(2)
    exploding = folded.filter(has_text="exploding")
    expect(exploding.locator("summary")).to_contain_text("(and 4 more layers)")
    expect(exploding.locator("ul > li").first).to_be_hidden()  # folded until asked for
    exploding.locator("summary").click()  # on its text (the zoom button is at its start)
    expect(exploding.locator("ul > li")).to_have_count(5)
    expect(exploding.locator("ul > li").first).to_be_visible()
    lab.screenshot(view, "monitor_alerts_grouped")
