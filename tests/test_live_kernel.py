"""Live views under real kernels: ipykernel's own shell gets one (comm updates while the cell runs, the
report in its place at the end); a notebook executed by nbclient gets none and saves what it saved before."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import nbformat
import pytest

SETUP = """
import time, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(16, 4)
"""
CELL = """%%grads model
for i in range(30):
    opt.zero_grad(); model(x).pow(2).mean().backward(); opt.step()
    time.sleep(0.03)
"""

# An in-process ipykernel: the same ZMQInteractiveShell, display publisher and comms as a notebook's
# kernel, with the IOPub messages read back in order by its client.
KERNEL_SCRIPT = textwrap.dedent("""
    import json, sys
    from ipykernel.inprocess.manager import InProcessKernelManager
    from ipykernel.kernelbase import Kernel
    km = InProcessKernelManager()
    km.start_kernel()
    Kernel._instance = km.kernel  # what IPKernelApp does: comms find their kernel through it
    kc = km.client()
    kc.start_channels()
    shell = km.kernel.shell
    shell.run_line_magic("load_ext", "torch_nbdebug")
    shell.run_cell(sys.argv[1])
    kc.execute(sys.argv[2])
    out = []
    while True:
        try:
            msg = kc.get_iopub_msg(timeout=1)
        except Exception:
            break
        c = msg["content"]
        out.append({"type": msg["msg_type"], "data": c.get("data"), "transient": c.get("transient"),
                    "text": c.get("text"), "ename": c.get("ename")})
    print(json.dumps(out))
""")


def _iopub(setup: str, cell: str) -> list[dict[str, Any]]:
    run = subprocess.run([sys.executable, "-c", KERNEL_SCRIPT, setup, cell], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_ipykernel_shows_the_live_view_updates_it_while_busy_and_replaces_it() -> None:
    msgs = _iopub(SETUP, CELL)
    kinds = [m["type"] for m in msgs]
    assert "error" not in kinds, msgs
    shown = [i for i, m in enumerate(msgs) if m["type"] == "display_data"]
    replaced = [i for i, m in enumerate(msgs) if m["type"] == "update_display_data"]
    assert len(shown) == 1 and len(replaced) == 2, kinds  # through an empty output to the report
    first, last = msgs[shown[0]], msgs[replaced[-1]]
    assert msgs[replaced[0]]["data"] == {"text/plain": ""}
    assert "application/vnd.jupyter.widget-view+json" in first["data"]
    assert "%%grads model: running" in first["data"]["text/plain"]
    assert last["transient"] == first["transient"] and first["transient"]["display_id"].startswith("tnd-live-")
    assert last["data"]["text/plain"].startswith("gradients of model")
    updates = [m["data"]["state"] for m in msgs[shown[0]:replaced[0]]
               if m["type"] == "comm_msg" and m["data"].get("method") == "update" and "steps" in m["data"]["state"]]
    assert len(updates) >= 2, kinds  # pushed while the cell was running, a few per second
    steps = [u["steps"] for u in updates]
    assert steps == sorted(steps) and 0 < steps[0] < steps[-1] <= 30
    assert len(updates) <= 30 * 0.03 / 0.25 + 2  # rate-limited: not one per step
    assert updates[-1]["panels"][0]["kind"] == "lines"
    # the live widget is closed just before it is replaced (its view leaves the page cleanly)
    assert kinds[replaced[0] - 1] == "comm_close"


def test_a_notebook_executed_by_nbclient_saves_no_live_view(tmp_path: Any) -> None:
    pytest.importorskip("nbclient")
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("%load_ext torch_nbdebug\n" + SETUP), nbformat.v4.new_code_cell(CELL)]
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = nb.cells[1].outputs
    assert [o.output_type for o in outputs] == ["display_data"]
    assert outputs[0].data["text/plain"].startswith("gradients of model")
    states = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    assert not any("panels" in model.get("state", {}) for model in states.values())
