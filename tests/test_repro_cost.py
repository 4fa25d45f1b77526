"""repro()'s cheaper snapshot and fingerprints keep its meaning: parameters get their own memory back,
optimizer state is restored by value, views held across the runs stay right, a view's input is not
read again unless something wrote its memory."""
from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from torch_nbdebug.api.repro import repro
from torch_nbdebug.data.repro import Fingerprint
from torch_nbdebug.record.repro import ReproRecorder


def make(two_steps: bool = False) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(16, 4)
    if two_steps:  # optimizer state exists before the cell (the copy-on-write path for it)
        step(model, opt, x)
    return model, opt, x


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def twin_of(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[nn.Module, torch.optim.Optimizer]:
    return copy.deepcopy((model, opt))  # one deepcopy: the twin optimizer steps the twin's parameters


def assert_stepped_once(model: nn.Module, opt: torch.optim.Optimizer, twin: nn.Module,
                        twin_opt: torch.optim.Optimizer) -> None:
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], twin_opt.state[q][key])


def test_parameters_keep_their_memory_and_state_is_stepped_once() -> None:
    model, opt, x = make(two_steps=True)
    twin, twin_opt = twin_of(model, opt)
    addresses = [p.data_ptr() for p in model.parameters()]
    report = repro(lambda: step(model, opt, x), state=(model, opt))
    step(twin, twin_opt, x)
    assert report.identical
    assert [p.data_ptr() for p in model.parameters()] == addresses
    assert_stepped_once(model, opt, twin, twin_opt)
    step(model, opt, x)  # the restored optimizer state is the one the next step updates
    step(twin, twin_opt, x)
    assert_stepped_once(model, opt, twin, twin_opt)


def test_views_held_before_and_during_the_runs_see_the_parameter() -> None:
    model, opt, x = make(two_steps=True)
    twin, twin_opt = twin_of(model, opt)
    before = model[0].weight.detach()  # aliases the parameter's memory from the start
    kept: list[torch.Tensor] = []

    def cell() -> None:
        step(model, opt, x)
        kept.append(model[2].weight.detach())  # aliases the memory run 1 wrote

    report = repro(cell, state=(model, opt))
    step(twin, twin_opt, x)
    assert report.identical and len(kept) == 2
    assert_stepped_once(model, opt, twin, twin_opt)
    assert before.data_ptr() == model[0].weight.data_ptr() and torch.equal(before, model[0].weight)
    assert kept[1].data_ptr() == model[2].weight.data_ptr() and torch.equal(kept[1], model[2].weight)
    assert torch.equal(kept[0], model[2].weight)  # run 1's view: same values (the runs agree)


def test_optimizer_state_given_by_name_keeps_its_identity() -> None:
    """A moment only the optimizer holds is restored by value (a new tensor, as ``load_state_dict``
    makes); one also given as state keeps its identity and is copied back."""
    model, opt, x = make(two_steps=True)
    twin, twin_opt = twin_of(model, opt)
    first, last = model[0].weight, model[2].weight
    named, unnamed = opt.state[first]["exp_avg"], opt.state[last]["exp_avg"]
    report = repro(lambda: step(model, opt, x), state={"model": model, "opt": opt, "m": named})
    step(twin, twin_opt, x)
    assert report.identical
    assert_stepped_once(model, opt, twin, twin_opt)
    assert opt.state[first]["exp_avg"] is named and opt.state[last]["exp_avg"] is not unnamed


def inputs_of(recorder: ReproRecorder, op: str) -> list[Any]:
    return [t.inputs for t in recorder.traces if t.op == op]


def test_a_view_is_not_read_again_unless_its_memory_was_written() -> None:
    w = torch.randn(8, 4, requires_grad=True)
    x = torch.randn(3, 4)
    with ReproRecorder() as plain:
        x @ w.t()
    (mm,) = inputs_of(plain, "aten.mm.default")
    assert isinstance(mm[0], Fingerprint) and mm[1] == (0, 0)  # the view op 0 made, not read again

    base = torch.randn(8, 4)
    with ReproRecorder() as written:
        view = base.t()
        base.add_(1.0)
        x @ view
    (mm,) = inputs_of(written, "aten.mm.default")
    assert isinstance(mm[1], Fingerprint)  # its memory changed since the view was made: read again
