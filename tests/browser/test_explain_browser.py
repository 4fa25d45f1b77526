"""%%explain and the automatic explanation in a real JupyterLab: the live card (and the paragraph) come
*under* the traceback, name the module, the line, the culprit and the fix; the details toggle works by
click and by keyboard."""
from __future__ import annotations

import re

import pytest
from playwright.sync_api import expect

pytestmark = pytest.mark.browser

SETUP = """
import torch
from torch import nn
from torch_nbdebug.magics import explain as explain_magics
get_ipython().register_magics(explain_magics.MAGICS)
explain_magics.load(get_ipython())  # only %explain and its hook: this test does not depend on the other features

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.fc = nn.Linear(8 * 4 * 4, 10)
    def forward(self, x):
        h = self.features(x)
        return self.fc(h.flatten(1))

model = Net()
"""

EXPLAIN = """%%explain
x = torch.randn(2, 3, 32, 32)
out = model(x)
"""

PLAIN = "out = model(torch.randn(2, 3, 32, 32))"


GATE = """class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)
    def forward(self, x):
        return self.act(torch.sigmoid(self.proj(x)))

gate = Gate()
"""

INPLACE = """%%explain
out = gate(torch.randn(3, 4))
out.sum().backward()
"""

NO_GRAD = """%%explain
with torch.no_grad():
    loss = model(torch.randn(2, 3, 8, 8)).sum()
loss.backward()
"""


def test_widget_card_and_paragraph_come_under_the_traceback(lab) -> None:
    page = lab.run_notebook([SETUP, EXPLAIN], name="explain_view", allow_errors=True)

    out = lab.output(page, 1)
    children = out.locator(".jp-OutputArea-child")
    expect(children).to_have_count(2)
    expect(children.nth(0)).to_contain_text("mat1 and mat2 shapes cannot be multiplied (2x2048 and 128x10)")
    card = children.nth(1).locator(".tnd-explain-view .card")  # the live widget, not the static card
    expect(card).to_be_visible()
    expect(card.locator(".tnd-explain-title")).to_contain_text("Shape mismatch")
    where = card.locator(".tnd-explain-where")
    expect(where.locator(".xp-module")).to_have_text("model.fc")
    expect(where).to_contain_text(re.compile(r"model\.fc · line \d+: return self\.fc"))
    expect(where.locator(".xp-line")).to_have_text("return self.fc(h.flatten(1))")
    expect(card.locator(".tnd-explain-fix")).to_contain_text("in_features=2048")
    expect(card.locator(".tnd-explain-fix code").first).to_be_visible()  # `code` spans, as elements
    rows = card.locator("table.xp-operands tbody tr")
    expect(rows).to_have_count(4)
    expect(rows.nth(0).locator(".xp-name")).to_have_text("h")  # the forward's own name for it
    expect(rows.nth(0).locator("td").nth(1)).to_have_text("[2, 8, 16, 16]")
    expect(card).not_to_contain_text("[object")
    expect(card.locator("button.xp-copy")).to_have_attribute("aria-label", "Copy the diagnosis as text")
    traceback_box = children.nth(0).bounding_box()
    card_box = card.bounding_box()
    assert traceback_box is not None and card_box is not None and card_box["y"] > traceback_box["y"]
    assert card.evaluate("e => getComputedStyle(e).borderLeftStyle") == "solid"  # base.css reached the view

    # The details toggle: a button that says its state, by click and by keyboard (Enter).
    toggle = card.locator("button.xp-toggle")
    details = card.locator(".xp-details")
    expect(toggle).to_have_attribute("aria-expanded", "false")
    expect(details).to_be_hidden()
    toggle.click()
    expect(toggle).to_have_attribute("aria-expanded", "true")
    expect(details).to_be_visible()
    expect(details.locator(".xp-message")).to_contain_text("mat1 and mat2 shapes cannot be multiplied")
    expect(details).to_contain_text("RuntimeError — recorded by a %%explain run")
    toggle.press("Enter")
    expect(toggle).to_have_attribute("aria-expanded", "false")
    expect(details).to_be_hidden()
    expect(toggle).to_be_focused()  # the button is not redrawn: keyboard users keep their place
    assert toggle.evaluate("e => getComputedStyle(e).outlineStyle") == "solid"  # visible focus
    toggle.press("Enter")
    expect(details).to_be_visible()
    lab.screenshot(children.nth(1), "explain_widget")

    # Copy puts the diagnosis, as text, on the clipboard (for an issue or a chat) and says so.
    lab.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=lab.server.url)
    card.locator("button.xp-copy").click()
    expect(card.locator(".xp-status")).to_have_text("Copied")
    copied = page.evaluate("() => navigator.clipboard.readText()")
    assert copied.startswith("explain [shape] Shape mismatch: `model.fc` expects 128 input features")

    # Run all stops at the first failing cell: the plain failing cell is appended and run on its own.
    plain = lab.run_cell(page, PLAIN, allow_errors=True)
    auto = plain.locator(".jp-OutputArea-child")
    expect(auto).to_have_count(2)
    expect(auto.nth(0)).to_contain_text("RuntimeError")
    expect(auto.nth(1).locator(".tnd-explain-auto")).to_contain_text("shape mismatch at model.fc")
    lab.screenshot(auto.nth(1), "explain_auto_paragraph")

    # A recorded in-place error names its culprit (op, module and line: nested parts of one row).
    lab.run_cell(page, GATE)
    inplace = lab.run_cell(page, INPLACE, allow_errors=True).locator(".tnd-explain-view .card")
    culprit = inplace.locator(".tnd-explain-culprit")
    expect(culprit).to_contain_text(re.compile(r"^relu\(inplace=True\) in gate\.act · line \d+: "
                                               r"return self\.act\(torch\.sigmoid\(self\.proj\(x\)\)\)$"))
    expect(inplace).not_to_contain_text("[object")
    lab.screenshot(inplace, "explain_widget_culprit")

    # A gradient chain cut by no_grad: the warning against `requires_grad = True` stands on its own.
    cut = lab.run_cell(page, NO_GRAD, allow_errors=True).locator(".tnd-explain-view .card")
    expect(cut.locator(".tnd-explain-title")).to_contain_text("No gradient chain")
    expect(cut.locator(".tnd-explain-warning")).to_contain_text("requires_grad = True")
    expect(cut.locator(".tnd-explain-fix")).not_to_contain_text("requires_grad = True")
