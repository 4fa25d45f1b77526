"""The backward of ``replay=True`` runs without the per-op dispatch mode (nanwatch_backward).

A backward birth inside a model is found by checking the gradients at module granularity and
replaying the model call's forward *and* backward under the per-op watch; a birth in the loss (ops
outside a model) by running its autograd node again from the node's own hook. Every report here must
equal the always-on watch's (``replay=False``), field by field; the replay changes no ``.grad`` and
keeps no gradient after the watch.
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
from torch.utils.checkpoint import checkpoint

from torch_nbdebug.api.nanwatch import nanwatch
from torch_nbdebug.record import compat
from torch_nbdebug.record.nanwatch.replay import backward as nanwatch_backward
from torch_nbdebug.record.nanwatch.replay import calls as nanwatch_backward_calls

from nanwatch_paths import both, immediate_path, marker_line  # noqa: F401 - immediate_path: every test here, CPU path

SRC = open(__file__).read().splitlines()


def line(marker: str) -> int:
    return marker_line(SRC, marker)


FIELDS = ("phase", "op", "kind", "module", "filename", "lineno", "function", "inputs", "output", "iteration",
          "cause", "input_op", "aten_op", "node_name", "forward_op", "forward_module", "forward_lineno", "detail")


def assert_same(always: Any, replayed: Any) -> None:
    """What a user reads of each event, the absorbed ones too, and the sequence-number order."""
    assert always.events or always.absorbed, "the scenario must make a birth"
    for name, a_list, b_list in (("events", always.events, replayed.events),
                                 ("absorbed", always.absorbed, replayed.absorbed)):
        assert [e.title() for e in a_list] == [e.title() for e in b_list], name
        for a, b in zip(a_list, b_list):
            for field in FIELDS:
                assert getattr(a, field) == getattr(b, field), (name, field)
    assert not [n for n in replayed.summary.notes if "could not check" in n]


class SqrtNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt((self.fc(x) * 0).pow(2).sum(-1))  # @bw-sqrt


def sqrt_model() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 3), SqrtNorm())


@pytest.mark.parametrize("input_grad", [False, True])
def test_the_dispatch_mode_is_off_during_a_models_backward_and_its_forward(input_grad: bool) -> None:
    """The cost: no per-op Python in the model's forward or backward (a custom Function reads the stacks);
    an input that requires grad, used in the loss too (our hook on it is not the user's), keeps the
    backward unwatched."""
    seen: dict[str, list[tuple[int, int]]] = {"forward": [], "backward": []}

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            seen["forward"].append((compat.dispatch_stack_len(), compat.function_stack_len()))
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            seen["backward"].append((compat.dispatch_stack_len(), compat.function_stack_len()))
            return grad

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Spy.apply(self.fc(x))

    model = Model()
    found = {}
    for replay in (False, True):
        seen["forward"].clear()
        seen["backward"].clear()
        with nanwatch(replay=replay) as report:
            x = torch.randn(2, 4, requires_grad=input_grad)
            (F.mse_loss(model(x), torch.zeros(2, 4)) + (x.sum() * 0 if input_grad else 0)).backward()
        assert not report.events
        found[replay] = (list(seen["forward"]), list(seen["backward"]))
    assert found[False] == ([(1, 0)], [(1, 0)])  # the always-on watch: its mode everywhere
    assert found[True] == ([(0, 0)], [(0, 0)])  # replay: no mode of ours in the model, either way


def test_a_backward_birth_inside_a_model_reads_as_the_always_on_watch() -> None:
    def body(model: nn.Module) -> None:
        model(torch.randn(2, 3)).sum().backward()

    always, replayed = both(sqrt_model, body)
    assert replayed.first.phase == "backward" and replayed.first.forward_op == "aten.sqrt.default"
    assert replayed.first.lineno == line("@bw-sqrt")
    assert_same(always, replayed)


def test_a_weight_gradient_overflow_is_found_by_the_check_of_the_weights_grad() -> None:
    """The first layer's input needs no gradient: only its weight's ``.grad`` shows the overflow."""
    def make() -> nn.Module:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        with torch.no_grad():
            model[1].weight.fill_(1e30)
            model[0].weight.fill_(1e-30)
        return model

    def body(model: nn.Module) -> None:
        x = torch.full((2, 4), 1e10)
        model(x).sum().backward()  # @bw-weight

    always, replayed = both(make, body)
    first = replayed.first
    assert (first.phase, first.op, first.aten_op, first.forward_module) == \
        ("backward", "AddmmBackward0", "aten.mm.default", "model.0")
    assert first.lineno == line("@bw-weight")  # a library module's op: the line that called the model
    assert_same(always, replayed)


class WhereTrap(nn.Module):
    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return torch.where(a > 0, torch.log(a), torch.zeros_like(a))  # @bw-where


def test_the_where_trap_inside_a_model_lists_the_thrown_away_log_as_the_always_on_watch() -> None:
    def body(model: nn.Module) -> None:
        a = torch.tensor([1.0, 0.0, 2.0], requires_grad=True)
        model(a).sum().backward()

    always, replayed = both(lambda: nn.Sequential(WhereTrap()), body)
    assert [e.op for e in replayed.absorbed] == ["aten.log.default"]
    assert replayed.first.lineno == line("@bw-where")
    assert_same(always, replayed)


class ZeroDivide(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad / (x - x)  # @bw-custom


class CustomInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ZeroDivide.apply(self.fc(x))


def test_a_custom_function_inside_a_model_points_at_the_users_backward_line() -> None:
    def body(model: nn.Module) -> None:
        model(torch.randn(2, 3)).sum().backward()

    always, replayed = both(CustomInside, body)
    assert replayed.first.lineno == line("@bw-custom") and replayed.first.cause == "user_backward"
    assert_same(always, replayed)


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inner = SqrtNorm()
        self.reentrant = reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=self.reentrant)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gives_the_always_on_report(reentrant: bool) -> None:
    """The forward runs again inside backward: the replay's backward recomputes it under the watch."""
    def body(model: nn.Module) -> None:
        model(torch.randn(2, 3, requires_grad=True)).sum().backward()

    always, replayed = both(lambda: Checkpointed(reentrant), body)
    assert replayed.first.phase == "backward"
    if not reentrant:  # (a reentrant checkpoint's recomputation makes new nodes: the backward's line)
        assert replayed.first.lineno == line("@bw-sqrt")
    assert_same(always, replayed)


@dataclasses.dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor


class WithLoss(nn.Module):
    """Hugging Face style: the loss is computed inside the model and returned with the logits."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.body, self.kind = SqrtNorm(), kind

    def forward(self, x: torch.Tensor) -> Any:
        logits = self.body(x)
        loss = logits.mean()
        if self.kind == "tuple":
            return loss, logits
        if self.kind == "dict":
            return {"logits": logits, "loss": loss}
        return Output(loss, logits)


@pytest.mark.parametrize("kind", ["tuple", "dict", "dataclass"])
def test_a_model_returning_its_loss_in_a_container_gives_the_always_on_report(kind: str) -> None:
    def body(model: nn.Module) -> None:
        out = model(torch.randn(2, 3))
        loss = out[0] if kind == "tuple" else out["loss"] if kind == "dict" else out.loss
        loss.backward()

    always, replayed = both(lambda: WithLoss(kind), body)
    assert replayed.first.forward_op == "aten.sqrt.default"
    assert_same(always, replayed)


def test_two_forwards_then_one_backward() -> None:
    def body(model: nn.Module) -> None:
        a = model(torch.randn(2, 3))
        b = model(torch.randn(2, 3))
        (a.sum() + b.sum()).backward()

    always, replayed = both(sqrt_model, body)
    assert_same(always, replayed)


def test_backward_with_retain_graph_twice() -> None:
    def body(model: nn.Module) -> None:
        loss = model(torch.randn(2, 3)).sum()
        loss.backward(retain_graph=True)
        loss.backward()

    always, replayed = both(sqrt_model, body)
    assert_same(always, replayed)


def test_autograd_grad_by_the_user_changes_no_grad_and_reads_as_the_always_on_watch() -> None:
    def body(model: nn.Module) -> None:
        grads = torch.autograd.grad(model(torch.randn(2, 3)).sum(), list(model.parameters()))
        assert all(p.grad is None for p in model.parameters()) and len(grads) == 4

    always, replayed = both(sqrt_model, body)
    assert_same(always, replayed)


class LossLog(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_a_backward_birth_in_the_loss_code_is_found_by_running_its_node_again() -> None:
    """The loss is outside the model: its node made a NaN gradient from a finite one."""
    def body(model: nn.Module) -> None:
        out = model(torch.randn(4, 3))
        x = out.abs() * 0
        x.sqrt().sum().backward()  # @bw-loss

    always, replayed = both(LossLog, body)
    assert replayed.first.op == "SqrtBackward0" and replayed.first.lineno == line("@bw-loss")
    assert replayed.first.module is None
    assert_same(always, replayed)


def test_the_replay_changes_no_grad_and_keeps_no_gradient_after_the_watch() -> None:
    refs: list[weakref.ref] = []
    grads = {}
    for replay in (False, True):
        torch.manual_seed(0)
        model = sqrt_model()
        with nanwatch(replay=replay) as report:
            out = model(torch.randn(2, 3))
            out.register_hook(lambda g: refs.append(weakref.ref(g)))
            out.sum().backward()
        assert report.events and report.first.forward_op == "aten.sqrt.default"
        grads[replay] = [p.grad.clone() for p in model.parameters()]
        del out
    for a, b in zip(grads[False], grads[True]):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())
    gc.collect()
    assert len(refs) == 2 and all(r() is None for r in refs)


def test_a_manual_weight_update_between_forward_and_backward_runs_that_backward_watched() -> None:
    """The weights the forward ran with are gone: no replay, so the backward runs under the per-op watch;
    its birth is the always-on watch's op, given the model call's module and line, with a note."""
    def body(model: nn.Module) -> None:
        out = model(torch.randn(2, 3))  # @manual-update-call
        with torch.no_grad():
            model[0].bias.add_(1.0)  # the bias is not saved for backward: autograd does not object
        out.sum().backward()
    always, replayed = both(sqrt_model, body)
    assert [e.title().split(" (line")[0] for e in replayed.events] == \
        [e.title().split(" (line")[0].replace(" in model.1", " in model") for e in always.events]
    assert [e.kind for e in replayed.events] == [e.kind for e in always.events]
    assert replayed.first.op == "SqrtBackward0" and replayed.first.lineno == line("@manual-update-call")
    assert any("weights were changed since the call" in note for note in replayed.summary.notes)


def test_a_user_error_in_a_models_backward_passes_through_and_nothing_stays_installed() -> None:
    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            raise ValueError("my backward failed")

    class Model(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Fails.apply(x * 2)

    x = torch.randn(3, requires_grad=True)
    for replay in (False, True):
        with pytest.raises(ValueError, match="my backward failed"):
            with nanwatch(replay=replay):
                Model()(x).sum().backward()
    assert compat.dispatch_stack_len() == 0 and compat.function_stack_len() == 0


def test_stop_during_a_models_backward_stops() -> None:
    class Stop(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            raise KeyboardInterrupt

    class Model(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Stop.apply(x * 2)

    with pytest.raises(KeyboardInterrupt):
        with nanwatch(replay=True):
            Model()(torch.randn(3, requires_grad=True)).sum().backward()
    assert compat.dispatch_stack_len() == 0 and compat.function_stack_len() == 0


def test_a_tensor_hook_in_the_loss_code_is_watched_as_the_users_backward_code() -> None:
    def body(model: nn.Module) -> None:
        out = model(torch.randn(2, 3))
        y = out * 3  # @bw-hooked
        y.register_hook(lambda g: g / 0.0)  # @bw-tensor-hook
        y.sum().backward()

    always, replayed = both(LossLog, body)
    assert replayed.first.lineno == line("@bw-tensor-hook") and replayed.first.forward_lineno == line("@bw-hooked")
    assert_same(always, replayed)


def test_a_hook_registered_after_an_optimizer_step_is_watched_as_by_the_always_on_watch() -> None:
    """After an optimizer step, a graph begun outside the model and a hook the user registers on it: the
    birth in the hook is named at the hook's line, with the forward line of the op, as ``replay=False`` does."""

    def body(model: nn.Module) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
        w = torch.ones(3, requires_grad=True)
        y = w * 3  # @bw-after-step
        y.register_hook(lambda g: g / 0.0)  # @bw-hook-after-step
        (model(torch.randn(2, 3)).sum() + y.sum()).backward()

    always, replayed = both(LossLog, body)
    first = replayed.first
    assert first.lineno == line("@bw-hook-after-step") and first.forward_lineno == line("@bw-after-step")
    assert_same(always, replayed)


class _Root(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x)


def test_a_weight_replaced_between_the_call_and_its_backward_is_seen_as_by_the_always_on_watch() -> None:
    """``load_state_dict(assign=True)`` after the forward puts new Parameter objects in the model: the
    replay check walks the model afresh, sees the weights changed since the call and does not replay
    with them (a replay with other weights would miss the birth): the birth is reported at the model
    call, and the note says why."""

    def body(model: nn.Module) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
        y = model(torch.randn(4, 3)).sum()
        model.load_state_dict({k: v.detach().clone() * -1.0 for k, v in model.state_dict().items()}, assign=True)
        y.backward()

    always, replayed = both(lambda: nn.Sequential(nn.Linear(3, 3), nn.ReLU(), _Root()), body)
    assert len(always.events) == len(replayed.events) == 2
    assert [(e.phase, e.op) for e in always.events] == [(e.phase, e.op) for e in replayed.events]
    assert any("its weights were changed since the call" in n for n in replayed.summary.notes)


def test_only_a_backward_with_a_non_finite_gradient_is_replayed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cheap checks only while every gradient is finite: no replay then; one for a birth."""
    replays: list[str] = []
    real = nanwatch_backward_calls.CallChecks._replay

    def counted(self: Any, region: Any) -> bool:
        replays.append(region.path)
        return real(self, region)

    monkeypatch.setattr(nanwatch_backward_calls.CallChecks, "_replay", counted)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanwatch(replay=True, namespace={"model": model}) as report:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 4)).pow(2).mean().backward()
            opt.step()
    assert not report.events and replays == []
    bad = sqrt_model()
    with nanwatch(replay=True, namespace={"bad": bad}) as report:
        bad(torch.randn(2, 3)).sum().backward()
    assert report.first.forward_op == "aten.sqrt.default" and replays == ["bad"]


class EmbedOutside(nn.Module):
    """Its embedding is called outside the model's own call: two model calls, the birth in the later one."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 3)
        self.body = sqrt_model()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.body(h)


def test_a_birth_in_a_later_model_call_is_not_blamed_on_the_call_that_fed_it() -> None:
    def body(model: nn.Module) -> None:
        h = model.emb(torch.tensor([1, 2]))
        model(h).sum().backward()

    always, replayed = both(EmbedOutside, body)
    assert replayed.first.module == "model.body.1" and not replayed.summary.notes
    assert_same(always, replayed)


@pytest.mark.parametrize("case", ["output used twice", "grad scaler", "nan gradient", "lbfgs"])
def test_more_training_loops_give_the_always_on_report(case: str) -> None:
    def make() -> nn.Module:
        return sqrt_model() if case in ("output used twice", "lbfgs") else nn.Sequential(nn.Linear(3, 3),
                                                                                        nn.Linear(3, 1))

    def body(model: nn.Module) -> None:
        if case == "output used twice":
            out = model(torch.randn(2, 3))
            (out.sum() + out.pow(2).sum()).backward()
        elif case == "grad scaler":  # the scale overflows the gradients: births GradScaler then skips
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 126)
            for _ in range(2):
                opt.zero_grad()
                scaler.scale(model(torch.randn(2, 3)).pow(2).sum() * 1e6).backward()
                scaler.step(opt)
                scaler.update()
        elif case == "nan gradient":  # the user's own gradient holds the NaN
            out = model(torch.randn(2, 3))
            out.backward(torch.full_like(out, float("nan")))
        else:
            opt = torch.optim.LBFGS(model.parameters(), max_iter=2)

            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = model(torch.randn(2, 3)).sum()
                loss.backward()
                return loss

            opt.step(closure)

    always, replayed = both(make, body)
    if case == "nan gradient":
        assert [e.title() for e in replayed.events] == [e.title() for e in always.events]
        assert not [n for n in replayed.summary.notes if "replay" in n]
        return
    assert_same(always, replayed)


@pytest.mark.parametrize("came_bad, came_nan, made_nan, had_events, expected", [
    (False, False, False, True, True),   # finite gradients in, non-finite out: a birth
    (True, False, False, False, True),   # nothing reported yet: maybe input data
    (True, False, True, True, True),     # infinities in, a NaN out (inf - inf): a birth
    (True, True, True, True, False),     # a NaN in, a NaN out: propagation
    (True, False, False, True, False),   # infinities in and out: propagation
])
def test_which_non_finite_gradients_are_worth_running_again(came_bad: bool, came_nan: bool, made_nan: bool,
                                                            had_events: bool, expected: bool) -> None:
    assert nanwatch_backward.may_hold_birth(came_bad, came_nan, made_nan, had_events) is expected


def test_a_weight_gradient_accumulating_to_inf_without_zero_grad_reads_as_the_always_on_watch() -> None:
    """The classic forgotten ``zero_grad``: each backward's gradient is finite, their sum in ``.grad`` is not."""
    def make() -> nn.Module:
        model = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(1.0)
        return model

    def body(model: nn.Module) -> None:
        for _ in range(3):
            (model(torch.ones(1, 1)) * 2e38).sum().backward()  # @bw-accumulate

    always, replayed = both(make, body)
    first = replayed.first
    assert (first.op, first.aten_op, first.iteration) == ("torch::autograd::AccumulateGrad", "aten.add_.Tensor", 2)
    assert first.lineno == line("@bw-accumulate") and "zero_grad" in first.hint
    assert_same(always, replayed)


# -- issue 11: what the unwatched backward got wrong, each against the always-on watch --------------
class Gate(nn.Module):
    """Called twice per step (siamese): only the call given ``zero`` can make a birth."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(self.fc(x) * 0 + zero).sum(-1)  # @bw-gate


@pytest.mark.parametrize("bad_first", [True, False])
def test_a_model_called_twice_blames_only_the_call_whose_backward_made_the_birth(bad_first: bool) -> None:
    def body(model: nn.Module) -> None:
        zs = (torch.zeros(2, 3), torch.ones(2, 3)) if bad_first else (torch.ones(2, 3), torch.zeros(2, 3))
        a, b = (model(torch.randn(2, 3), z) for z in zs)
        (a.sum() + b.sum()).backward()

    always, replayed = both(Gate, body)
    assert not [e for e in replayed.events if e.op.startswith("gradient into")]
    assert replayed.first.forward_lineno == line("@bw-gate")
    assert_same(always, replayed)


class Cell(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, h: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(self.fc(h) * 0 + z) + h  # @bw-in-cell


@pytest.mark.parametrize("calls", [4, 12])
def test_a_cell_called_in_a_loop_names_the_birth_in_its_first_call(calls: int) -> None:
    """Four calls: replayed as the always-on watch; twelve (more than are kept before one backward):
    that backward runs watched, its birth named with the module and the call's line."""
    def body(model: nn.Module) -> None:
        h = torch.randn(2, 3)
        for i in range(calls):
            h = model(h, torch.zeros(2, 3) if i == 0 else torch.ones(2, 3))  # @bw-loop-call
        h.sum().backward()

    always, replayed = both(Cell, body)
    if calls == 4:
        assert_same(always, replayed)
        return
    assert [(e.op, e.kind, e.aten_op, e.module) for e in replayed.events] == \
        [(e.op, e.kind, e.aten_op, e.module) for e in always.events]
    assert replayed.first.lineno == line("@bw-loop-call") and always.first.lineno == line("@bw-in-cell")
    assert any("more model calls than are kept" in n for n in replayed.summary.notes)


class SharedWeights(nn.Module):
    """Two models sharing a layer: both accumulate into the same ``.grad`` in one backward."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(3, 3)
        self.a = nn.Sequential(shared, SqrtNorm())
        self.b = nn.Sequential(shared, nn.Linear(3, 1))


@pytest.mark.parametrize("bad_first", [True, False])
def test_weights_shared_by_two_models_give_no_made_up_accumulation_overflow(bad_first: bool) -> None:
    def body(model: nn.Module) -> None:
        x = torch.randn(2, 3)
        first, second = (model.a, model.b) if bad_first else (model.b, model.a)
        (first(x).sum() + second(x).sum()).backward()

    always, replayed = both(SharedWeights, body)
    assert not [e for e in replayed.events if e.op == "torch::autograd::AccumulateGrad"]
    assert_same(always, replayed)


def test_gradient_accumulation_with_the_birth_in_a_middle_micro_batch() -> None:
    def body(model: nn.Module) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.zero_grad()
        for z in (1.0, 0.0, 1.0):  # the birth in micro-batch 2; micro-batch 3 adds to a non-finite .grad
            (model(torch.randn(2, 3), torch.full((2, 3), z)).sum() / 3).backward()
        opt.step()

    always, replayed = both(Gate, body)
    assert replayed.first.iteration == 2 and replayed.first.op == "SqrtBackward0"
    assert_same(always, replayed)


def lin() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))


@pytest.mark.parametrize("when", ["before the watch", "inside the watch"])
@pytest.mark.parametrize("kind", ["tensor hook", "post-accumulate hook"])
def test_a_hook_on_the_weights_reports_each_birth_once_as_the_always_on_watch(when: str, kind: str) -> None:
    def divide(p: torch.Tensor) -> None:
        p.grad.div_((p.grad * 0).sum())

    def hook(model: nn.Module) -> None:
        for p in model.parameters():
            if kind == "tensor hook":
                p.register_hook(lambda g: g / (g * 0).sum())
            else:
                p.register_post_accumulate_grad_hook(divide)

    def make() -> nn.Module:
        model = lin()
        if when == "before the watch":
            hook(model)
        return model

    def body(model: nn.Module) -> None:
        if when == "inside the watch":
            hook(model)
        model(torch.randn(2, 3)).sum().backward()

    always, replayed = both(make, body)
    assert len(replayed.events) == 4 and all(e.cause == "user_backward" for e in replayed.events)
    assert_same(always, replayed)


def test_saved_tensor_hooks_at_the_call_give_the_always_on_report() -> None:
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t.log() if t.dim() == 2 and t.shape[1] == 3 else t  # @bw-unpack

    def body(model: nn.Module) -> None:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
            out = model(-torch.ones(2, 3))
        out.sum().backward()

    always, replayed = both(lin, body)
    assert replayed.first.aten_op == "aten.log.default" and replayed.first.module == "model.1"
    assert_same(always, replayed)


class Noisy(torch.autograd.Function):
    """A custom Function outside the models whose backward draws random numbers and counts its runs."""

    runs = 0

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        Noisy.runs += 1
        return g * torch.rand(()) / 0.0  # @bw-noisy


def test_a_custom_function_outside_the_models_runs_its_backward_once_and_keeps_the_random_stream() -> None:
    def body(model: nn.Module) -> None:
        Noisy.apply(model(torch.randn(2, 3))).sum().backward()
        model.drawn = torch.rand(2).tolist()  # type: ignore[assignment]

    runs, drawn = [], []
    reports = []
    for replay in (False, True):
        torch.manual_seed(0)
        model = lin()
        Noisy.runs = 0
        with nanwatch(replay=replay, namespace={"model": model}) as report:
            body(model)
        runs.append(Noisy.runs)
        drawn.append(model.drawn)
        reports.append(report)
    assert runs == [1, 1] and drawn[0] == drawn[1]
    assert reports[1].first.lineno == line("@bw-noisy")
    assert_same(*reports)


def test_a_node_hook_outside_the_models_that_makes_the_gradient_non_finite_is_noted() -> None:
    """A hook on an autograd node cannot be seen before the engine runs: its birth is not found op by op
    with replay=True, and the report says so (the always-on watch reports the hook's division)."""
    def body(model: nn.Module) -> None:
        y = model(torch.randn(2, 3)) * 3
        y.grad_fn.register_hook(lambda gi, go: tuple(g / 0.0 if g is not None else None for g in gi))
        y.sum().backward()

    always, replayed = both(lin, body)
    assert any(e.cause == "user_backward" and e.aten_op == "aten.div.Tensor" for e in always.events)
    assert nanwatch_backward.NODE_HOOK in replayed.summary.notes
    assert not [n for n in always.summary.notes if n == nanwatch_backward.NODE_HOOK]


def test_a_tensor_hook_registered_in_the_watch_is_the_users_function_again_after_it() -> None:
    calls: list[int] = []

    def user_hook(g: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return g * 10

    model = lin()
    x = torch.randn(2, 3, requires_grad=True)
    with nanwatch(replay=True, namespace={"model": model}):
        y = model(x) * 1
        handle = y.register_hook(user_hook)
        y.sum().backward(retain_graph=True)
    assert list(y._backward_hooks.values()) == [user_hook] and calls == [1]
    y.sum().backward()
    handle.remove()
    assert calls == [1, 1] and not y._backward_hooks
    gc.collect()


class ScalesItsArgument(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)  # changes its argument in place: the forward cannot be replayed
        return torch.sqrt(self.fc(x) * 0).sum()


class Captured(nn.Module):
    """A model with a forward hook of its own (activation capture): its forward cannot be replayed."""

    def __init__(self) -> None:
        super().__init__()
        self.body = sqrt_model()
        self.seen: list[tuple[int, ...]] = []
        self.body[1].register_forward_hook(lambda m, i, o: self.seen.append(tuple(o.shape)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


@pytest.mark.parametrize("make, why", [(ScalesItsArgument, "its arguments were changed in place"),
                                       (Captured, "it has hooks of its own")])
def test_a_model_that_cannot_be_replayed_has_its_backward_watched_op_by_op(make: Any, why: str) -> None:
    """Not a module-level guess: the always-on watch's op and kind, with the model call's module and
    line (its forward op cannot be named without a replay) and a note saying why."""
    def body(model: nn.Module) -> None:
        model(torch.randn(2, 3)).sum().backward()  # @bw-unreplayable

    always, replayed = both(make, body)
    assert [(e.op, e.kind, e.aten_op) for e in replayed.events] == [(e.op, e.kind, e.aten_op) for e in always.events]
    assert replayed.first.op == "SqrtBackward0" and replayed.first.module == "model"
    assert replayed.first.lineno == line("@bw-unreplayable")
    notes = [n for n in replayed.summary.notes if why in n]
    assert notes and "after the call" not in notes[0]


def test_an_internal_error_repeated_on_every_node_is_noted_once() -> None:
    """A check that cannot run under vmap fails on every node it is asked about: one note, not three."""
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(x * 0).sum()

    with nanwatch(replay=True) as report:
        torch.vmap(torch.func.grad(f))(torch.randn(4, 3))
    errors = [n for n in report.summary.notes if n.startswith("could not check")]
    assert len(errors) == len(set(errors)) == 1


class Masked(nn.Module):
    """``sqrt`` after a masking op: sqrt's gradient is infinite exactly where the mask gave 0, and the
    masking op's backward zeroes exactly those positions (every gradient the module checks see is finite)."""

    def __init__(self, mask: str) -> None:
        super().__init__()
        self.fc, self.mask = nn.Linear(4, 4), mask

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.mask == "relu":
            return torch.sqrt(torch.relu(h))  # @bw-absorbed-relu
        if self.mask == "clamp":
            return torch.sqrt(h.clamp(min=0.0))  # @bw-absorbed-clamp
        return torch.sqrt(h.masked_fill(h < 0, 0.0))  # @bw-absorbed-masked_fill


@pytest.mark.parametrize("mask", ["relu", "clamp", "masked_fill"])
def test_a_backward_birth_that_a_later_backward_op_zeroes_reads_as_the_always_on_watch(mask: str) -> None:
    """The course's example: the Inf that SqrtBackward0 makes is thrown away by the masking op's
    backward; the default watch still names it, as the always-on watch does."""
    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4), Masked(mask), nn.Linear(4, 1))

    def body(model: nn.Module) -> None:
        model(torch.randn(8, 4)).sum().backward()

    always, replayed = both(make, body)
    assert always.first.op == "SqrtBackward0" and always.first.kind == "inf"
    assert replayed.first.forward_op == "aten.sqrt.default" and replayed.first.module == "model.1"
    assert replayed.first.forward_lineno == line(f"@bw-absorbed-{mask}")
    assert_same(always, replayed)
    for p in (always, replayed):
        assert p.events[0].input_op is not None


def test_a_finite_step_puts_one_pre_hook_per_masking_node_and_replays_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check of the thrown-away gradients costs a pre hook on each masking node of the model calls
    (here two ReLUs), none on the other nodes, and no replay while every gradient is finite."""
    made: list[str] = []
    replays: list[str] = []

    class Counted(nanwatch_backward.Absorber):
        __slots__ = ()

        def __init__(self, watch: Any, region: Any) -> None:
            made.append(region.path)
            super().__init__(watch, region)

    real = nanwatch_backward_calls.CallChecks._replay

    def counted(self: Any, region: Any) -> bool:
        replays.append(region.path)
        return real(self, region)

    monkeypatch.setattr(nanwatch_backward, "Absorber", Counted)
    monkeypatch.setattr(nanwatch_backward_calls.CallChecks, "_replay", counted)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanwatch(replay=True, namespace={"model": model}) as report:
        for _ in range(3):
            opt.zero_grad()
            torch.relu(model(torch.randn(8, 4))).mean().backward()  # (a ReLU outside the model: no pre hook)
            opt.step()
    assert not report.events and replays == []
    assert made == ["model"] * 6


class PaddedLookup(nn.Module):
    """``F.embedding`` with a padding row of zeros inside the call: sqrt's infinite gradient at the padded
    positions is dropped by the embedding's backward (its ``padding_idx`` row gets none)."""

    def __init__(self) -> None:
        super().__init__()
        table = torch.rand(10, 4) + 0.5
        table[0] = 0.0
        self.table = nn.Parameter(table)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(F.embedding(idx, self.table, padding_idx=0)).sum(-1)  # @bw-absorbed-padding


def test_a_backward_birth_dropped_by_an_embeddings_padding_row_reads_as_the_always_on_watch() -> None:
    def body(model: nn.Module) -> None:
        model(torch.tensor([[1, 0, 2], [0, 3, 4]])).sum().backward()

    always, replayed = both(PaddedLookup, body)
    assert always.first.op == "SqrtBackward0" and replayed.first.forward_lineno == line("@bw-absorbed-padding")
    assert_same(always, replayed)


def test_a_finite_backward_asks_no_weight_without_hooks_for_its_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before each backward the replay check asks whether the model's weights have hooks of the user's: a
    weight that never had one is passed over without reading its hook dicts one by one (``leaf_hooks``)."""
    asked: list[torch.Tensor] = []
    real = compat.leaf_hooks

    def counted(tensor: torch.Tensor, own: tuple = ()) -> bool:
        asked.append(tensor)
        return real(tensor, own)

    monkeypatch.setattr(compat, "leaf_hooks", counted)
    torch.manual_seed(0)
    model = lin()
    hooked = model[1].bias
    with nanwatch(replay=True, namespace={"model": model}) as report:
        for _ in range(2):
            model(torch.randn(2, 3)).sum().backward()
        hooked.register_hook(lambda g: g).remove()  # (an empty hook dict: asked, and found without hooks)
        model(torch.randn(2, 3)).sum().backward()
    assert not report.events and not report.summary.notes
    assert len(asked) == 1 and asked[0] is hooked


def test_a_weight_hook_added_then_removed_leaves_the_backward_replayed() -> None:
    def make() -> nn.Module:
        model = sqrt_model()
        model[0].weight.register_hook(lambda g: g).remove()
        return model

    def body(model: nn.Module) -> None:
        model(torch.randn(2, 3)).sum().backward()

    always, replayed = both(make, body)
    assert replayed.first.forward_op == "aten.sqrt.default" and replayed.first.module == "model.1"
    assert not [n for n in replayed.summary.notes if "watched op by op" in n]
    assert_same(always, replayed)


class CubicTanh(nn.Module):
    """GELU's tanh form: ``pow`` overflows to Inf, ``tanh`` turns it into 1 (the output stays finite), and
    the backward of ``pow`` makes the NaN (Inf times 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x + 0.044715 * torch.pow(x, 3.0))  # @bw-cubic


def test_an_inf_born_and_squashed_inside_a_module_is_the_birth_its_nan_gradient_comes_from() -> None:
    """The module's output is finite, so the check at the model's exit sees nothing; the NaN gradient
    makes the backward replay run the forward again, which finds the forward birth: reported as the
    always-on watch reports it (the optimizer step that then writes NaN weights is not the birth)."""

    def make() -> nn.Module:
        model = nn.Sequential(nn.Linear(4, 4), CubicTanh(), nn.Linear(4, 1))
        with torch.no_grad():
            model[0].weight.mul_(1e20)
        return model

    def body(model: nn.Module) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        model(torch.randn(8, 4)).sum().backward()
        opt.step()

    always, replayed = both(make, body)
    assert (replayed.first.phase, replayed.first.op, replayed.first.module, replayed.first.lineno) == \
        ("forward", "aten.pow.Tensor_Scalar", "model.1", line("@bw-cubic"))
    assert_same(always, replayed)
