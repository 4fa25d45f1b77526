"""Pinpoint by replay (``nanwatch(replay=True)``) and the cheap module layer of the CPU path.

A birth inside a module, found by the module layer and replayed under the per-op watch, is reported
as the always-on per-op watch reports it; the replay restores the RNG, changes no buffer and no
``.grad``, falls back to a module-level event (with a note) when the call's arguments changed in place,
and keeps nothing alive.
"""
from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torch_nbdebug.api import nanwatch as nanwatch_api
from torch_nbdebug.api.nanwatch import NanEvent, nanwatch

SRC = open(__file__).read().splitlines()


@pytest.fixture(autouse=True)
def immediate_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replay is the immediate (CPU) path's: never let a CUDA-initialised process pick the deferred one."""
    monkeypatch.setattr(nanwatch_api, "_cuda_in_use", lambda: False)


def line(marker: str) -> int:
    found = [i + 1 for i, text in enumerate(SRC) if marker in text and "line(" not in text]
    assert len(found) == 1, marker
    return found[0]


def same(a: NanEvent, b: NanEvent) -> None:
    """What a user reads of an event: op, module, line, phase, kind, input and output statistics."""
    for name in ("phase", "op", "kind", "module", "filename", "lineno", "function", "inputs", "output", "iteration",
                 "cause", "input_op"):
        assert getattr(a, name) == getattr(b, name), name


class LogBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.log(h - 10)  # @replay-log


class DropLog(nn.Module):
    """Its birth depends on the dropout mask: log(0) only where dropout zeroed an element."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(F.dropout(x.abs() + 1, 0.5, training=True))  # @replay-dropout


class NormLog(nn.Module):
    """A BatchNorm in training mode inside the replayed call: its running statistics must not move twice."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.bn(x) - 10)


class MutatesInput(nn.Module):
    """Writes its input in place after its child ran: the child's call cannot be replayed."""

    def __init__(self) -> None:
        super().__init__()
        self.child = LogBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.child(x)
        x.mul_(2)
        return y


def run(model: nn.Module, x: torch.Tensor, replay: bool, seed: int = 0, backward: bool = True) -> Any:
    torch.manual_seed(seed)
    with nanwatch(replay=replay, namespace={"model": model}) as report:
        out = model(x)
        if backward:
            out.sum().backward()
    return report


def test_a_birth_in_a_users_module_is_named_as_by_the_always_on_watch() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), LogBlock(), nn.Linear(4, 1))
    x = torch.randn(8, 4)
    always, replayed = run(model, x, replay=False), run(model, x, replay=True)
    assert replayed.events and replayed.first.lineno == line("@replay-log")
    assert replayed.first.op == "aten.log.default" and replayed.first.module == "model.1"
    assert len(replayed.events) == len(always.events)
    for a, b in zip(always.events, replayed.events):
        same(a, b)


def test_a_birth_in_a_library_module_names_the_line_that_called_the_model() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    with torch.no_grad():
        model[1].weight.fill_(3e38)
    x = torch.ones(2, 4)
    always, replayed = run(model, x, replay=False), run(model, x, replay=True)
    assert replayed.first.op == "aten.addmm.default" and replayed.first.module == "model.1"
    assert replayed.first.lineno == always.first.lineno and replayed.first.filename == __file__
    for a, b in zip(always.events, replayed.events):
        same(a, b)


def test_replay_with_dropout_finds_the_birth_and_leaves_the_rng_stream_as_it_was() -> None:
    model = nn.Sequential(nn.Linear(4, 4), DropLog())
    x = torch.randn(16, 4)
    always = run(model, x, replay=False, seed=3, backward=False)
    after_always = torch.rand(3)
    replayed = run(model, x, replay=True, seed=3, backward=False)
    after_replayed = torch.rand(3)
    assert replayed.first.op == "aten.log.default" and replayed.first.lineno == line("@replay-dropout")
    same(always.first, replayed.first)
    assert torch.equal(after_always, after_replayed)  # the replay put the generator back
    assert not replayed.summary.notes


def test_an_argument_changed_in_place_after_the_call_falls_back_to_the_module_with_a_note() -> None:
    torch.manual_seed(0)
    model = MutatesInput()
    report = run(model, torch.randn(8, 4), replay=True, backward=False)
    assert report.first.module == "model.child" and report.first.op == "LogBlock (module output)"
    assert any("model.child: replay not possible (its arguments were changed in place after the call)" in note
               for note in report.summary.notes)


def test_replay_changes_no_grad_and_no_running_statistics() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), NormLog())
    x = torch.randn(8, 4)
    plain = [b.clone() for b in model.buffers()]
    model(x)  # one plain forward: what a single forward does to the running statistics
    expected = [b.clone() for b in model.buffers()]
    for buf, value in zip(model.buffers(), plain):
        buf.copy_(value)
    report = run(model, x, replay=True, backward=False)
    assert report.first.op == "aten.log.default"
    assert report.first.module == "model.1"
    assert all(torch.equal(b, e) for b, e in zip(model.buffers(), expected))  # updated once, not twice
    assert all(p.grad is None for p in model.parameters())


def test_nothing_is_kept_alive_after_the_watch() -> None:
    torch.manual_seed(0)
    refs: list[weakref.ref] = []

    class Keep(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.log(x - 10)
            refs.append(weakref.ref(y))
            return y

    model = nn.Sequential(nn.Linear(4, 4), Keep(), nn.Linear(4, 1))
    for replay in (True, False):
        report = run(model, torch.randn(8, 4), replay=replay)
        assert report.events
    gc.collect()
    assert refs and all(r() is None for r in refs)


def test_glue_code_outside_modules_stays_op_precise_with_replay() -> None:
    model = nn.Linear(4, 4)
    x = torch.randn(8, 4)
    with nanwatch(replay=True, namespace={"model": model}) as report:
        y = model(x)
        z = torch.log(y - 100)  # @replay-glue
    del z
    assert report.first.op == "aten.log.default" and report.first.lineno == line("@replay-glue")
    assert report.first.module is None


class SqrtNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt((x * x).sum(-1))  # @replay-sqrt


@pytest.mark.parametrize("library", [False, True])
def test_backward_birth_inside_a_module_gets_its_forward_op_and_line_by_replay(library: bool) -> None:
    """No per-op watch ran in the forward: replaying it names the node's forward op and line."""
    model = nn.Sequential(nn.Linear(3, 3), SqrtNorm())
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
    if library:  # the birth in a library module's backward: the line is the one that called the model
        model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1), nn.Linear(1, 1))
        with torch.no_grad():  # forward stays small; model.1's input gradient is 1e20 * 1e20
            model[0].weight.zero_()
            model[0].bias.fill_(1e-25)
            model[1].weight.fill_(1e20)
            model[2].weight.fill_(1e20)
    x = torch.randn(2, 3)
    always, replayed = run(model, x, replay=False), run(model, x, replay=True)
    assert replayed.first.phase == "backward" and replayed.first.forward_op is not None
    if not library:
        assert replayed.first.forward_op == "aten.sqrt.default" and replayed.first.lineno == line("@replay-sqrt")
    assert [e.title() for e in replayed.events] == [e.title() for e in always.events]
    for a, b in zip(always.events, replayed.events):
        same(a, b)
        assert (a.forward_op, a.forward_module, a.forward_lineno) == (b.forward_op, b.forward_module,
                                                                      b.forward_lineno)


def test_module_mode_table_sees_a_layer_output_before_an_in_place_relu() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))
    with torch.no_grad():
        model[0].bias.fill_(-5.0)
    with nanwatch(mode="module", namespace={"model": model}) as report:
        model(torch.randn(8, 4)).sum().backward()
    layers = {row.module: row for row in report.layers}
    assert layers["model.0"].fwd_min is not None and layers["model.0"].fwd_min < -1  # read before ReLU_
    assert layers["model.1"].fwd_min == 0.0
    assert layers["model.0"].grad_finite is True


def test_module_mode_birth_in_a_loop_is_named_once_at_its_iteration() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), LogBlock(), nn.Linear(4, 1))
    with nanwatch(mode="module", namespace={"model": model}) as report:
        for _ in range(3):
            model(torch.randn(8, 4)).sum().backward()
    assert report.first.module == "model.1" and report.first.op == "LogBlock (module output)"
    assert report.first.iteration == 1
    assert {row.module: row.calls for row in report.layers}["model.1"] == 3


def test_magic_no_replay_flag_keeps_the_per_op_watch_on_and_reports_the_same(ipython: Any) -> None:
    ipython.run_cell("import torch\nfrom torch import nn\ntorch.manual_seed(0)\n"
                     "net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))\nxb = torch.randn(8, 4)")
    body = "net(xb).log().sum().backward()\n"
    try:
        reports = {}
        for line_ in ("-q -o", "-q -o --no-replay"):
            reports[line_] = ipython.run_cell_magic("nanwatch", line_, body)
    finally:
        for name in ("net", "xb", "_nanwatch", "torch", "nn"):
            ipython.user_ns.pop(name, None)
    on, off = reports["-q -o"], reports["-q -o --no-replay"]
    assert on.summary.options["replay"] is True and off.summary.options["replay"] is False
    assert [e.title() for e in on.events] == [e.title() for e in off.events] and on.events


def test_a_module_with_its_own_hooks_is_not_replayed_and_the_note_says_why() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), LogBlock())
    calls: list[int] = []
    handle = model[1].register_forward_hook(lambda m, a, o: calls.append(1))
    try:
        report = run(model, torch.randn(8, 4), replay=True, backward=False)
    finally:
        handle.remove()
    assert calls == [1]  # the user's hook ran once: no replay ran it again
    assert report.first.module == "model.1" and report.first.op == "LogBlock (module output)"
    assert any("hooks of its own" in note for note in report.summary.notes)


class WhereTrap(nn.Module):
    """The where trap inside a module: forward is finite, the log's gradient is born in backward."""

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return torch.where(a > 0, torch.log(a), torch.zeros_like(a))  # @replay-where


@pytest.mark.parametrize("replay", [True, False])
def test_where_trap_in_a_module_reads_as_the_always_on_watch(replay: bool) -> None:
    """The backward birth replay names lists the thrown-away forward log and its hint says where."""
    model = nn.Sequential(WhereTrap())
    a = torch.tensor([1.0, 0.0, 2.0], requires_grad=True)
    with nanwatch(replay=replay) as report:
        model(a).sum().backward()
    first = report.first
    assert (first.phase, first.op, first.module) == ("backward", "LogBackward0", "model.0")
    assert first.lineno == line("@replay-where")
    assert [e.op for e in report.absorbed] == ["aten.log.default"]
    assert report.absorbed[0].lineno == line("@replay-where")
    assert "where" in first.hint.lower()
