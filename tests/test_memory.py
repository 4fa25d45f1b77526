"""%cudamem recorder + API on CPU: the bytes add up, categories, leaks, restoration, nothing kept alive."""
from __future__ import annotations

import gc
import linecache
import threading
import weakref
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from torch_nbdebug import MemoryState, MemoryTimeline, memory_state, memory_timeline
from torch_nbdebug.data.memory import CATEGORIES, NO_CUDA_NOTE
from torch_nbdebug.errors import InputError
from torch_nbdebug.record.modules import global_hook_counts

TRAIN = """
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.Adam(model.parameters())
for step in range(3):
    x = torch.randn(8, 16)
    out = model(x)
    loss = out.pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    total += loss.item()
"""


def run(code: str, ns: dict[str, Any], **kwargs: Any) -> MemoryTimeline:
    """Run ``code`` in ``ns`` as a notebook cell would, under memory_timeline."""
    gc.collect()  # models of earlier tests still waiting in reference cycles would count as pre-existing
    ns.setdefault("torch", torch)
    ns.setdefault("nn", nn)
    linecache.cache["<cell>"] = (len(code), None, code.splitlines(True), "<cell>")  # as IPython does
    compiled = compile(code, "<cell>", "exec")
    with memory_timeline(ns, device="cpu", **kwargs) as tl:
        exec(compiled, ns)
    return tl


def live_bytes_at(tl: MemoryTimeline, sample: int) -> int:
    return sum(a.nbytes for a in tl.allocations if a.alive_at(sample))


def test_known_allocations_give_exact_peak_and_final() -> None:
    ns: dict[str, Any] = {}
    tl = run("a = torch.empty(100_000_000, dtype=torch.uint8)\n"
             "del a\n"
             "b = torch.empty(50_000_000, dtype=torch.uint8)\n", ns)
    assert tl.peak_bytes - tl.start_bytes == 100_000_000
    assert tl.final_bytes - tl.start_bytes == 50_000_000
    assert len(tl.steps) == 4  # start + alloc, free, alloc
    assert [int(t) - tl.start_bytes for t in tl.totals] == [0, 100_000_000, 0, 50_000_000]
    assert tl.peak_allocations[0].nbytes == 100_000_000
    assert tl.peak_allocations[0].line is not None and tl.peak_allocations[0].line.lineno == 1


def test_categories_sum_to_live_bytes_at_every_sample() -> None:
    ns: dict[str, Any] = {"total": 0.0}
    tl = run(TRAIN, ns)
    assert len(tl.steps) > 50
    totals = tl.by_category.sum(axis=1)
    for sample in range(len(tl.steps)):
        assert int(totals[sample]) == live_bytes_at(tl, sample)
    for sample in (0, tl.peak_step, len(tl.steps) - 1):
        alive = [a for a in tl.allocations if a.alive_at(sample)]
        for c, name in enumerate(CATEGORIES):
            assert int(tl.by_category[sample, c]) == sum(a.nbytes for a in alive if a.category == name)


def test_parameter_gradient_and_optimizer_bytes_match_the_model() -> None:
    ns: dict[str, Any] = {"total": 0.0}
    tl = run(TRAIN.replace("range(3)", "range(1)"), ns)
    model, opt = ns["model"], ns["opt"]
    params = sum(p.nbytes for p in model.parameters())
    grads = sum(p.grad.nbytes for p in model.parameters())
    state = sum(v.untyped_storage().nbytes() for s in opt.state.values() for v in s.values()
                if isinstance(v, torch.Tensor))
    totals = tl.category_totals
    assert totals["parameters"]["allocated"] == params  # the model was created in the block
    assert totals["gradients"]["allocated"] == grads    # one backward: each grad allocated once
    assert totals["gradients"]["final"] == grads
    assert totals["optimizer_state"]["final"] == state
    named = {a.holder: a for a in tl.allocations if a.holder}
    assert named["model.0.weight"].category == "parameters"
    assert named["model.0.weight"].nbytes == model[0].weight.nbytes
    assert named["model.0.weight.grad"].category == "gradients"
    assert named["opt.state[model.0.weight]['exp_avg']"].category == "optimizer_state"


def test_pre_existing_model_is_counted_from_the_start() -> None:
    gc.collect()
    model = nn.Linear(64, 64)
    ns: dict[str, Any] = {"model": model, "x": torch.randn(4, 64)}
    tl = run("loss = model(x).sum()\nloss.backward()\n", ns)
    mine = [a for a in tl.allocations if a.holder in ("model.weight", "model.bias")]
    assert {a.start for a in mine} == {-1}
    assert {a.category for a in mine} == {"parameters"}
    grads = [a for a in tl.allocations if a.holder in ("model.weight.grad", "model.bias.grad")]
    assert sum(a.nbytes for a in grads) == model.weight.grad.nbytes + model.bias.grad.nbytes
    assert {a.category for a in grads} == {"gradients"} and {a.phase for a in grads} == {"backward"}


def test_phases_iterations_modules_and_lines() -> None:
    ns: dict[str, Any] = {"total": 0.0}
    tl = run(TRAIN, ns)
    assert tl.iterations == 3
    assert {p.phase for p in tl.phases} == {"forward", "backward", "optimizer"}
    assert {p.iteration for p in tl.phases} == {1, 2, 3}
    saved = [a for a in tl.allocations if a.category == "activations"]
    assert saved and any(a.module == "model.1" for a in saved)  # ReLU output, saved by ReLU and Linear
    loss = [a for a in tl.allocations if a.op == "mean.default"]
    assert loss and {a.phase for a in loss} == {"forward"}  # computed outside the model, still forward
    assert all(a.line is not None and a.line.filename == "<cell>" for a in tl.allocations if a.start >= 0)
    backward = [a for a in tl.allocations if a.phase == "backward"]
    assert backward and all(a.line.text == "loss.backward()" for a in backward)
    optim = [a for a in tl.allocations if a.phase == "optimizer"]
    assert optim and all(a.line.text == "opt.step()" for a in optim)


def test_views_share_one_storage() -> None:
    tl = run("x = torch.empty(1000)\nv = x.view(10, 100)\nw = x[:5]\nt = x.t() if x.dim() == 2 else x\n", {})
    made = [a for a in tl.allocations if a.start >= 0]
    assert len(made) == 1 and made[0].nbytes == 4000
    assert tl.final_bytes - tl.start_bytes == 4000


LEAKY = """
losses = []
for i in range(5):
    out = model(x)
    loss = out.pow(2).mean()
    losses.append(loss)
"""


def test_leak_scenario_finds_the_container_and_the_graph() -> None:
    ns: dict[str, Any] = {"model": nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)),
                          "x": torch.randn(32, 16)}
    tl = run(LEAKY, ns)
    assert tl.leaks, tl.text()
    leak = tl.leaks[0]
    assert leak.holder == "losses"
    assert "losses[4]" in leak.names[:5] or "losses[0]" in leak.names
    assert leak.has_graph
    assert leak.line is not None and leak.line.text == "loss = out.pow(2).mean()"
    # Each graph keeps its saved activations (the Linear/Tanh outputs) alive: attributed to the holder.
    assert leak.count > 5
    leaked = {i for i in leak.allocation_ids}
    assert sum(a.nbytes for a in tl.allocations if a.id in leaked) == leak.nbytes
    assert leak.nbytes >= 5 * 32 * 64 * 4
    assert "losses" in tl.text()


def test_no_leak_scenario_reports_nothing() -> None:
    ns: dict[str, Any] = {"total": 0.0}
    tl = run(TRAIN, ns)
    assert tl.leaks == ()
    assert "leak" not in tl.text()


def test_restored_after_exception_and_interrupt() -> None:
    gc.collect()  # garbage of earlier tests collected mid-block would add free events
    before = global_hook_counts()
    error = ValueError("user's own")
    with pytest.raises(ValueError) as info:
        with memory_timeline({}, device="cpu") as tl:
            torch.ones(3)
            raise error
    assert info.value is error
    assert global_hook_counts() == before
    assert [a.op for a in tl.allocations if a.start >= 0] == ["ones.default"]  # still built
    with pytest.raises(KeyboardInterrupt):
        with memory_timeline({}, device="cpu") as tl2:
            torch.ones(3)
            raise KeyboardInterrupt
    assert global_hook_counts() == before
    assert [a.op for a in tl2.allocations if a.start >= 0] == ["ones.default"]
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_tool_holds_no_tensors_after_the_block() -> None:
    ns: dict[str, Any] = {"total": 0.0}
    with memory_timeline(ns, device="cpu") as tl:
        kept = torch.randn(100, 100, requires_grad=True)
        y = (kept * 2).sum()
        y.backward()
    refs = [weakref.ref(kept), weakref.ref(kept.grad)]
    del kept, y
    assert all(r() is None for r in refs), "memory_timeline kept a tensor alive"
    leaked = [o for o in gc.get_referents(*gc.get_referents(tl)) if isinstance(o, torch.Tensor)]
    assert leaked == []


def test_memory_state_names_holders() -> None:
    model = nn.Linear(8, 8)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    losses = [torch.ones(1000, requires_grad=True) * 2 for _ in range(3)]
    st = memory_state({"model": model, "opt": opt, "losses": losses}, device="cpu", top=1000)
    assert isinstance(st, MemoryState)
    names = {t.name: t for t in st.top}
    assert names["model.weight"].category == "parameters"
    assert names["model.weight.grad"].category == "gradients"
    assert names["opt.state[model.weight]['exp_avg']"].category == "optimizer_state"
    assert names["losses[2]"].has_graph and names["losses[2]"].nbytes == 4000
    assert st.live_bytes == sum(st.by_category.values())
    assert st.device == "cpu" and st.allocated is None


def test_default_device_without_cuda_says_so() -> None:
    if torch.cuda.is_available():
        pytest.skip("the note is for machines without CUDA")
    with memory_timeline({}) as tl:
        torch.ones(4)
    assert tl.note == NO_CUDA_NOTE and NO_CUDA_NOTE in tl.text()
    assert memory_state({}).note == NO_CUDA_NOTE
    with memory_timeline({}, device="cuda") as tl:  # asked for CUDA, none here: CPU with the note
        torch.ones(4)
    assert tl.device == "cpu" and tl.note == NO_CUDA_NOTE


def test_bad_device_is_an_input_error() -> None:
    with pytest.raises(InputError, match="cpu.*cuda"):
        memory_timeline({}, device="tpu")
    with pytest.raises(InputError):
        memory_state({}, device="gpu")


def test_to_dict_is_plain_data() -> None:
    import json

    tl = run("a = torch.ones(10)\nb = a * 2\n", {})
    data = json.loads(json.dumps(tl.to_dict()))
    assert data["peak_bytes"] == tl.peak_bytes
    assert len(data["samples"]["step"]) == len(tl.steps)
    assert set(data["samples"]["by_category"]) == set(CATEGORIES)
    assert len(tl.samples) == len(tl.steps) and tl.samples[-1].total == tl.final_bytes


def test_users_error_wins_over_a_failure_of_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch_nbdebug.api.memory as api

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("internal")

    monkeypatch.setattr(api, "build_timeline", broken)
    error = KeyError("user's")
    with pytest.warns(RuntimeWarning, match="could not build"):
        with pytest.raises(KeyError) as info:
            with memory_timeline({}, device="cpu"):
                raise error
    assert info.value is error
    with pytest.raises(RuntimeError, match="internal"):  # with no user error, ours is not hidden
        with memory_timeline({}, device="cpu"):
            pass


def test_tensors_made_where_the_mode_cannot_see_are_adopted_at_the_end() -> None:
    # Dispatch modes are per thread: a tensor made in another thread (a loader thread) is unseen
    # until the namespace walk at the end finds it.
    ns: dict[str, Any] = {"threading": threading}
    tl = run("t = threading.Thread(target=lambda: globals().__setitem__('x', torch.ones(1000)))\n"
             "t.start()\nt.join()\n", ns)
    made = [a for a in tl.allocations if a.holder == "x"]
    assert len(made) == 1 and made[0].nbytes == 4000 and made[0].op == "(made outside torch ops)"
    assert tl.final_bytes - tl.start_bytes == 4000 and tl.leaks == ()


def _inplace_error() -> str:
    x = torch.randn(4, requires_grad=True)
    z = x * 2
    w = z * z
    z.mul_(3)
    try:
        w.sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_inplace_modification_of_a_saved_tensor_still_fails_backward_exactly_as_without_us() -> None:
    # The recorder installs no saved-tensors hooks (they switch off autograd's version check), so
    # the user's program fails with PyTorch's own message, word for word.
    plain = _inplace_error()
    assert "modified by an inplace operation" in plain
    with memory_timeline({}, device="cpu"):
        watched = _inplace_error()
    assert watched == plain
    x = torch.randn(4, requires_grad=True)
    with memory_timeline({}, device="cpu"):  # unmodified: backward works and gradients are right
        y = (x * 2) * (x * 2)
        y.sum().backward()
    assert torch.allclose(x.grad, 8 * x.detach())
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        with memory_timeline({}, device="cpu"):
            loss = x.exp().sum()
            loss.backward()
            loss.backward()


def test_pre_existing_tensors_out_of_the_namespace() -> None:
    hidden = torch.zeros(2500)  # reachable from no namespace we pass

    def touch() -> None:
        hidden.add_(1)           # in place: the same storage, not an allocation
        hidden.view(50, 50)

    tl = run("touch()\n", {"touch": touch})
    assert [a.nbytes for a in tl.allocations if a.start >= 0] == []
    assert any(a.start == -1 and a.nbytes == 10_000 for a in tl.allocations)
    assert tl.final_bytes == tl.start_bytes
    with memory_timeline({}, device="cpu", scan_gc=True) as full:  # the collector finds it up front
        pass
    assert any(a.nbytes == 10_000 and a.start == -1 for a in full.allocations)


def test_ops_taking_tensor_lists_join_the_forward_phase() -> None:
    ns: dict[str, Any] = {"w": torch.ones(3, requires_grad=True)}
    tl = run("y = torch.cat([w * 2, w * 3])\n", ns)
    cat = [a for a in tl.allocations if a.op == "cat.default"]
    assert len(cat) == 1 and cat[0].phase == "forward"


def test_leaked_graph_claims_inputs_saved_by_a_later_op() -> None:
    """``F.normalize(x)`` builds no graph (x needs no grad), but the Linear after it saves its output
    for backward: a held loss keeps it alive, so it belongs to the loss's leak, not to "unreachable"."""
    class Norm(nn.Module):
        def forward(self, x):
            return F.normalize(x, dim=-1)

    ns: dict[str, Any] = {"model": nn.Sequential(Norm(), nn.Linear(16, 4)), "F": F}
    tl = run("kept = []\nfor _ in range(3):\n    kept.append(model(torch.randn(8, 16)).sum())\n", ns)
    assert [leak.holder for leak in tl.leaks] == ["kept"], tl.text()
    normalized = [a for a in tl.allocations if a.end is None and a.module == "model.0" and a.shape == (8, 16)]
    assert len(normalized) == 3 and {a.category for a in normalized} == {"activations"}
    assert {a.id for a in normalized} <= set(tl.leaks[0].allocation_ids)


def test_a_leaked_loss_claims_the_targets_its_graph_saved() -> None:
    """``cross_entropy`` saves its target (made outside any module, needing no grad): a loss kept in a
    list keeps that target alive, so it belongs to the list's leak, named through the loss's graph."""
    ns: dict[str, Any] = {"model": nn.Linear(16, 4), "F": F}
    tl = run("kept = []\nfor _ in range(3):\n"
             "    kept.append(F.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,))))\n", ns)
    assert [leak.holder for leak in tl.leaks] == ["kept"], tl.text()
    targets = [a for a in tl.allocations if a.end is None and a.dtype == "int64" and a.shape == (8,)]
    assert len(targets) == 3 and all(a.holder.endswith(".grad_fn") for a in targets)
    assert {a.category for a in targets} == {"activations"}
    assert {a.id for a in targets} <= set(tl.leaks[0].allocation_ids)


class CheckpointedBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x


@pytest.mark.parametrize("steps", [1, 2])
def test_gradient_checkpointings_forward_run_again_in_backward_is_no_new_iteration(steps: int) -> None:
    """The backward calls each checkpointed block again, as a top-level module call: one step is one
    iteration, not one per block."""
    net = CheckpointedBlocks()
    ns = {"net": net, "opt": torch.optim.SGD(net.parameters(), lr=0.1), "steps": steps}
    tl = run("for _ in range(steps):\n    net(torch.randn(4, 16)).sum().backward()\n    opt.step()\n", ns)
    assert tl.iterations == steps


def test_a_tensor_made_from_python_data_in_the_block_is_an_allocation_of_its_line() -> None:
    """``torch.tensor([...])`` builds the tensor outside the dispatcher and hands it to ``lift_fresh``: it
    was counted as alive at the start, without a line. Adam's ``step`` counters are made the same way."""
    ns: dict[str, Any] = {}
    tl = run("a = torch.tensor([1.0] * 2500)\n", ns)
    made = [a for a in tl.allocations if a.nbytes == 10000]
    assert len(made) == 1 and made[0].start >= 0 and made[0].line is not None and made[0].line.lineno == 1
    assert tl.start_bytes == 0 or tl.start_bytes < 10000
    net = nn.Linear(4, 4)
    ns = {"net": net, "opt": torch.optim.Adam(net.parameters())}
    tl = run("net(torch.randn(2, 4)).sum().backward()\nopt.step()\n", ns)
    steps = [a for a in tl.allocations if a.category == "optimizer_state" and a.nbytes == 4]
    assert len(steps) == 2 and all(a.start >= 0 for a in steps)  # one step counter per parameter, made in it
