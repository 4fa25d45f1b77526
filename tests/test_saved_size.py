"""What a saved notebook holds for one %%monitor output: the static view and the widget state, each
once and compact. Executed by nbclient in a real kernel, which saves widget state as JupyterLab does."""
from __future__ import annotations

import json

import nbformat
import pytest

from torch_nbdebug.render.bundle import WIDGET_MIME

SETUP = """
import torch
from torch import nn
%load_ext torch_nbdebug
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.003)
x, y = torch.randn(32, 4), torch.randn(32, 1)
"""
MONITOR = """%%monitor loss, opt.param_groups[0]["lr"]
for step in range(30):
    loss = nn.functional.mse_loss(net(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
LIMIT = 40_000  # bytes of JSON for one output with the widget state it needs


def saved_bytes(nb: nbformat.NotebookNode, cell: nbformat.NotebookNode) -> int:
    """The cell's outputs as saved, plus the widget models they show (and those models refer to)."""
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    size, todo, seen = len(json.dumps(cell.outputs)), [], set()
    for out in cell.outputs:
        view = out.get("data", {}).get(WIDGET_MIME)
        if view:
            todo.append(view["model_id"])
    while todo:
        model = todo.pop()
        if model in seen or model not in state:
            continue
        seen.add(model)
        size += len(json.dumps(state[model]))
        refs = [v for v in state[model]["state"].values() if isinstance(v, str) and v.startswith("IPY_MODEL_")]
        todo += [ref[len("IPY_MODEL_"):] for ref in refs]
    assert seen, "the output shows no saved widget"
    return size


@pytest.mark.timeout(300)
def test_a_saved_monitor_output_stays_under_40_kb() -> None:
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SETUP), nbformat.v4.new_code_cell(MONITOR)])
    NotebookClient(nb, timeout=240, kernel_name="python3", store_widget_state=True).execute()
    cell = nb.cells[1]
    html = "".join(out["data"]["text/html"] for out in cell.outputs if "text/html" in out.get("data", {}))
    assert html.count("data:image/png") == 1  # the static picture once
    size = saved_bytes(nb, cell)
    assert size < LIMIT, f"a 30-step %%monitor output is saved as {size:,} bytes"


@pytest.mark.parametrize("name", ["explain", "grads", "graph", "live", "memory", "monitor", "nanwatch"])
def test_compacted_widget_modules_are_still_valid_javascript(name: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import shutil
    import subprocess

    from torch_nbdebug.render.widget import compact_js, esm_path

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    source = esm_path(f"{name}.js").read_text(encoding="utf-8")
    module = tmp_path / f"{name}.mjs"
    module.write_text(compact_js(source), encoding="utf-8")
    check = subprocess.run([node, "--check", str(module)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    assert len(module.read_text(encoding="utf-8")) < 0.95 * len(source)
