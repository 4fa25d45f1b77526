"""%%nanwatch in a real JupyterLab: the birth card names the op and module, the cell line is
highlighted, the birth row is marked, and clicking another event shows it in the card."""
from __future__ import annotations

import pytest
from playwright.sync_api import expect

pytestmark = pytest.mark.browser

SETUP = """
import torch
from torch import nn
from torch_nbdebug.magics.nanwatch import MAGICS
get_ipython().register_magics(MAGICS)  # only %%nanwatch: this test does not depend on the other features

class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
    def forward(self, x):
        h = self.proj(x)
        return torch.sqrt(h)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), Attention(), nn.Linear(4, 1))
xb = torch.randn(8, 4)
"""

WATCH = """%%nanwatch
out = model(xb)
loss = out.sum()
scale = torch.exp(torch.full((2,), 200.0))
"""


def test_card_shows_op_module_and_highlighted_line(lab) -> None:
    page = lab.run_notebook([SETUP, WATCH], name="nanwatch_view")
    out = lab.output(page, 1)
    view = out.locator(".tnd-nanwatch")
    expect(view).to_be_visible()
    card = view.locator(".nw-card")
    expect(card.locator(".nw-title")).to_contain_text("NaN born in forward: aten.sqrt.default in model.1")
    expect(card.locator(".nw-op")).to_have_text("aten.sqrt.default")
    expect(card.locator(".nw-module")).to_have_text("model.1")
    expect(card.locator(".nw-hint")).to_contain_text("sqrt of a negative number")
    highlighted = view.locator(".nw-source .line.hl")
    expect(highlighted).to_have_count(1)
    expect(highlighted).to_contain_text("return torch.sqrt(h)")
    expect(view.locator("table.nw-layers tr.mark")).to_contain_text("model.1")
    lab.screenshot(page, "nanwatch_card")

    # The exp overflow in the watched cell is the second birth: clicking it moves the card and the highlight.
    second = view.locator("tr.nw-event").nth(1)
    expect(second).to_contain_text("aten.exp.default")
    second.click()
    expect(card.locator(".nw-title")).to_contain_text("Inf born in forward: aten.exp.default")
    expect(view.locator(".nw-source .line.hl")).to_contain_text("scale = torch.exp(torch.full((2,), 200.0))")
    lab.screenshot(view, "nanwatch_second_event")


BACKWARD_SETUP = SETUP.replace("return torch.sqrt(h)", "return torch.sqrt(torch.relu(h))")
BACKWARD = """%%nanwatch
out = model(xb)
loss = out.sum()
loss.backward()
"""


def test_backward_birth_card_names_the_forward_op_module_and_line(lab) -> None:
    # sqrt(relu(h)) is finite, but its gradient at the zeros relu makes is 1/(2*sqrt(0)) = inf: the birth
    # is in backward, and the card's Forward row says which forward op made it, in which module, where.
    sqrt_line = BACKWARD_SETUP.lstrip("\n").splitlines().index("        return torch.sqrt(torch.relu(h))") + 1
    page = lab.run_notebook([BACKWARD_SETUP, BACKWARD], name="nanwatch_backward")
    view = lab.output(page, 1).locator(".tnd-nanwatch")
    card = view.locator(".nw-card")
    expect(card.locator(".nw-title")).to_contain_text("Inf born in backward: SqrtBackward0 in model.1")
    forward = card.locator("tr").filter(has=page.locator("th", has_text="Forward")).locator("td")
    expect(forward).to_have_text(f"created by aten.sqrt.default in model.1 at line {sqrt_line}")
    expect(view).not_to_contain_text("[object")
    expect(view.locator(".nw-source .line.hl")).to_contain_text("return torch.sqrt(torch.relu(h))")
    lab.screenshot(view, "nanwatch_backward_card")
