"""nanwatch options, the deferred (GPU-style) path on CPU, module mode, cleanup and memory."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from torch_nbdebug.api.nanwatch import nanwatch
from torch_nbdebug.data.nanwatch import NanEvent
from torch_nbdebug.errors import InputError, NanBirthError
from nanwatch_paths import marker_line, watch_kind  # noqa: F401 - every test under both op-mode watches
from torch_nbdebug.record.modules import global_hook_counts

from test_nanwatch import CausalAttention, SqrtNorm, check_path, make_model  # noqa: F401 - both paths
from test_nanwatch import line as main_line

SRC = open(__file__).read().splitlines()


def line(marker: str) -> int:
    return marker_line(SRC, marker)


def _sqrt_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 3), SqrtNorm())
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
    return model


# -- --raise ---------------------------------------------------------------------------------------
def test_raise_on_birth_stops_at_the_birth_line_and_keeps_the_report() -> None:
    x = torch.tensor([1.0, -1.0])
    ran_after = False
    with pytest.raises(NanBirthError) as info:
        with nanwatch(raise_on_birth=True) as report:
            y = torch.log(x)  # @raise-here
            ran_after = True
    err = info.value
    assert not ran_after
    assert err.event.lineno == line("# @raise-here") and err.event.op == "aten.log.default"
    assert f"line {line('# @raise-here')}" in str(err) and "torch.log(x)" in str(err)
    assert err.report is report and report.first == err.event
    assert "why/fix: log of a negative" in str(err)


# -- phase switches and ignore_inf -------------------------------------------------------------------
def test_no_backward_does_not_watch_the_backward_pass() -> None:
    model = _sqrt_model()
    with nanwatch(backward=False) as report:
        model(torch.randn(2, 3)).sum().backward()
    assert report.events == ()
    assert any("backward" in n for n in report.notes)


def test_no_optimizer_does_not_watch_steps() -> None:
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e38)
    with nanwatch(optimizer=False) as report:
        for _ in range(3):
            opt.zero_grad()
            model(torch.full((4, 2), 5.0)).sum().backward()
            opt.step()
    assert all(e.phase != "optimizer" for e in report.events)


def test_ignore_inf_reports_nan_only() -> None:
    x = torch.full((3,), 100.0)
    with nanwatch(ignore_inf=True) as report:
        y = torch.exp(x)
        z = torch.log(-x)  # @nan-only
    assert [(e.kind, e.lineno) for e in report.events] == [("nan", line("# @nan-only"))]


def test_iteration_of_a_forward_birth_in_a_loop() -> None:
    model = nn.Linear(2, 2)
    batches = [torch.ones(1, 2), torch.ones(1, 2), torch.full((1, 2), -5.0)]
    with nanwatch() as report:
        for xb in batches:
            out = model(xb) * torch.sqrt(xb + 3.0)  # @loop-birth
            out.sum().backward()
    assert report.first.iteration == 3 and report.first.lineno == line("# @loop-birth")


def test_a_birth_is_numbered_on_the_one_step_axis_of_every_tool() -> None:
    """Issue 28: a NaN made at the loop's ``step == 2`` (two optimizer steps before it) reads "step 2" in the
    report, its text, its JSON and its optimizer births, as %%monitor and %%grads number the same loop."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch() as report:
        for step in range(4):
            xb = torch.full((1, 2), -5.0) if step == 2 else torch.ones(1, 2)
            out = model(xb) * torch.sqrt(xb + 3.0)  # @step-birth
            opt.zero_grad()
            out.sum().backward()
            opt.step()
    first = report.first
    assert (first.phase, first.step, first.lineno) == ("forward", 2, line("# @step-birth"))
    assert first.to_dict()["step"] == 2 and "forward, step 2" in report.html()
    fifth = NanEvent(phase="optimizer", op="SGD.step", kind="inf", iteration=5, param="model.weight")
    assert fifth.step == 4 and "born in optimizer step 4" in fifth.title()  # the 5th step: 4 before it


# -- the deferred path (what CUDA uses), exercised on CPU ---------------------------------------------
def test_deferred_flags_find_the_same_forward_birth() -> None:
    model = make_model()
    with nanwatch(defer=True) as report:
        model(torch.randn(8, 4)).sum().backward()
    first = report.first
    assert (first.phase, first.op, first.module, first.kind) == ("forward", "aten.log.default", "model.1", "nan")
    assert first.deferred and first.lineno == main_line("# @log-birth")
    assert [layer.module for layer in report.layers if layer.birth] == ["model.1"]


def test_deferred_flags_find_backward_and_input_births() -> None:
    model = _sqrt_model()
    with nanwatch(defer=True) as report:
        model(torch.randn(2, 3)).sum().backward()
    assert (report.first.phase, report.first.op, report.first.forward_op) == ("backward", "SqrtBackward0", "aten.sqrt.default")
    x = torch.randn(8, 4)
    x[0, 0] = float("inf")
    model = make_model()
    with nanwatch(defer=True) as report:
        model(x)
    assert (report.first.phase, report.first.module) == ("input", "model.0")


def test_deferred_masked_attention_is_quiet() -> None:
    with nanwatch(defer=True) as report:
        CausalAttention()(torch.randn(2, 4, 8)).sum().backward()
    assert report.events == ()


# -- module mode --------------------------------------------------------------------------------------
def test_module_mode_names_the_innermost_module() -> None:
    model = make_model()
    with nanwatch(mode="module") as report:
        model(torch.randn(8, 4)).sum().backward()
    first = report.first
    assert (first.phase, first.module, first.kind) == ("forward", "model.1", "nan")
    assert "LogBlock" in first.op and len(report.events) == 1
    assert any("module-level" in n for n in report.notes)


def test_module_mode_input_and_optimizer() -> None:
    x = torch.randn(8, 4)
    x[1, 1] = float("nan")
    model = make_model()
    with nanwatch(mode="module") as report:
        model(x)
    assert (report.first.phase, report.first.module) == ("input", "model.0")
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e38)
    with nanwatch(mode="module") as report:
        for _ in range(2):
            opt.zero_grad()
            model(torch.full((8, 4), 2.0)).sum().backward()
            opt.step()
    assert report.first.phase == "optimizer" and report.first.param == "model.weight"


# -- cleanup, memory and bad input -------------------------------------------------------------------
@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_everything_removed_after_an_exception(exc: BaseException) -> None:
    before = global_hook_counts()
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(type(exc)) as info:
        with nanwatch() as report:
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            raise exc
    assert info.value is exc  # re-raised unchanged
    assert global_hook_counts() == before and torch.is_grad_enabled()
    assert report.first is not None and report.first.op == "aten.log.default"
    assert any(type(exc).__name__ in n for n in report.notes)
    # The parametrized exception outlives the test: its traceback would keep this test's frames, and so
    # the model's tensors, alive for the rest of the session (a later memory test lists live tensors).
    exc.__traceback__ = None


def test_exception_inside_optimizer_step_restores_the_mode_stack() -> None:
    class Broken(torch.optim.SGD):
        def step(self, closure=None):  # type: ignore[override]
            raise ValueError("bad step")

    model = nn.Linear(2, 1)
    opt = Broken(model.parameters(), lr=0.1)
    before = global_hook_counts()
    with pytest.raises(ValueError):
        with nanwatch():
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
    assert global_hook_counts() == before


def test_no_tensor_is_kept_alive() -> None:
    model = make_model()
    with nanwatch() as report:
        x = torch.randn(8, 4, requires_grad=True)
        out = model(x)
        out.sum().backward()
    refs = [weakref.ref(t) for t in (x, out, x.grad)]
    del x, out
    model.zero_grad(set_to_none=True)
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    assert report.first is not None  # the report survives: statistics only


def test_bad_arguments_raise_input_error() -> None:
    with pytest.raises(InputError, match="mode must be"):
        nanwatch(mode="fast")
    with pytest.raises(InputError, match="max_events"):
        nanwatch(max_events=0)
    with pytest.raises(InputError, match="namespace"):
        nanwatch(namespace=[1, 2])  # type: ignore[arg-type]


def test_code_without_torch_gets_a_note() -> None:
    with nanwatch() as report:
        total = sum(range(10))
    assert report.events == () and any("no torch operations" in n for n in report.notes)


def test_max_events_caps_the_list() -> None:
    with nanwatch(max_events=2) as report:
        for _ in range(4):
            torch.log(torch.tensor([-1.0]))
    assert len(report.events) == 2
    assert any("first 2 births" in n for n in report.notes)


def test_deferred_module_mode() -> None:
    model = make_model()
    with nanwatch(mode="module", defer=True) as report:
        model(torch.randn(8, 4)).sum().backward()
    assert (report.first.phase, report.first.module, report.first.deferred) == ("forward", "model.1", True)
    assert len(report.events) == 1
    x = torch.randn(8, 4)
    x[0, 0] = float("nan")
    with nanwatch(mode="module", defer=True) as report:
        model(x)
    assert [(e.phase, e.module) for e in report.events] == [("input", "model.0")]


def test_deferred_raise_happens_at_the_birth() -> None:
    """With raise_on_birth the deferred path reads each check at once (raising later would run on)."""
    model = make_model()
    before = global_hook_counts()
    reached = []
    with pytest.raises(NanBirthError) as info:
        with nanwatch(defer=True, raise_on_birth=True):
            out = model(torch.randn(8, 4))  # raises inside, at the log
            reached.append(out)
    assert reached == []
    assert info.value.event.op == "aten.log.default" and info.value.event.module == "model.1"
    assert info.value.event.lineno == main_line("# @log-birth") and "why/fix" in str(info.value)
    assert global_hook_counts() == before


def test_deferred_where_trap_still_reports_the_backward_birth() -> None:
    x = torch.tensor([0.0, 1.0], requires_grad=True)
    with nanwatch(defer=True) as report:
        y = torch.where(x > 0, torch.log(x), torch.zeros_like(x))  # @deferred-where
        y.sum().backward()
    ops_seen = [(e.phase, e.op) for e in report.events]
    assert ("backward", "LogBackward0") in ops_seen
    assert all(e.lineno == line("# @deferred-where") for e in report.events)


def test_a_step_of_several_passes_is_one_step() -> None:
    """Gradient accumulation: two forward/backward passes an optimizer step. A NaN made in the second pass
    of the third step (two steps completed before it) is step 2, as %%monitor and %%grads count it."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch() as report:
        for step in range(4):
            opt.zero_grad()
            for micro in range(2):
                xb = torch.full((1, 2), -5.0) if (step, micro) == (2, 1) else torch.ones(1, 2)
                (model(xb) * torch.sqrt(xb + 3.0)).sum().backward()  # @accumulated
            opt.step()
    first = report.first
    assert (first.phase, first.iteration, first.step) == ("forward", 6, 2)
    assert first.lineno == line("# @accumulated") and first.to_dict()["step"] == 2
