"""%graph in a real JupyterLab: open a collapsed module in place, select a node and read its details,
close the module again, and find a hidden parameter with the search box."""
from __future__ import annotations

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
