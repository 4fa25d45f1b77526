"""Pinpoint by replay (``nanwatch(replay=True)``) and the cheap module layer of the CPU path.

A birth inside a module, found by the module layer and replayed under the per-op watch, is reported
as the always-on per-op watch reports it; the replay restores the RNG, changes no buffer and no
``.grad``, falls back to a module-level event (with a note) when the call's arguments changed in place,
and keeps nothing alive.
"""
from __future__ import annotations

import dataclasses
import gc
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torch_nbdebug.api.nanwatch import NanEvent, nanwatch

from nanwatch_paths import both, immediate_path, marker_line  # noqa: F401 - immediate_path: every test here, CPU path

SRC = open(__file__).read().splitlines()


@pytest.fixture(autouse=True, params=[True, False], ids=["cpu-read-at-exit", "device-read-with-the-model"])
def read_at_exit(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test here runs both ways a kept module output is read: a CPU's, as its module returns, and
    a device's (CUDA), with the others when the model returns (the CPU stands in)."""
    from torch_nbdebug.record.nanwatch.replay import outputs as nanwatch_modules

    monkeypatch.setattr(nanwatch_modules, "READ_AT_EXIT", request.param)


def line(marker: str) -> int:
    return marker_line(SRC, marker)


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


class NormThenLog(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.bn(self.fc(x)) - 100)


def test_replay_never_writes_the_users_buffers_so_their_backward_still_runs() -> None:
    """The replay swaps detached clones in for the buffers; autograd's saved buffers keep their version."""
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    torch.manual_seed(0)
    model = NormThenLog()
    versions = [b._version for b in model.buffers()]
    always = run(model, x, replay=False)
    after_always = [b._version - v for b, v in zip(model.buffers(), versions)]
    torch.manual_seed(0)
    model = NormThenLog()
    ids = {name: id(b) for name, b in model.named_buffers()}
    versions = [b._version for b in model.buffers()]
    replayed = run(model, x, replay=True)  # the backward would raise "modified by an inplace operation"
    assert [b._version - v for b, v in zip(model.buffers(), versions)] == after_always
    assert {name: id(b) for name, b in model.named_buffers()} == ids
    assert model.bn.num_batches_tracked.item() == 1
    same(always.first, replayed.first)


class TwoBirths(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = self.fc(x)
        if step == 0:
            return torch.log(h - 100)  # @replay-first-birth
        return torch.sqrt(h - 100)  # @replay-later-birth


def test_a_later_birth_in_a_module_that_already_has_an_event_is_still_found() -> None:
    """Only the events of the running check say "an inner call's birth, replayed already"."""
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    always, replayed = both(TwoBirths, lambda model: [model(x, step) for step in range(2)], grad=False)
    assert [e.lineno for e in replayed.events] == [line("@replay-first-birth"), line("@replay-later-birth")]
    assert len(replayed.events) == len(always.events)
    for a, b in zip(always.events, replayed.events):
        same(a, b)


class WritesChildOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.sub_(100).log_()  # @replay-parent-inplace
        return h * 1


def test_an_in_place_write_by_the_parent_on_a_childs_output_is_blamed_on_the_parent() -> None:
    """A kept output written in place since its module returned is not the child's birth."""
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    always, replayed = both(WritesChildOutput, lambda model: model(x), grad=False)
    assert replayed.first.op == "aten.log_.default" and replayed.first.module == "model"
    assert replayed.first.lineno == line("@replay-parent-inplace")
    same(always.first, replayed.first)
    assert not replayed.summary.notes


def test_a_global_module_hook_of_the_user_runs_once_the_call_is_not_replayed() -> None:
    """A global module hook (not the watch's own) would run again in a replay."""
    from torch.nn.modules.module import register_module_forward_hook

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), LogBlock())
    calls: list[str] = []
    handle = register_module_forward_hook(lambda m, a, o: calls.append(type(m).__name__))
    try:
        report = run(model, torch.randn(8, 4), replay=True, backward=False)
    finally:
        handle.remove()
    assert sorted(calls) == sorted(["Linear", "Linear", "LogBlock", "Sequential"])  # each module once
    assert report.first.module == "model.1" and report.first.op == "LogBlock (module output)"
    assert any("global module hook" in note for note in report.summary.notes)


def doubler(refs: list) -> type:
    """A module class whose outputs are watched by weak reference (``refs``): is anything keeping them?"""

    class Block(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            refs.append(weakref.ref(y))
            return y

    return Block


def test_a_forward_that_raised_keeps_nothing_alive_for_the_rest_of_the_watch() -> None:
    """When the outermost call ends by raising, its kept outputs are dropped at once."""
    refs: list[weakref.ref] = []

    Block = doubler(refs)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = Block()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.block(x)
            raise RuntimeError("out of memory (simulated)")

    model = Net()
    with torch.no_grad(), nanwatch(replay=True, namespace={"model": model}):
        with pytest.raises(RuntimeError):
            model(torch.randn(100))
        gc.collect()
        assert refs and refs[0]() is None


def test_under_no_grad_module_outputs_are_not_kept_alive_and_births_are_still_op_precise() -> None:
    """A no-grad output is kept by weakref (its statistics read at once); a freed one is named by
    replaying the whole model call, as the always-on watch names it."""
    refs: list[weakref.ref] = []

    Block = doubler(refs)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(4)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x) + 0  # the block's output is dropped here
            alive.append(sum(r() is not None for r in refs[:-1]))
            return x

    alive: list[int] = []
    with torch.no_grad(), nanwatch(replay=True):
        Net()(torch.randn(1000))
    assert alive == [0]
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    with torch.no_grad():
        model[0].weight.fill_(3e38)
    reports = {}
    for replay in (False, True):
        with torch.no_grad(), nanwatch(replay=replay, namespace={"model": model}) as reports[replay]:
            model(torch.ones(2, 4))
    always, replayed = reports[False], reports[True]
    assert replayed.first.op == "aten.addmm.default" and replayed.first.module == "model.0"
    assert len(always.events) == len(replayed.events)
    for a, b in zip(always.events, replayed.events):
        same(a, b)


@dataclasses.dataclass
class PairOut:
    y: torch.Tensor


class TupleOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        return h, torch.log(h - 100)  # @replay-tuple-second


class DataclassOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> PairOut:
        return PairOut(torch.log(self.fc(x) - 100))  # @replay-dataclass


@pytest.mark.parametrize("cls,marker", [(TupleOut, "@replay-" + "tuple-second"),
                                        (DataclassOut, "@replay-" + "dataclass")])
def test_a_birth_in_a_later_or_dataclass_output_is_found_as_by_the_always_on_watch(cls: type, marker: str) -> None:
    """Every float leaf of a module's output is checked, not only the first tensor."""
    x = torch.randn(2, 4)
    always, replayed = both(cls, lambda model: model(x))
    assert replayed.first.op == "aten.log.default" and replayed.first.lineno == line(marker)
    assert len(always.events) == len(replayed.events)
    for a, b in zip(always.events, replayed.events):
        same(a, b)


class KvCache:
    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []

    def update(self, t: torch.Tensor) -> torch.Tensor:
        self.keys.append(t)
        return torch.cat(self.keys)


class CachedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: KvCache) -> torch.Tensor:
        return torch.log(cache.update(self.fc(x)) - 100)


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.seen.append(x)
        return torch.log(self.fc(x) - 100)  # @replay-counting


def test_a_replay_repeats_no_side_effect_of_the_forward() -> None:
    """A call with an object argument (a KV cache) is not replayed; a module's own attributes
    (a counter, a list) are put back after a replay, with a note."""
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    model, cache = CachedAttention(), KvCache()
    with nanwatch(replay=True, namespace={"model": model}) as report:
        model(x, cache=cache)
    assert len(cache.keys) == 1
    assert report.first.module == "model" and report.first.op == "CachedAttention (module output)"
    assert any("an object the call may update" in note for note in report.summary.notes)
    reports = {}
    for replay in (False, True):
        torch.manual_seed(0)
        counting = Counting()
        with nanwatch(replay=replay, namespace={"model": counting}) as reports[replay]:
            counting(x)
        assert counting.calls == 1 and len(counting.seen) == 1
    assert reports[True].first.lineno == line("@replay-counting")
    same(reports[False].first, reports[True].first)
    assert any("changed the module's attributes" in note for note in reports[True].summary.notes)


FORWARDS: list[int] = []


class SqrtCounted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        FORWARDS.append(1)  # outside the module: only a replay would append again
        return torch.sqrt((self.fc(x) * 0).abs())  # @replay-counted-sqrt


def test_a_backward_birth_is_replayed_once_as_the_backward_ends_before_a_manual_weight_update() -> None:
    """The forward is replayed only with the weights it ran with: at the end of the backward, before
    the user's own update; nothing replays it again afterwards (nanwatch_backward)."""
    torch.manual_seed(0)
    model, x = SqrtCounted(), torch.randn(2, 3)
    FORWARDS.clear()
    with nanwatch(replay=True, namespace={"model": model}) as report:
        model(x).sum().backward()
        assert FORWARDS == [1, 1]  # the call, and its replay
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * torch.nan_to_num(p.grad)
    assert FORWARDS == [1, 1]
    assert report.first.phase == "backward" and report.first.forward_op == "aten.sqrt.default"
    assert report.first.lineno == line("@replay-counted-sqrt")


def test_backward_birth_naming_replays_the_forward_under_its_autocast() -> None:
    """A forward that ran under autocast is replayed under it (the backward ran outside)."""
    reports = {}
    for replay in (False, True):
        torch.manual_seed(0)
        model, x = SqrtCounted(), torch.randn(2, 3)
        with nanwatch(replay=replay, namespace={"model": model}) as reports[replay]:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            out.float().sum().backward()
    always, replayed = reports[False], reports[True]
    assert always.first.forward_op is not None
    assert [(e.op, e.forward_op, e.forward_lineno) for e in replayed.events] == \
        [(e.op, e.forward_op, e.forward_lineno) for e in always.events]


class Sampler(nn.Module):
    """A forward that dies of its own NaN: ``torch.multinomial`` refuses NaN probabilities."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        p = torch.softmax(self.fc(x) * scale, -1)  # @replay-raise
        return torch.multinomial(p, 1)


@pytest.mark.parametrize("keyword", [False, True])
def test_a_forward_that_raises_because_of_its_nan_still_names_the_birth(keyword: bool) -> None:
    """The classic crash: the report names the softmax that made the NaN, as the always-on watch does,
    also when the model was called with keyword arguments; the user's error passes through unchanged."""
    torch.manual_seed(0)
    model = Sampler()
    x = torch.randn(2, 4)
    found = {}
    for replay in (True, False):
        with pytest.raises(RuntimeError, match="probability tensor contains"):
            with nanwatch(replay=replay) as report:
                model(x=x, scale=float("inf")) if keyword else model(x, float("inf"))
        found[replay] = [(e.op, e.module, e.lineno) for e in report.events]
    assert found[True] == found[False] == [("aten._softmax.default", "model", line("@replay-raise"))]


class ScalesChildOutput(nn.Module):
    """Writes its child's output in place after the child returned; a container returns its child's output,
    a pair's second tensor goes non-finite (a birth only, no row of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.inner = nn.Sequential(nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.fc(x)
        h.mul_(3)
        out = self.inner(h)
        return out, torch.log(out - 100)  # @replay-pair


def test_the_layer_table_under_replay_shows_each_output_as_its_module_returned_it() -> None:
    """A row's numbers are its output's when the module returned; an output written in place by the
    parent since has none (they would be the parent's); a container shows its child's numbers."""
    torch.manual_seed(0)
    model, x = ScalesChildOutput(), torch.randn(3, 4)
    with nanwatch(namespace={"model": model}) as report:
        out, _ = model(x)
    rows = {row.module: row for row in report.layers}
    numbers = (out.min().item(), out.max().item(), out.sum().item() / out.numel())
    for path in ("model.inner.0", "model.inner", "model"):
        assert (rows[path].fwd_min, rows[path].fwd_max, rows[path].fwd_mean) == numbers
        assert rows[path].fwd_finite is True
    assert rows["model.fc"].fwd_min is None and rows["model.fc"].fwd_finite is None
    assert report.first.op == "aten.log.default" and report.first.module == "model"
    assert report.first.lineno == line("@replay-pair")


class WritesThroughData(nn.Module):
    """The parent writes its child's output through ``.data`` after the child returned (no version bump)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act = nn.Linear(4, 4), LogBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h.data.fill_(float("nan"))
        return self.act(h)


def test_an_output_overwritten_through_data_after_its_module_returned_reads_as_the_always_on_watch() -> None:
    """The table shows what ``fc`` returned (finite), not what its parent wrote into it later through
    ``.data`` (which autograd's version counter does not see), and the event is the always-on watch's."""
    reports = []
    for replay in (False, True):
        torch.manual_seed(0)
        model = WritesThroughData()
        with nanwatch(replay=replay, namespace={"model": model}) as report:
            model(torch.randn(3, 4)).sum().backward()
        reports.append(report)
    always, replayed = reports
    assert [(e.phase, e.op, e.module, e.cause) for e in replayed.events] == \
        [(e.phase, e.op, e.module, e.cause) for e in always.events]
    rows = [{(r.module, r.fwd_min, r.fwd_max, r.fwd_finite) for r in rep.layers if r.module == "model.fc"}
            for rep in reports]
    assert rows[0] == rows[1] and next(iter(rows[1]))[3] is True
