"""The one place that decides what a non-finite value is: a birth, input data, a propagation, or absorbed.

Pure functions over plain flags, no tensors: the immediate path (CPU, values read at once) and the
deferred path (CUDA, flags read later in one transfer) both reduce what they saw to these facts and
call the same rules, so the two can never disagree.
"""
from __future__ import annotations

from typing import Literal, NamedTuple, Sequence

Verdict = Literal["birth", "input", "propagation"]
OpPhase = Literal["forward", "backward"]


class InputFact(NamedTuple):
    """One floating input of a flagged op."""

    bad: bool  # holds NaN/Inf (confirmed: a sum that only overflowed on huge finite values is not bad)
    nan: bool  # holds NaN
    neg_inf_only: bool  # its non-finite values are all -inf (an additive mask's signature)
    external: bool  # not produced inside the watch (data, parameters, a mask made before)
    from_absorbed: bool  # the saved output of a forward birth that torch.where/masked_fill threw away


class OpFacts(NamedTuple):
    """An op whose output is non-finite, as plain facts."""

    phase: OpPhase
    out_nan: bool  # some output holds NaN (else only +-inf)
    inputs: tuple[InputFact, ...]
    had_events: bool  # an earlier birth (or input event) was already reported in this watch
    out_pos_inf: bool = False  # some output holds +inf (its propagating sum is +inf)


def judge(facts: OpFacts) -> Verdict:
    """Birth (finite inputs made it), input (it came in from outside), or propagation (it flowed on).

    The rules, in order:
    - all inputs finite: a birth;
    - backward, reading a forward value that a where/masked_fill threw away: a birth (the where trap);
    - forward, before any birth, +inf out of inputs whose non-finite values are all -inf (an intentional
      mask whose sign changed: ``-log p`` of a masked class, label smoothing's sum): a birth;
    - a non-finite input from outside the watch, before any birth, that is not an additive -inf mask:
      input data;
    - forward, before any birth, a NaN input that no watched op made (written by the code, another
      thread): input data, so the tool never stays silent;
    - NaN made from infinities only (inf - inf, 0 * inf, a fully masked softmax row): a birth;
    - otherwise a propagation of an earlier birth.
    """
    bad = [i for i in facts.inputs if i.bad]
    if not bad:
        return "birth"
    if facts.phase == "backward" and any(i.from_absorbed for i in bad):
        return "birth"
    if facts.phase == "forward" and facts.out_pos_inf and not facts.had_events and all(i.neg_inf_only for i in bad):
        return "birth"
    external = [i for i in bad if i.external]
    if external and not facts.had_events and not is_mask(external, facts.out_nan):
        return "input"
    if facts.phase == "forward" and not facts.had_events and any(i.nan for i in bad):
        return "input"
    if facts.out_nan and not any(i.nan for i in facts.inputs):
        return "birth"
    return "propagation"


def is_mask(external: Sequence[InputFact], out_nan: bool) -> bool:
    """An additive attention mask made before the watch (``generate_square_subsequent_mask``): only
    -inf, and no NaN comes out. Intentional, not bad input data."""
    return not out_nan and all(i.neg_inf_only for i in external)


def judge_module(out_bad: bool, inputs_bad: bool, params_bad: bool, had_events: bool,
                 inner_reported: bool) -> Verdict:
    """``mode="module"``: a module output went non-finite. A submodule already reported it, or an
    earlier birth poisoned the inputs or weights: propagation. Non-finite inputs or weights before
    any birth: input. Else the module made it."""
    if not out_bad or inner_reported:
        return "propagation"
    if inputs_bad or params_bad:
        return "propagation" if had_events else "input"
    return "birth"


def judge_gradient(had_events: bool) -> Verdict:
    """``mode="module"``: a non-finite gradient into a module output is a birth only if nothing was
    reported before (else an earlier birth made it)."""
    return "propagation" if had_events else "birth"


def judge_absorb(out_bad: bool, born: Sequence[bool], bad: Sequence[bool], written: Sequence[bool]) -> tuple[bool, ...]:
    """``torch.where``/``masked_fill``/``clamp`` with a finite result: which of its inputs, each the
    output of a forward birth (``born``), had their non-finite values thrown away. In place
    (``y.masked_fill_(...)``) the born values were overwritten, so a written input counts too."""
    if out_bad:
        return tuple(False for _ in born)
    return tuple(b and (w or x) for b, x, w in zip(born, bad, written))


def keeps_backward_birth(grads_bad: Sequence[bool]) -> bool:
    """A birth inside an autograd node counts only if a non-finite gradient leaves the node: the
    norm's gradient makes 0/0 inside and masks it (``masked_fill_``). No gradients: keep it."""
    return not grads_bad or any(grads_bad)
