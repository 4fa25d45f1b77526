"""memory_timeline's cheap paths (issue 11) keep the timeline exact: which ops read their inputs,
what a view or an in-place op of a known storage costs, and the data built without per-field setattr."""
from __future__ import annotations

import dataclasses
import gc
import weakref
import pickle
import subprocess
import sys
import textwrap
from types import FrameType
from typing import Any, Callable

import pytest
import torch
from torch import nn

from torch_nbdebug import memory_timeline
from torch_nbdebug.data.memory import Allocation
from torch_nbdebug.data.source import SourceLine
from torch_nbdebug.record.compat import op_output_aliases_input
from torch_nbdebug.record.memory.recorder import MemoryRecorder, _AllocationMode
from torch_nbdebug.record.memory.holders import find_holders
from torch_nbdebug.record.tensors import storage_key

aten = torch.ops.aten


def test_allocation_from_values_is_the_constructors_allocation() -> None:
    values = (3, 4096, (32, 32), "float32", "activations", "forward", 7, None, "model.0",
              SourceLine("<cell>", 2, "<module>", "y = model(x)"), "mm.default", "cpu", "y", True, 1234)
    built, constructed = Allocation.from_values(*values), Allocation(*values)
    assert built == constructed and hash(built) == hash(constructed)
    assert built.to_dict() == constructed.to_dict()
    assert pickle.loads(pickle.dumps(built)) == constructed
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.nbytes = 0  # type: ignore[misc]
    assert [getattr(built, f.name) for f in dataclasses.fields(Allocation)] == list(values)


def test_the_schema_tells_which_ops_may_return_an_input_storage() -> None:
    for op in (aten.add_.Tensor, aten.view.default, aten.t.default, aten.split.Tensor, aten.mm.out,
               aten.detach.default, aten._unsafe_view.default, aten.alias.default):
        assert op_output_aliases_input(op), op  # views, in-place, out=, and aliases without annotation
    for op in (aten.add.Tensor, aten.mm.default, aten.clone.default, aten.empty.memory_format, aten.sqrt.default):
        assert not op_output_aliases_input(op), op
    assert op_output_aliases_input(lambda: None)  # no schema: the inputs are read, always right


def test_aliases_of_a_tensor_never_seen_are_not_new_allocations() -> None:
    """A tensor out of the namespace's reach, viewed by ops whose schema says so and by ``_unsafe_view``
    (which does not say so): it existed before recording; only the functional op allocates."""
    gc.collect()
    hidden = torch.zeros(2500)
    with memory_timeline({}, device="cpu") as tl:
        aten._unsafe_view.default(hidden, [50, 50])
        aten.alias.default(hidden)
        hidden.view(50, 50).add_(1)
        doubled = hidden * 2
    made = [a for a in tl.allocations if a.start >= 0]
    assert [(a.op, a.nbytes) for a in made] == [("mul.Tensor", 10_000)]
    assert [a.nbytes for a in tl.allocations if a.start == -1 and a.nbytes == 10_000] == [10_000]
    assert tl.final_bytes - tl.start_bytes == 10_000
    del doubled


def _our_calls(fn: Callable[[], Any]) -> list[str]:
    """Names of the torch_nbdebug functions that run while ``fn()`` runs (Python calls only)."""
    calls: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and "torch_nbdebug" in frame.f_code.co_filename:
            calls.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_views_and_inplace_ops_of_known_storages_cost_a_lookup() -> None:
    unseen = torch.zeros(10)  # made before recording, in no namespace
    with MemoryRecorder({}, device_type="cpu"):
        x = torch.ones(1000)
        view = _our_calls(lambda: x.view(10, 100))
        inplace = _our_calls(lambda: x.add_(1))
        fresh = _our_calls(lambda: x * 2)
        unseen_inplace = _our_calls(lambda: unseen.add_(1))
    assert view == inplace == ["__torch_dispatch__", "_on_outputs"]
    assert "input_storage_keys" not in fresh and "_track" in fresh  # a functional op: no input walk
    assert "input_storage_keys" in unseen_inplace and "_track" in unseen_inplace  # adopted as pre-existing


def test_an_ops_schema_is_read_once_per_process_not_per_recording() -> None:
    """Which ops may return an input's storage is read from the op's schema the first time a recording
    meets the op; later recordings (one per cell) reuse the answer and still tell a view from a new storage."""
    base = torch.ones(1000)
    for _ in range(2):
        with memory_timeline({"base": base}, device="cpu") as tl:
            calls = _our_calls(lambda: base.unsqueeze(0).sum())
        assert [(a.op, a.nbytes) for a in tl.allocations if a.start >= 0] == [("sum.default", 4)]
    assert "op_output_aliases_input" not in calls  # the second recording asked no schema


def test_training_state_keys_name_every_parameter_gradient_and_state_once() -> None:
    """A parameter the optimizer marked is not read again through its module, and one only a module
    holds (a frozen layer outside the optimizer) is still marked, with its gradient."""
    from torch_nbdebug.record.memory.holders import persistent_keys

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.Adam(model[0].parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    kinds = persistent_keys(list(model.modules()), [opt])
    expected = {storage_key(v): "optimizer_state" for s in opt.state.values() for v in s.values()}
    for p in model.parameters():
        expected[storage_key(p)] = "parameters"
        expected[storage_key(p.grad)] = "gradients"
    assert kinds == expected and len(kinds) == 3 * 2 + 4 + 4


def test_the_recorders_mode_runs_without_dynamos_per_op_wrapper() -> None:
    # TorchDispatchMode wraps __torch_dispatch__ in torch._disable_dynamo unless told not to: two more
    # Python frames per op. The recorder's own function must be what the dispatcher calls.
    assert vars(_AllocationMode)["__torch_dispatch__"].__qualname__ == "_AllocationMode.__torch_dispatch__"


def test_dynamo_never_compiles_the_recorder_when_torch_compile_is_first_used_inside() -> None:
    """Without the per-op wrapper, the handler's code object tells dynamo to skip it and what it calls:
    a model compiled and run inside the block runs eagerly, and none of the recorder is traced. A fresh
    interpreter, so dynamo is first loaded inside the block; the recorder itself does not import it."""
    code = textwrap.dedent("""
        import sys, torch, torch_nbdebug as nb
        from torch import nn
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        with nb.memory_timeline({}, device="cpu") as tl:
            (torch.ones(3) * 2).sum()
            assert "torch._dynamo" not in sys.modules, "the recorder imported dynamo"
            model = torch.compile(net, backend="aot_eager")
            model(torch.randn(3, 4)).sum().backward()
        from torch._dynamo.utils import counters
        from torch._dynamo.convert_frame import input_codes
        assert not counters["frames"], dict(counters["frames"])  # no frame compiled, ours or the user's
        seen = {c.co_name for c in (r() for r in list(input_codes.seen)) if c is not None}
        assert not seen & {"__torch_dispatch__", "_on_outputs", "_track", "_input_keys"}, seen
        assert "ran eagerly" in tl.note and any(a.op == "addmm.default" for a in tl.allocations)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_the_start_walk_finds_the_same_tensors_without_names() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    ns = {"model": model, "opt": opt, "batches": [torch.ones(5), {"x": torch.zeros(2)}]}
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    named, unnamed = find_holders(ns), find_holders(ns, named=False)
    assert set(named.names) == set(unnamed.names)
    assert len(named.names) == 2 * len(list(model.parameters())) + len(state) + 2  # params, grads, state, batches
    exp_avg = storage_key(opt.state[model[0].weight]["exp_avg"])
    assert named.names[exp_avg] == "opt.state[model.0.weight]['exp_avg']"
    assert unnamed.names[exp_avg] == "opt.state[param0]['exp_avg']"  # by index: names are not needed at the start


def test_a_modules_own_attributes_holding_tensors_are_named_past_its_plain_settings() -> None:
    """The walk skips a module's ints, floats and strings before naming them; what they sit next to
    (a tensor, a list of tensors, a tuple setting with a tensor in it) is still found and named."""
    layer = nn.Linear(4, 4)
    layer.cache = torch.ones(3)
    layer.history = [torch.zeros(2), 7, "note"]
    layer.limits = (0.5, torch.full((2,), 2.0))
    layer.scale, layer.tag, layer.on = 2.0, "x", True
    holders = find_holders({"model": nn.Sequential(layer)})
    names = {holders.names[storage_key(t)] for t in (layer.cache, layer.history[0], layer.limits[1])}
    assert names == {"model.0.cache", "model.0.history[0]", "model.0.limits[1]"}
    assert len(holders.names) == 2 + 3  # weight, bias and the three tensors


def test_event_times_count_from_the_start_of_recording() -> None:
    """Times are kept raw while recording and made relative once at the end: every event lies between
    the start and the end of the block, in order."""
    with memory_timeline({}, device="cpu") as tl:
        kept = [torch.ones(1000) * i for i in range(5)]
        del kept[:2]
    assert tl.time_s[0] == 0.0 and len(tl.time_s) > 5
    assert (tl.time_s >= 0).all() and (tl.time_s <= tl.duration_s).all()
    assert (tl.time_s[1:] >= tl.time_s[:-1]).all()


def _site_of(start: FrameType) -> Any:
    """Called from this test file: the innermost user frame is this one, or its caller's."""
    from torch_nbdebug.record.source import user_frame, user_position

    frame = user_frame(start)
    assert frame is not None
    return user_position(start), (frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


def test_user_position_names_the_frame_user_frame_finds() -> None:
    from torch_nbdebug.record.source import user_position

    here = sys._getframe()
    assert user_position(here) == (__file__, here.f_lineno, "test_user_position_names_the_frame_user_frame_finds")
    position, expected = _site_of(sys._getframe())
    assert position == expected
    # Starting inside torch: its frames are skipped up to the line of this test that called into it.
    import torch.utils._pytree as pytree

    found: list[Any] = []
    line = sys._getframe().f_lineno + 1
    pytree.tree_map(lambda leaf: found.append(_site_of(sys._getframe(1))), [1])
    assert found[0][0] == found[0][1] == (__file__, line, "test_user_position_names_the_frame_user_frame_finds")
    assert user_position(None) is None


def test_the_recorder_keeps_no_weak_reference_after_it_stops() -> None:
    """The weak references that report frees live on the records while recording, and go with them."""
    recorder = MemoryRecorder({}, device_type="cpu")
    with recorder:
        made = torch.ones(1000) * 2
        during = weakref.getweakrefcount(made.untyped_storage())
    assert during == 1
    assert weakref.getweakrefcount(made.untyped_storage()) == 0
    assert [a.nbytes for a in recorder.recording.allocations if a.op == "mul.Tensor"] == [4000]


def test_the_end_walk_skips_known_storages_but_names_them() -> None:
    model = nn.Linear(3, 2)
    extra = torch.zeros(4)
    ns = {"model": model, "extra": extra}
    known = {storage_key(model.weight)}
    seen: list[int] = []
    holders = find_holders(ns, on_new=lambda key, tensor: seen.append(key), known=known)
    assert storage_key(model.weight) not in seen
    assert set(seen) == {storage_key(model.bias), storage_key(extra)}
    assert holders.names[storage_key(model.weight)] == "model.weight"


def test_a_model_run_and_in_the_namespace_is_read_once_at_the_end() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = MemoryRecorder({"model": model, "opt": opt}, device_type="cpu")
    with recorder:
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        modules, optimizers = recorder._state_owners()
    assert [id(m) for m in modules] == [id(m) for m in model.modules()]
    assert optimizers == [opt]
