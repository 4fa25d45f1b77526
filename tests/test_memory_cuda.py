"""%cudamem on a real CUDA device (run when one is lent): allocator view, categories, history restored."""
from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from torch import nn

from torch_nbdebug import memory_state, memory_timeline

pytestmark = pytest.mark.cuda
MIB = 1 << 20


def history_on() -> bool:
    return bool(torch._C._cuda_isHistoryEnabled())


def round_block(nbytes: int) -> int:
    """The caching allocator's block size for a request (512-byte granularity)."""
    return max(512, -(-nbytes // 512) * 512)


def test_known_cuda_allocations_exact_and_history_restored() -> None:
    assert not history_on()
    with memory_timeline({}, device="cuda") as tl:
        a = torch.empty(100 * MIB, dtype=torch.uint8, device="cuda")
        del a
        b = torch.empty(50 * MIB, dtype=torch.uint8, device="cuda")
    assert not history_on()
    assert tl.device.startswith("cuda") and tl.note == ""
    assert tl.peak_bytes - tl.start_bytes == 100 * MIB
    assert tl.final_bytes - tl.start_bytes == 50 * MIB
    assert tl.reserved is not None and int(tl.reserved.max()) >= tl.peak_bytes
    assert tl.peak_allocations[0].nbytes == 100 * MIB and tl.peak_allocations[0].line is not None
    del b


def test_user_history_is_left_on_and_kept() -> None:
    torch.cuda.memory._record_memory_history("all", max_entries=100000)
    try:
        x = torch.ones(1000, device="cuda")
        with memory_timeline({}, device="cuda") as tl:
            y = torch.ones(2000, device="cuda")
        assert history_on()
        assert [a.nbytes for a in tl.allocations if a.start >= 0] == [8192]  # only the block's events
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        assert any(e["action"] == "alloc" and e["size"] == 4096 for e in trace)  # the user's x is still there
        del x, y
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, clear_history=True)


def test_cuda_categories_and_export(tmp_path: Any) -> None:
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10)).cuda()
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(64, 256, device="cuda")
    path = tmp_path / "snap.pickle"
    with memory_timeline({"model": model, "opt": opt, "x": x}, device="cuda", export=str(path)) as tl:
        for _ in range(2):
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    params = sum(round_block(p.nbytes) for p in model.parameters())
    grads = sum(round_block(p.grad.nbytes) for p in model.parameters())
    assert tl.category_totals["parameters"]["final"] == params
    assert tl.category_totals["gradients"]["final"] == grads
    assert tl.category_totals["optimizer_state"]["final"] > 0
    assert {p.phase for p in tl.phases} >= {"forward", "backward", "optimizer"}
    assert tl.leaks == ()
    snap = pickle.loads(path.read_bytes())
    assert snap["device_traces"] and snap["segments"]
    from torch.cuda import _memory_viz

    assert "TOTAL MEM" in _memory_viz.trace(snap)


def test_cuda_state_counters() -> None:
    t = torch.ones(MIB, device="cuda")
    st = memory_state({"t": t}, device="cuda")
    assert st.allocated == torch.cuda.memory_allocated() and st.reserved >= st.allocated
    assert any(x.name == "t" and x.nbytes == 4 * MIB for x in st.top)
