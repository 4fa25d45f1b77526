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


HUGE = """
import torch
from torch import nn
from torch_nbdebug.magics.nanwatch import MAGICS
get_ipython().register_magics(MAGICS)

class Amplifier(nn.Module):
    def __init__(self, gain):
        super().__init__()
        self.gain = gain
    def forward(self, x):
        return x * self.gain

class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_projection_block = nn.Sequential(nn.Linear(4, 4), Amplifier(8.125e19))
        self.feed_forward_output_block = nn.Sequential(Amplifier(-63.2), nn.Tanh())
    def forward(self, x):
        return self.feed_forward_output_block(self.attention_projection_block(x))

torch.manual_seed(0)
encoder = Encoder()
xb = torch.ones(8, 4)
"""

HUGE_WATCH = """%%nanwatch
out = encoder(xb)
loss = (out * 1e30).exp().sum()
loss.backward()
"""


@pytest.mark.parametrize("width", [900, 580])
def test_layer_table_writes_numbers_one_way_and_fits(lab, width: int) -> None:
    """81250000000000000000 beside -5.136e+21 pushed the gradient columns out of a 900-px view."""
    page = lab.run_notebook([HUGE, HUGE_WATCH], name=f"nanwatch_numbers_{width}", viewport=(width, 1000))
    view = lab.output(page, 1).locator(".tnd-nanwatch")
    table = view.locator("table.nw-layers")
    expect(table).to_be_visible()
    text = table.inner_text()
    assert "e+19" in text and "e+21" in text, text  # an exponent from 1e5 up, as the statistics write it
    assert not [t for t in text.split() if t.lstrip("-").replace(".", "").isdigit() and len(t) > 8], text
    scroller = table.locator("xpath=..")
    scroller.scroll_into_view_if_needed()
    fits = scroller.evaluate("e => [e.scrollWidth, e.clientWidth]")
    lab.screenshot(view, f"nanwatch_numbers_{width}")
    assert fits[0] <= fits[1] + 1, f"the layer table scrolls sideways at {width} px: {fits}"
    last = table.locator("tr").last.locator("td").last
    box, area = last.bounding_box(), scroller.bounding_box()
    assert box and area and box["x"] + box["width"] <= area["x"] + area["width"] + 1  # the gradient's mean shows
