"""Shared foundations: tensor statistics, user-line finding, module naming and tracking."""
from __future__ import annotations

import math
import sys

import pytest
import torch
from torch import nn

from torch_nbdebug.record.modules import ModuleTracker, global_hook_counts, parameter_names, qualified_names, module_roots
from torch_nbdebug.record.source import user_line
from torch_nbdebug.record.stats import summarize


def test_stats_count_nonfinite_and_use_finite_range() -> None:
    t = torch.tensor([1.0, -2.0, float("nan"), float("inf"), float("-inf"), 0.0])
    s = summarize(t)
    assert (s.nan, s.inf, s.neg_inf, s.zeros) == (1, 2, 1, 1)
    assert (s.min, s.max) == (-2.0, 1.0)
    assert s.shape == (6,) and s.dtype == "float32" and not s.finite


def test_stats_half_precision_does_not_overflow() -> None:
    t = torch.full((1000,), 60000.0, dtype=torch.float16)
    s = summarize(t)
    assert s.finite and s.mean == pytest.approx(60000.0)


@pytest.mark.parametrize("make", [
    lambda: torch.empty(0),
    lambda: torch.empty(3, 4, device="meta"),
    lambda: torch.arange(5),
    lambda: torch.tensor([True, False]),
    lambda: torch.randn(3, dtype=torch.complex64),
    lambda: torch.eye(3).to_sparse(),
])
def test_stats_never_raise(make) -> None:
    s = summarize(make())
    assert isinstance(s.brief(), str)


def test_stats_keep_no_grad_graph() -> None:
    x = torch.randn(4, requires_grad=True)
    s = summarize(x * 2)
    assert math.isfinite(s.max)


def test_user_line_is_this_test() -> None:
    line = user_line()
    assert line is not None and line.filename == __file__ and "user_line()" in line.text


def test_user_line_skips_torch_frames() -> None:
    seen = []

    class Probe(nn.Module):
        def forward(self, x):
            return x

    def hook(module, args):
        seen.append(user_line(sys._getframe(1)))  # start in torch's frame, as a recorder does

    h = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        Probe()(torch.ones(1))  # the probe line
    finally:
        h.remove()
    assert seen[0].filename == __file__ and "the probe line" in seen[0].text


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(4, 4)

    def forward(self, x):
        return self.attn(x)


def test_qualified_names_follow_user_variable() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(Block(), Block()))
    names = qualified_names(module_roots({"model": model, "_": model, "blk": model[1][0]}))
    assert names[id(model[1][1].attn)] == "model.1.1.attn"
    assert names[id(model[1][0])] == "model.1.0"  # the larger root wins over the alias
    params = parameter_names(module_roots({"model": model}))
    assert params[id(model[0].weight)] == "model.0.weight"


def test_tracker_stack_and_cleanup() -> None:
    model = nn.Sequential(Block(), nn.ReLU())
    seen = []
    before = global_hook_counts()
    with ModuleTracker({"net": model}, on_enter=lambda p, m: seen.append(p)) as tracker:
        model(torch.ones(2, 4))
        assert tracker.current is None
    assert seen == ["net", "net.0", "net.0.attn", "net.1"]
    assert global_hook_counts() == before


def test_tracker_names_inline_models_by_class() -> None:
    seen = []
    with ModuleTracker({}, on_enter=lambda p, m: seen.append(p)):
        nn.Sequential(Block())(torch.ones(1, 4))
    assert seen == ["sequential", "sequential.0", "sequential.0.attn"]


def test_tracker_pops_on_exception() -> None:
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    model = nn.Sequential(Boom())
    with ModuleTracker({"m": model}) as tracker:
        with pytest.raises(RuntimeError, match="boom"):
            model(torch.ones(1))
        assert tracker.stack == []


def test_namer_forgets_a_dead_module_whose_id_is_reused() -> None:
    import gc
    import weakref

    from torch_nbdebug.record.modules import ModuleNamer

    namer = ModuleNamer({})
    ghost = nn.Sequential(nn.Linear(2, 2))
    assert namer.name(ghost) == "sequential"
    dead = weakref.ref(ghost)
    del ghost
    gc.collect()
    other = nn.ReLU()
    namer._names[id(other)] = (dead, "sequential")  # what CPython reusing the freed id looks like
    assert namer.name(other) == "relu"
