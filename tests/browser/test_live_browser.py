"""Live views in a real JupyterLab: the view changes while a training cell is still running, and
Stop (interrupt the kernel) leaves the report of what was recorded in its place."""
from __future__ import annotations

import pytest
from playwright.sync_api import expect

pytestmark = pytest.mark.browser

SETUP = """
%load_ext torch_nbdebug
import time, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(16, 4)
"""
SLOW = """%%grads model
for i in range(100_000):  # far longer than the test: it ends by Stop
    opt.zero_grad(); model(x).pow(2).mean().backward(); opt.step()
    time.sleep(0.02)
"""
_RUN_NEW_CELL = """(source) => {
  const w = window.jupyterapp.shell.currentWidget;
  const index = w.content.model.cells.length;
  w.content.model.sharedModel.insertCell(index, {cell_type: 'code', source});
  w.content.activeCellIndex = index;
  void window.jupyterapp.commands.execute('notebook:run-cell');
  return index;
}"""
_INTERRUPT = "() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.interrupt()"


def test_the_live_view_moves_while_running_and_stop_keeps_the_recorded_steps(lab) -> None:
    page = lab.run_notebook([SETUP], name="live_view")
    index = page.evaluate(_RUN_NEW_CELL, SLOW)
    out = lab.output(page, index)
    prompt = lab.cell(page, index).locator(".jp-InputArea-prompt")
    view = out.locator(".tnd-live")
    steps = view.locator(".live-steps")
    expect(steps).to_be_visible()
    expect(view.locator(".live-state")).to_have_text("● running")
    expect(steps).not_to_have_text("0 steps")  # updates arrive while the kernel is busy
    first = steps.inner_text()
    expect(steps).not_to_have_text(first)      # ...and keep arriving
    expect(view.locator("svg.live-plot path").first).to_be_visible()  # the gradient-norm curves
    expect(prompt).to_contain_text("*")        # all of this while the cell is still running
    lab.screenshot(out, "live_view_running")
    seen = int(steps.inner_text().split()[0].replace(",", ""))

    page.evaluate(_INTERRUPT)
    expect(prompt).not_to_contain_text("*")
    expect(view).to_have_count(0)  # the live view is replaced...
    expect(out).to_contain_text("gradients of model")  # ...by the report of the steps recorded
    expect(out).to_contain_text("KeyboardInterrupt")
    stepper = out.locator(".tnd-grads .tnd-step-name")
    expect(stepper).to_be_visible()
    recorded = int(stepper.inner_text().split("/")[-1].rstrip(")"))
    assert recorded >= seen, f"the report shows {recorded} steps, the live view had shown {seen}"
    lab.screenshot(out, "live_view_stopped")
