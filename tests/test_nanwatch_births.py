"""The birth rules, the event log and the cause rules on hand-built inputs (no tensors, no recorder)."""
from __future__ import annotations

import pytest

from torch_nbdebug.data.nanwatch import NanEvent
from torch_nbdebug.data.stats import TensorStats
from torch_nbdebug.errors import NanBirthError
from torch_nbdebug.process.nanwatch import cause_of, hint
from torch_nbdebug.record.nanwatch.core.rules import (InputFact, OpFacts, is_mask, judge, judge_absorb, judge_gradient,
                                                  judge_module, keeps_backward_birth)
from torch_nbdebug.record.nanwatch.core.log import EventLog

FINE = InputFact(bad=False, nan=False, neg_inf_only=False, external=False, from_absorbed=False)
NAN_DATA = InputFact(bad=True, nan=True, neg_inf_only=False, external=True, from_absorbed=False)
INF_MADE = InputFact(bad=True, nan=False, neg_inf_only=False, external=False, from_absorbed=False)
NAN_MADE = InputFact(bad=True, nan=True, neg_inf_only=False, external=False, from_absorbed=False)
MASK = InputFact(bad=True, nan=False, neg_inf_only=True, external=True, from_absorbed=False)
THROWN = InputFact(bad=True, nan=True, neg_inf_only=False, external=False, from_absorbed=True)


@pytest.mark.parametrize("phase,out_nan,inputs,had,verdict", [
    ("forward", True, (FINE, FINE), False, "birth"),  # finite inputs made it
    ("backward", False, (FINE,), True, "birth"),  # even after other births
    ("forward", True, (NAN_DATA, FINE), False, "input"),  # data from outside
    ("forward", True, (NAN_DATA,), True, "propagation"),  # after a birth: it came from there
    ("forward", False, (MASK, FINE), False, "propagation"),  # an additive -inf mask is intentional
    ("forward", True, (MASK, FINE), False, "input"),  # ... unless NaN comes out of it
    ("forward", True, (NAN_MADE,), False, "input"),  # a NaN no watched op made: never silent
    ("backward", True, (NAN_MADE,), False, "propagation"),  # (forward only)
    ("forward", True, (INF_MADE, FINE), True, "birth"),  # inf - inf, 0 * inf
    ("forward", False, (INF_MADE,), True, "propagation"),
    ("backward", True, (THROWN, FINE), True, "birth"),  # the where trap
    ("forward", True, (THROWN,), True, "propagation"),
])
def test_judge(phase: str, out_nan: bool, inputs: tuple, had: bool, verdict: str) -> None:
    assert judge(OpFacts(phase, out_nan, inputs, had)) == verdict  # type: ignore[arg-type]


def test_mask_needs_only_minus_inf_and_no_nan_out() -> None:
    assert is_mask([MASK, MASK], out_nan=False)
    assert not is_mask([MASK, NAN_DATA], out_nan=False) and not is_mask([MASK], out_nan=True)


def test_absorb_module_gradient_and_held_rules() -> None:
    assert judge_absorb(False, [True, False], [True, True], [False, False]) == (True, False)
    assert judge_absorb(False, [True], [False], [True]) == (True,)  # y.masked_fill_: overwritten
    assert judge_absorb(False, [True], [False], [False]) == (False,)  # the born value was not an input value
    assert judge_absorb(True, [True], [True], [False]) == (False,)  # the output is still bad
    assert judge_module(True, False, False, False, False) == "birth"
    assert judge_module(True, False, True, False, False) == "input"
    assert judge_module(True, True, False, True, False) == "propagation"
    assert judge_module(True, False, False, False, True) == "propagation"
    assert judge_gradient(False) == "birth" and judge_gradient(True) == "propagation"
    assert keeps_backward_birth([]) and keeps_backward_birth([False, True]) and not keeps_backward_birth([False])


def _event(phase: str = "forward", **kw: object) -> NanEvent:
    op, kind = kw.pop("op", "aten.log.default"), kw.pop("kind", "nan")
    return NanEvent(phase=phase, op=op, kind=kind, **kw)  # type: ignore[arg-type]


def test_log_owns_dedupe_absorption_holding_and_raising() -> None:
    log = EventLog(max_events=3, raise_on_birth=False)
    log.add(_event(sequence_nr=7), [100])
    log.add(_event("backward", op="LogBackward0", sequence_nr=7))  # the gradient of a reported birth
    assert len(log.events) == 1 and log.is_born(100)
    log.absorb([100], [True])
    assert log.absorbed == {0} and log.from_absorbed(100)
    log.add(_event("backward", op="LogBackward0", sequence_nr=7))  # now it is the where trap
    assert [e.phase for e in log.events] == ["forward", "backward"]
    log.propagated([100])
    assert log.absorbed == set()
    assert log.hold(1, _event("backward")) and not log.hold(1, _event("backward"))
    log.node_done(1, [False])  # masked inside the node
    assert len(log.events) == 2
    log.hold(2, _event("backward"))
    log.node_done(2, [True])
    assert len(log.events) == 3 and log.full()
    log.add(_event())
    assert log.dropped == 1
    raising = EventLog(max_events=5, raise_on_birth=True)
    raising.hold(3, _event("backward"))
    raising.commit_held()  # stopping never raises
    with pytest.raises(NanBirthError):
        raising.add(_event())


def test_the_log_answers_what_a_check_added_and_rewrites_in_place() -> None:
    log = EventLog(max_events=10, raise_on_birth=False)
    log.add(_event(op="aten.div.Tensor"))
    mark = log.mark()
    assert log.since(mark) == []
    log.add(_event(op="aten.log.default"))
    assert [e.op for e in log.since(mark)] == ["aten.log.default"]
    log.rewrite(1, _event(op="aten.log.default", lineno=12))
    assert [e.lineno for e in log.events] == [None, 12] and [e.lineno for e in log.since(0)] == [None, 12]


def test_births_held_while_a_node_runs_again_are_decided_when_it_returns() -> None:
    """A node run again from its own hook (replay's backward): no hook is asked for the births it holds,
    and they are kept or dropped by the gradients that left the node the first time."""
    log = EventLog(max_events=10, raise_on_birth=False)
    with log.rerunning([True]):
        assert not log.hold(5, _event("backward", op="SqrtBackward0"))  # no hook: decided here
        assert log.events == []
    assert [e.op for e in log.events] == ["SqrtBackward0"] and not log.is_held(5)
    with log.rerunning([False]):  # masked inside the node: not a birth
        log.hold(6, _event("backward"))
    assert len(log.events) == 1 and not log.is_held(6)
    assert log.hold(7, _event("backward"))  # outside a rerun: its node needs a hook
    with pytest.raises(RuntimeError), log.rerunning([True]):  # the rerun raised: held until the end
        log.hold(8, _event("backward"))
        raise RuntimeError
    assert log.is_held(8) and len(log.events) == 1


def test_scaler_skip_moves_backward_births_to_absorbed_with_a_cause() -> None:
    log = EventLog(max_events=10, raise_on_birth=False)
    log.add(_event())
    log.add(_event("backward", op="MulBackward0"))
    log.scaler_skipped(1)
    assert log.absorbed == {1} and log.events[1].cause == "grad_scaler_skip" and log.scaler_skips == {1}


def _stats(**kw: object) -> TensorStats:
    dtype = str(kw.pop("dtype", "float32"))
    return TensorStats(shape=(3,), dtype=dtype, device="cpu", numel=3, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("event,cause", [
    (_event("input", param="m.1.running_var", param_kind="buffer", cause="nonfinite_buffer"), "nonfinite_buffer"),
    (_event(op="aten._ctc_loss.Tensor", kind="inf"), "ctc_target_too_long"),
    (_event("backward", op="SqrtBackward0", kind="inf", input_op="ClampBackward1"), "clamp_at_domain_edge"),
    (_event(op="aten.rsqrt.default", kind="inf", input_op="ClampMinBackward0"), "clamp_at_domain_edge"),
    (_event(op="aten.sqrt.default", input_op="MulBackward0"), None),
    (_event("backward", op="LogsumexpBackward0", inputs=(_stats(inf=2, neg_inf=2),)), "all_masked_row"),
    (_event(op="aten.log.default", kind="inf", inputs=(_stats(min=0.0, max=0.5, zeros=1),)), "log_of_zero_probability"),
    (_event(op="aten.log.default", kind="inf", inputs=(_stats(min=0.0, max=7.0, zeros=1),)), None),
    (_event("optimizer", op="Adam.step", eps=1e-8, output=_stats(dtype="float16", nan=1)), "adam_eps_underflow"),
    (_event("optimizer", op="Adam.step", eps=1e-8, output=_stats(nan=1)), None),
    (_event("optimizer", op="SGD.step", kind="inf", lr=1e30, lr_step=5, iteration=5), "lr_growth"),
    (_event(op="aten.pow.Tensor_Scalar", kind="inf", lr=1e6, lr_step=9, iteration=10), "lr_growth"),
    (_event("backward", op="LinalgEighBackward0"), "repeated_eigenvalues"),
    (_event(op="aten.log.default", kind="inf", lr=1e6, lr_step=9), None),  # log(0) is not the lr's doing
    (_event("input", detail="non-finite parameter model.0.weight"), None),  # prose is never parsed back
])
def test_cause_of_reads_fields_only(event: NanEvent, cause: str) -> None:
    assert cause_of(event) == cause
    assert hint(event)


def test_hints_use_the_structured_fields() -> None:
    grown = _event(op="aten.pow.Tensor_Scalar", kind="inf", lr=1e6, lr_step=9, iteration=10)
    assert "lr=1e+06" in hint(grown) and "optimizer step 8" in hint(grown) and "in step 9" in hint(grown)  # from 0
    buffer = _event("input", param="net.2.running_var", param_kind="buffer", cause="nonfinite_buffer")
    assert "net.2.running_var" in hint(buffer) and "reset_running_stats" in hint(buffer)
    assert "data" in hint(_event("input", detail="non-finite parameter model.0.weight"))


@pytest.mark.parametrize("out_pos_inf,inputs,had,phase,verdict", [
    (True, (MASK,), False, "forward", "birth"),  # -(-inf): the mask's sign changed
    (True, (InputFact(True, False, True, False, False), FINE), False, "forward", "birth"),  # a -inf made inside
    (False, (InputFact(True, False, True, False, False),), False, "forward", "propagation"),  # -inf carried on
    (True, (INF_MADE,), False, "forward", "propagation"),  # +inf in already: no sign change
    (True, (MASK,), True, "forward", "propagation"),  # after a birth: it came from there
    (True, (MASK,), False, "backward", "propagation"),  # gradients: the rule is the forward's
])
def test_a_minus_inf_that_turns_into_plus_inf_is_a_birth(out_pos_inf: bool, inputs: tuple, had: bool, phase: str,
                                                          verdict: str) -> None:
    assert judge(OpFacts(phase, False, inputs, had, out_pos_inf)) == verdict  # type: ignore[arg-type]


@pytest.mark.parametrize("event,cause", [
    (_event(op="aten.neg.default", kind="inf", inputs=(_stats(inf=2, neg_inf=2),), output=_stats(inf=2)),
     "minus_inf_flipped"),
    (_event(op="aten.neg.default", kind="inf", inputs=(_stats(inf=2, neg_inf=1),), output=_stats(inf=2)), None),
    (_event(op="aten.native_layer_norm.default", inputs=(_stats(min=-5e21, max=4e21),)), "overflow"),
    (_event(op="aten.native_layer_norm.default", inputs=(_stats(min=-5e18, max=4e18),)), None),  # squares fit
    (_event(op="aten.native_layer_norm.default", inputs=(_stats(min=-6e4, max=6e4, dtype="float16"),)), None),
    (_event(op="aten.mean.dim", inputs=(_stats(min=-3e38, max=3e38),), output=_stats()), "overflow"),
    (_event(op="aten.div.Tensor", eps=1e-12, output=_stats(dtype="float16")), "eps_rounds_to_zero"),
    (_event(op="aten.div.Tensor", eps=1e-6, output=_stats(dtype="float16")), None),
    (_event(op="aten.exp.default", kind="inf", line="std = torch.exp(0.5 * logvar)"), "logvar_exp"),
    (_event(op="aten.exp.default", kind="inf", line="y = torch.log(1 + torch.exp(x))"), "handwritten_softplus"),
    (_event(op="aten.exp.default", kind="inf", line="p = torch.exp(scores)"), None),
    (_event("optimizer", op="Adam.step", eps=0.0, grad_finite=True), "zero_gradient_update"),
    (_event("optimizer", op="Adam.step", eps=1e-8, grad_finite=True), None),
])
def test_the_new_causes_read_fields_only(event: NanEvent, cause: str) -> None:
    assert cause_of(event) == cause
    assert hint(event)
