"""repro()'s short paths keep its meaning: ops inside an optimizer step (compared by name and scalars,
random and listed ops still read), copies not read again, and a parameter's first write computed out
of place (the in-place op's twin) instead of copying the parameter first."""
from __future__ import annotations

import copy
import inspect
import random
from typing import Any, Callable

import pytest
import torch
from torch import nn

from torch_nbdebug.api.repro import repro
from torch_nbdebug.record.repro import ReproRecorder
from torch_nbdebug.record.repro.ops import op_info


def line_of(fn: Any, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def make(foreach: bool = False) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, foreach=foreach), torch.randn(9, 5)


def train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


class NoisySGD(torch.optim.SGD):
    """SGD that adds noise to the parameters: randomness inside the step."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        super().step()
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(torch.randn_like(p) * 1e-3)


def test_random_op_inside_an_optimizer_step_is_found() -> None:
    model, _, x = make()
    opt = NoisySGD(model.parameters(), lr=0.1)
    report = repro(lambda: train(model, opt, x), state=(model, opt), restore_rng=False)
    first = report.first
    assert report.cause == "rng" and (first.op, first.phase) == ("aten.randn_like.default", "optimizer")
    assert first.lineno == line_of(NoisySGD.step, "torch.randn_like(p)")
    assert repro(lambda: train(model, opt, x), state=(model, opt)).identical  # restored RNG: same noise


def test_hyperparameter_changed_between_runs_is_external_at_the_step() -> None:
    model, opt, x = make()

    def cell() -> None:
        opt.param_groups[0]["lr"] = random.random()
        train(model, opt, x)

    report = repro(cell, state=(model, opt), restore_rng=False)
    assert report.cause == "external" and report.first.phase == "optimizer"
    assert report.first.input == "a Python number or shape passed to the op"


def test_listed_nondeterministic_op_in_a_step_is_listed() -> None:
    class IndexSGD(torch.optim.SGD):
        @torch.no_grad()
        def step(self, closure: Any = None) -> None:  # type: ignore[override]
            for group in self.param_groups:
                for p in group["params"]:
                    flat = p.view(-1)
                    flat.index_copy_(0, torch.tensor([0]), (flat[:1] - 0.1 * p.grad.view(-1)[:1]))

    model, _, x = make()
    opt = IndexSGD(model.parameters(), lr=0.1)
    report = repro(lambda: train(model, opt, x), state=(model, opt))
    [use] = report.nondeterministic_ops
    assert report.identical and (use.op, use.device, use.count) == ("aten.index_copy_.default", "cpu", 4)


@pytest.mark.parametrize("foreach", [False, True])
def test_step_runs_once_with_parameters_in_their_memory(foreach: bool) -> None:
    """Run 1 writes each parameter out of place (``mul`` for AdamW's ``mul_``, ``_foreach_mul`` for
    ``_foreach_mul_``); the parameters get their memory back and the state is one step's."""
    model, opt, x = make(foreach)
    train(model, opt, x)  # moments exist before the cell
    twin, twin_opt = copy.deepcopy((model, opt))
    addresses = [p.data_ptr() for p in model.parameters()]
    report = repro(lambda: train(model, opt, x), state=(model, opt))
    train(twin, twin_opt, x)
    assert report.identical and [p.data_ptr() for p in model.parameters()] == addresses
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], twin_opt.state[q][key])


def _twin_cases() -> list[tuple[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Any]]]:
    aten = torch.ops.aten
    return [
        ("mul_.Tensor", lambda a, b, c: (aten.mul_.Tensor, (a, b))),
        ("mul_.Scalar", lambda a, b, c: (aten.mul_.Scalar, (a, 0.999))),
        ("add_.Tensor", lambda a, b, c: (aten.add_.Tensor, (a, b), {"alpha": -0.3})),
        ("sub_.Tensor", lambda a, b, c: (aten.sub_.Tensor, (a, b))),
        ("div_.Tensor", lambda a, b, c: (aten.div_.Tensor, (a, c))),
        ("lerp_ low", lambda a, b, c: (aten.lerp_.Scalar, (a, b, 0.1))),
        ("lerp_ high", lambda a, b, c: (aten.lerp_.Scalar, (a, b, 0.9))),
        ("addcmul_", lambda a, b, c: (aten.addcmul_.default, (a, b, c), {"value": 0.001})),
        ("addcdiv_", lambda a, b, c: (aten.addcdiv_.default, (a, b, c), {"value": -0.01})),
        ("_foreach_lerp_", lambda a, b, c: (aten._foreach_lerp_.Scalar, ([a, c], [b, b], 0.1))),
        ("_foreach_addcdiv_", lambda a, b, c: (aten._foreach_addcdiv_.ScalarList,
                                               ([a, b.clone()], [b, b], [c, c], [0.5, -2.0]))),
    ]


@pytest.mark.parametrize("n", [1, 7, 1031, 65537])
def test_out_of_place_twins_compute_what_the_in_place_ops_compute(n: int) -> None:
    """Run 1 uses the twin, run 2 the in-place op: they must agree bit for bit, or repro would report
    a difference the user's program does not have."""
    gen = torch.Generator().manual_seed(n)
    for name, case in _twin_cases():
        a, b = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
        c = torch.rand(n, generator=gen) + 0.5
        func, args, *rest = case(a, b, c)
        kwargs = rest[0] if rest else {}
        twin = op_info(func).twin
        assert twin is not None, name
        fresh = twin(*copy.deepcopy(args), **kwargs)
        written = copy.deepcopy(args)
        func(*written, **kwargs)
        expected = written[0] if isinstance(written[0], list) else [written[0]]
        got = fresh if isinstance(fresh, (list, tuple)) else [fresh]
        for x, y in zip(expected, got):
            assert torch.equal(x.view(torch.int32), y.view(torch.int32)), name


def test_list_op_reading_what_it_writes_elsewhere_falls_back_to_a_copy() -> None:
    """In place, ``_foreach_add_([v, w], [w, v])`` adds the new ``v`` to ``w``; its twin would add the
    old one: run 1 copies first instead, and the runs agree."""
    v, w = nn.Parameter(torch.ones(3)), nn.Parameter(torch.full((3,), 2.0))

    def cell() -> torch.Tensor:
        with torch.no_grad():
            torch._foreach_add_([v, w], [w, v])
        return (v * w).sum()

    report = repro(cell, state={"v": v, "w": w})
    assert report.identical
    assert torch.equal(v, torch.full((3,), 3.0)) and torch.equal(w, torch.full((3,), 5.0))


def test_type_promoting_first_write_falls_back_to_a_copy() -> None:
    """``add_`` of a float64 tensor keeps a float32 parameter float32; its twin would make float64:
    the parameter is copied first instead, and the cell still runs once."""
    w = nn.Parameter(torch.ones(3))
    delta = torch.full((3,), 0.25, dtype=torch.float64)

    def cell() -> torch.Tensor:
        with torch.no_grad():
            w.add_(delta)
        return (w * 2).sum()

    address = w.data_ptr()
    report = repro(cell, state={"w": w})
    assert report.identical and w.dtype == torch.float32 and w.data_ptr() == address
    assert torch.equal(w, torch.full((3,), 1.25))


def test_copies_are_not_read_again_but_their_sources_are() -> None:
    x = torch.randn(4, 3)
    with ReproRecorder() as recorder:
        y = (x * 2).t().contiguous()
        torch.cat([y, y]).sum()
    ops = {t.op: t for t in recorder.traces}
    assert ops["aten.clone.default"].outputs == ("a copy of its input",)
    assert ops["aten.cat.default"].outputs == ("a copy of its input",)
    assert ops["aten.cat.default"].inputs == ((2, 0), (2, 0))  # the clone (op 2), as its output
    assert ops["aten.mul.Tensor"].outputs[0].bits != 0  # computing ops are read

    total = torch.zeros(3)  # outside the snapshot, changed by the previous run
    report = repro(lambda: total.add_(1.0).clone().sum())
    assert report.cause == "external" and report.first.op == "aten.add_.Tensor"


def test_sparse_gradients_agree_run_after_run() -> None:
    """A sparse gradient cannot be fingerprinted, so its copies must not be remembered by address either:
    a later sparse tensor at the same address once matched the stale entry ("external" on identical runs)."""
    differed = []
    for trial in range(8):
        torch.manual_seed(trial)
        model = nn.Embedding(10, 4, sparse=True)
        opt = torch.optim.SparseAdam(list(model.parameters()), lr=0.1)
        x = torch.randint(0, 10, (6,))

        def cell() -> None:
            for _ in range(2):
                loss = model(x).pow(2).sum()
                opt.zero_grad()
                loss.backward()
                opt.step()

        cell()
        report = repro(cell, state=(model, opt))
        if not report.identical:
            differed.append((trial, report.cause, report.first))
    assert differed == []
