"""A kernel stays small: re-running the same cell 50 times (a real ipykernel shell, the cell id sent
as JupyterLab sends it) grows the kernel's memory by less than 10 MB, for %%monitor (a picture drawn
at each run) and %graph (a widget with the graph's payload at each run)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SETUP = """
import torch
from torch import nn
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.05)
x, y = torch.randn(32, 4), torch.randn(32, 1)
loss = nn.functional.mse_loss(net(x), y)
"""
CELLS = {
    "monitor": """%%monitor loss, opt.param_groups[0]["lr"]
for step in range(30):
    loss = nn.functional.mse_loss(net(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
""",
    "graph": "%graph loss",
}

# An in-process ipykernel (the ZMQInteractiveShell, its display publisher and comms), as in
# test_live_kernel; each run gets the same cell id, as a notebook's re-run of one cell does.
SCRIPT = textwrap.dedent("""
    import gc, json, sys
    import psutil
    from ipykernel.inprocess.manager import InProcessKernelManager
    from ipykernel.kernelbase import Kernel
    km = InProcessKernelManager()
    km.start_kernel()
    Kernel._instance = km.kernel
    shell = km.kernel.shell
    shell.run_line_magic("load_ext", "torch_nbdebug")
    shell.run_cell(sys.argv[1])
    def rss():
        gc.collect()
        return psutil.Process().memory_info().rss / 2**20
    for _ in range(5):  # first runs: imports, caches, the first of each widget
        shell.run_cell(sys.argv[2], cell_id="cell-7")
    before = rss()
    for _ in range(50):
        result = shell.run_cell(sys.argv[2], cell_id="cell-7")
        assert result.success, result.error_in_exec
    from ipywidgets import Widget
    print(json.dumps({"grew_mb": rss() - before, "widgets": len(Widget._active_widgets)}))
""")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("magic", sorted(CELLS))
def test_fifty_reruns_of_a_cell_keep_the_kernel_small(magic: str) -> None:
    run = subprocess.run([sys.executable, "-c", SCRIPT, SETUP, CELLS[magic]], capture_output=True, text=True,
                         timeout=580)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["grew_mb"] < 10, found
    assert found["widgets"] < 10, found  # the widgets of earlier runs were closed, not kept
