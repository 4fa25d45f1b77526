"""A real person's view of the tour: notebooks/00_tour.ipynb opened in JupyterLab, every cell run
from the Run menu, then each widget checked for what a person sees and for responding to a click:
the nanwatch card names the birth, a graph module expands, the stepper moves, the timeline zooms.
Screenshots of each view land in test-artifacts/ (tour_*.png)."""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from playwright.sync_api import expect

pytestmark = pytest.mark.browser

TOUR = Path(__file__).resolve().parents[2] / "notebooks" / "00_tour.ipynb"


def _cell_index(first_line: str) -> int:
    """Index (markdown cells count, as in the page) of the code cell whose first line is this."""
    nb = nbformat.read(TOUR, as_version=4)
    found = [i for i, cell in enumerate(nb.cells)
             if cell.cell_type == "code" and cell.source.splitlines()[0].strip() == first_line]
    assert len(found) == 1, f"00_tour.ipynb should have exactly one cell starting {first_line!r}: {found}"
    return found[0]


def _range(widget) -> tuple[int, int]:
    return int(widget.get_attribute("data-lo")), int(widget.get_attribute("data-hi"))


def test_tour_runs_and_every_widget_responds(lab) -> None:
    page = lab.open_notebook(TOUR)
    lab.screenshot(page, "tour_page")

    # %%nanwatch: the card names the op and the module, and highlights the user's line.
    nanwatch = lab.output(page, _cell_index("%%nanwatch")).locator(".tnd-nanwatch")
    expect(nanwatch).to_be_visible()
    card = nanwatch.locator(".nw-card")
    expect(card.locator(".nw-title")).to_contain_text("NaN born in forward")
    expect(card.locator(".nw-op")).to_have_text("aten.div.Tensor")
    expect(card.locator(".nw-module")).to_have_text("model.norm")
    expect(nanwatch.locator(".nw-source .line.hl")).to_contain_text("x / x.norm(dim=-1, keepdim=True)")
    lab.screenshot(nanwatch, "tour_nanwatch")

    # %graph: opens at module level with the birth's module marked; clicking a closed module opens
    # it in place and shows the marked node inside; clicking a parameter shows its details.
    graph = lab.output(page, _cell_index("%graph model --input x")).locator(".tnd-graph-widget")
    expect(graph).to_be_visible()
    norm = graph.locator("g.group.nan[data-id='m:model.norm']")  # closed, drawn in red
    expect(norm).to_be_visible()
    norm.click()
    expect(graph.locator("g.cluster[data-id='m:model.norm']")).to_have_count(1)
    expect(graph.locator("g.node.op.nan").first).to_contain_text("div")
    layer = graph.locator("g.group[data-id='m:model.encoder.0']")
    expect(layer).to_be_visible()
    layer.click()
    expect(graph.locator("g.cluster[data-id='m:model.encoder.0']")).to_have_count(1)
    weight = graph.locator("g.node.param[data-id]").filter(has_text="weight").first
    expect(weight).to_be_visible()
    lab.screenshot(graph, "tour_graph_expanded")
    weight.click()
    details = graph.locator(".tnd-graph-details")
    expect(details).to_contain_text("model.encoder.0.weight")
    expect(details).to_contain_text("AccumulateGrad")

    # %%grads: the stepper moves to the next layer, the histogram follows; a step slider exists.
    grads = lab.output(page, _cell_index("%%grads model")).locator(".tnd-grads")
    expect(grads).to_be_visible()
    label = grads.locator(".tnd-layer-name")
    expect(label).to_contain_text("/3 model.")
    expect(grads.locator("svg.tnd-flow g.tnd-flow-layer")).to_have_count(3)
    expect(grads.locator("canvas.tnd-heatmap")).to_be_visible()
    grads.locator("svg.tnd-flow g.tnd-flow-layer").first.click()  # jump to the first layer
    expect(label).to_have_text("1/3 model.encoder.0")
    hist = grads.locator("svg.tnd-hist").first
    expect(hist).to_have_attribute("data-param", "model.encoder.0.weight")
    grads.locator("button.tnd-next").click()
    expect(label).to_have_text("2/3 model.encoder.2")
    expect(hist).to_have_attribute("data-param", "model.encoder.2.weight")
    expect(grads.locator(".tnd-step-name")).to_contain_text("(8/8)")
    grads.locator("button.tnd-prev-step").click()
    expect(grads.locator(".tnd-step-name")).to_contain_text("(7/8)")
    lab.screenshot(grads, "tour_grads_stepper")

    # %%cudamem: the timeline shows the categories and the leak; zooming in narrows the range.
    memory = lab.output(page, _cell_index("%%cudamem")).locator(".tnd-memory-widget")
    expect(memory).to_be_visible()
    expect(memory.locator("svg.chart polygon[data-category='parameters']")).to_have_count(1)
    expect(memory).to_contain_text("val_losses")  # the leak card names the holder
    lo, hi = _range(memory)
    lab.screenshot(memory, "tour_memory_full")
    memory.locator("button[data-action='in']").click()
    expect(memory).not_to_have_attribute("data-hi", str(hi))
    lo2, hi2 = _range(memory)
    assert lo <= lo2 < hi2 < hi, (lo, hi, lo2, hi2)
    lab.screenshot(memory, "tour_memory_zoomed")

    # %%explain: the card names the kind and the module as the user wrote it; %%repro names the op and
    # the cause; %%monitor draws the loss.
    explain = lab.output(page, _cell_index("%%explain")).locator(".tnd-explain-view")
    expect(explain).to_be_visible()
    expect(explain.locator(".tnd-explain-title")).to_contain_text("head")
    lab.screenshot(explain, "tour_explain")
    repro = lab.output(page, _cell_index("%%repro --no-restore-rng"))
    expect(repro.locator(".tnd-repro").first).to_contain_text("rng")
    expect(repro.locator(".tnd-repro").first).to_contain_text("bernoulli")
    monitor = lab.output(page, _cell_index('%%monitor loss, optimizer.param_groups[0]["lr"]')).locator(".tnd-monitor")
    expect(monitor.first).to_be_visible()
    expect(monitor.first).to_contain_text("loss")
    lab.screenshot(monitor.first, "tour_monitor")

    # The notebook's own assertions ran in this kernel too; one more look from the kernel's side.
    expect(lab.run_cell(page, "print(_nanwatch.first.module, len(val_losses))")).to_contain_text("model.norm 4")
