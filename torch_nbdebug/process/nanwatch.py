"""Pure functions over nanwatch data: plain-language hints, the first birth, the final summary.

A known cause (:func:`cause_of`, a table of rules in :mod:`nanwatch_causes`) writes the hint; else the
op, the phase and the input statistics do.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Optional, Sequence

from torch_nbdebug.data.nanwatch import LayerStats, NanEvent, NanSummary
from torch_nbdebug.data.stats import TensorStats
from torch_nbdebug.process.nanwatch_causes import CAUSE_HINTS as _CAUSE_HINTS
from torch_nbdebug.process.nanwatch_causes import base_op as _base
from torch_nbdebug.process.nanwatch_causes import cause_of
from torch_nbdebug.process.nanwatch_scale import LARGEST, squares_overflow, sum_overflows

_HALF_MAX = {d: LARGEST[d] for d in ("float16", "bfloat16")}


def first_birth(events: Sequence[NanEvent]) -> Optional[NanEvent]:
    """The earliest birth (events are kept in the order they happened)."""
    return events[0] if events else None


def _has(stats: Iterable[TensorStats], pred: str) -> bool:
    for s in stats:
        if pred == "zero" and s.zeros:
            return True
        if pred == "neg" and s.min is not None and s.min < 0:
            return True
    return False


def _half(event: NanEvent) -> Optional[str]:
    dtypes = [s.dtype for s in ([event.output] if event.output else []) + list(event.inputs)]
    return next((d for d in dtypes if d in _HALF_MAX), None)


def hint(event: NanEvent, absorbed_ops: Sequence[str] = ()) -> str:
    """A likely cause and a fix, in plain words, from the cause, the op, the phase and the statistics."""
    cause = cause_of(event, absorbed_ops)
    if cause is not None and cause in _CAUSE_HINTS:
        return _CAUSE_HINTS[cause](event)
    if event.phase == "input":
        return _CAUSE_HINTS["input_data"](event)
    if event.phase == "optimizer":
        return _optimizer_hint(event)
    if event.phase == "backward":
        return _backward_hint(event)
    return _forward_hint(_base(event.op), event)


def _optimizer_hint(event: NanEvent) -> str:
    grad_ok = event.grad_finite is True
    why = ("the update itself overflowed: the learning rate is too large or growing"
           if grad_ok and event.kind == "inf" else
           "the update made NaN from a finite gradient: 0/0 in an adaptive step (Adam-style optimizers "
           "divide by sqrt(v) + eps, so eps=0 with a zero gradient gives 0/0) or an inf/NaN learning rate; "
           "keep eps > 0" if grad_ok else "the gradient or optimizer state was non-finite")
    facts = ", ".join(f for f in (_lr(event.lr), _grad(event.grad_finite)) if f)
    # 0/0 from a finite gradient is no step too large: only an overflow (or a bad gradient) is the lr's doing.
    fix = (" Lower the learning rate or fix the schedule, and clip gradients (torch.nn.utils.clip_grad_norm_)."
           if not grad_ok or event.kind == "inf" else " Check eps and the learning rate's value (not NaN/inf).")
    return (f"{event.param or 'A parameter'} became {event.kind.upper()} in optimizer step {event.step}: "
            f"{why}{f' ({facts})' if facts else ''}.{fix}")


def _lr(lr: Optional[float]) -> str:
    return f"lr={lr:.4g}" if lr is not None else ""


def _grad(finite: Optional[bool]) -> str:
    return "" if finite is None else "gradient finite" if finite else "gradient non-finite"


def _forward_hint(name: str, event: NanEvent) -> str:
    ins = event.inputs
    half = _half(event)
    if event.module and event.op.endswith("(module output)"):
        return (f"The output of {event.module} went non-finite while its inputs were finite. Module mode, or a "
                "call that could not be replayed (see the notes), names the module but not the op: run the "
                "cell with --no-replay (nanwatch(replay=False): every op watched) to name it.")
    if name in ("log", "log2", "log10", "log1p", "xlogy"):
        if _has(ins, "neg") or event.kind == "nan":  # log(0) is -inf; only a negative input gives NaN
            return "log of a negative number gives NaN: make sure the input is positive (e.g. softplus, abs, clamp)."
        return "log of zero gives -inf: use torch.log(x.clamp_min(eps)) or torch.log(x + eps), or log_softmax."
    if name in ("sqrt", "rsqrt"):
        return f"{name} of a negative number gives NaN: clamp the input (x.clamp_min(0)) or add eps."
    if name == "pow":
        if event.kind == "nan" and _has(ins, "neg"):
            return "pow of a negative base with a fractional exponent gives NaN: clamp the base or use abs()."
        if event.kind == "inf" and not _has(ins, "zero"):
            limit = f"{half}'s largest value {_HALF_MAX[half]:.5g}" if half else "the dtype's largest number"
            return (f"pow overflowed: a large base raised to the exponent passed {limit}. The base is already "
                    "large here: scale it down earlier (a smaller init or learning rate), normalise it, or "
                    "compute this in float32.")
        return ("0 to a negative power gives inf, and a negative base with a fractional exponent gives NaN: "
                "add eps to the base, or clamp it (or use abs()).")
    if name in ("div", "reciprocal", "floor_divide", "remainder", "fmod"):
        denominator = ins[-1] if ins else None
        if event.kind == "inf" and denominator is not None and denominator.min is not None and not denominator.zeros:
            return ("The quotient overflowed (the denominator holds no zero): a large numerator over a small "
                    "denominator passed the dtype's largest number. Guard the denominator (d.clamp_min(eps)) or "
                    "scale the numerator down.")
        if event.kind == "nan":
            return "0/0 gives NaN: guard the denominator (x / (d + eps) or d.clamp_min(eps))."
        return "division by zero gives inf: guard the denominator (x / (d + eps) or d.clamp_min(eps))."
    if name in ("exp", "exp2", "expm1", "sinh", "cosh"):
        extra = (f" In {half} the largest value is {_HALF_MAX[half]:.5g}: consider bfloat16, autocast with "
                 "GradScaler, or computing this in float32." if half else "")
        return "exp overflowed to inf: use logsumexp / softmax / log_softmax, or subtract the max first." + extra
    if name in ("acos", "asin", "atanh", "acosh"):
        return f"{name} is only defined on a limited range (e.g. [-1, 1]): clamp the input slightly inside it."
    if name in ("var", "std", "var_mean", "std_mean"):
        return "var/std of a single element is NaN (unbiased, divides by n-1 = 0): use unbiased=False or more elements."
    if name in ("mean",) and event.kind == "nan" and ins and ins[0].numel == 0:
        return "mean of an empty tensor is NaN: check the shape or the mask that selected it."
    if name in ("_softmax", "softmax", "_log_softmax", "log_softmax", "_scaled_dot_product_flash_attention_for_cpu",
                "scaled_dot_product_attention", "_scaled_dot_product_efficient_attention"):
        return ("softmax over a row that is entirely -inf (fully masked) gives NaN: make sure every row keeps "
                "at least one unmasked position, or use a large negative number instead of -inf.")
    if name in ("nll_loss_forward", "nll_loss2d_forward", "nll_loss", "cross_entropy", "nll_loss_nd") \
            and event.kind == "nan":
        return ("The loss averaged over zero targets (0/0): every target in the batch equals ignore_index, or "
                "the batch is empty. Skip such batches or use reduction='sum'.")
    if _is_norm(name) and not squares_overflow(ins[:1]):  # (an overflow has its own cause, and hint)
        return ("Normalisation divided by a zero standard deviation (0/0 gives NaN, x/0 inf): the input has zero "
                "variance (a constant row or channel, or a running_var of 0 in eval mode) and eps is 0. Keep "
                "eps > 0 (the default 1e-5), or check why the input is constant.")
    if event.kind == "nan" and any(s.inf for s in ins):
        return "inf - inf or 0 * inf gives NaN: an earlier infinity met another one here; remove the infinity upstream."
    if half:
        return (f"{half} overflow: values went past {_HALF_MAX[half]:.5g}. Use bfloat16, autocast with a GradScaler, "
                "keep this op in float32, or normalise the inputs.")
    if event.kind == "inf":
        return "Overflow: values went past the dtype's largest number. Normalise or scale down the inputs."
    if squares_overflow(ins, fused=False) or any(sum_overflows(s) for s in ins):
        return ("This op made NaN from finite inputs this large for their dtype: products or sums of them overflow "
                "to inf, and inf - inf is NaN. The values grew too large before this op: scale them down (a lower "
                "learning rate if the weights diverged).")
    return "This op made NaN from finite inputs: check its inputs' ranges in the statistics below."


def _is_norm(name: str) -> bool:
    return name in ("native_layer_norm", "native_batch_norm", "native_group_norm", "batch_norm", "layer_norm") \
        or name.startswith("native_batch_norm_legit")


def _fwd(event: NanEvent) -> str:
    return f" (created by {event.forward_op} at line {event.forward_lineno})" if event.forward_op else ""


def _backward_hint(event: NanEvent) -> str:
    name = _base(event.op)
    fwd = _fwd(event)
    if "AccumulateGrad" in event.op:
        return ("Accumulating into .grad overflowed: the gradients summed over several backward calls passed the "
                "dtype's largest number. Call optimizer.zero_grad() between steps, or scale the loss down "
                "(divide by the number of accumulation steps).")
    if name in ("sqrt", "rsqrt"):
        return ("The gradient of sqrt at 0 is infinite (1 / (2*sqrt(x))): use torch.sqrt(x + eps) or clamp x "
                f"away from 0{fwd}.")
    if name in ("log", "log2", "log10"):
        return f"The gradient of log at 0 is infinite (1/x): clamp the input away from 0{fwd}."
    if name in ("pow",):
        return ("The gradient of pow is non-finite here: with an exponent below 1 it is infinite at a base of 0 "
                "(add eps to the base); with a large base, base**(exponent-1) overflows, or the forward already "
                f"overflowed and a later op (tanh, sigmoid) hid it (scale the base down, or compute in float32){fwd}.")
    if name in ("norm", "linalgvectornorm"):
        return f"The gradient of a norm at the zero vector is 0/0 = NaN: add eps inside the norm{fwd}."
    if name in ("div",):
        return f"The gradient of a division by (almost) zero is non-finite: guard the denominator{fwd}."
    if name in ("acos", "asin"):
        return f"The gradient of {name} at ±1 is infinite: clamp the input to (-1+eps, 1-eps){fwd}."
    half = _half(event)
    if half:
        return (f"{half} overflow in the backward pass{fwd}: use a GradScaler (it lowers the loss scale when this "
                "happens) or bfloat16.")
    return f"The gradient of this op is non-finite at these inputs although the forward was finite{fwd}."


def with_hints(events: Sequence[NanEvent], absorbed: Sequence[NanEvent] = ()) -> tuple[NanEvent, ...]:
    absorbed_ops = [e.op for e in absorbed]
    absorbed_seqs = {e.sequence_nr for e in absorbed if e.sequence_nr is not None and e.phase == "forward"}
    out = []
    for e in events:
        if e.phase == "backward" and e.sequence_nr in absorbed_seqs:
            e = dataclasses.replace(e, absorbed_forward=True)
        out.append(e if e.hint else dataclasses.replace(e, cause=cause_of(e, absorbed_ops), hint=hint(e, absorbed_ops)))
    return tuple(out)


def mark_births(layers: Sequence[LayerStats], events: Sequence[NanEvent]) -> tuple[LayerStats, ...]:
    """Mark the table row of the first birth's module (the innermost module that contains it)."""
    first = first_birth(events)
    target = first.module if first is not None else None
    # Only rows whose mark changes are copied (a healthy watch copies none).
    return tuple(layer if layer.birth == (layer.module == target) else dataclasses.replace(layer, birth=not layer.birth)
                 for layer in layers)


def summarize_watch(events: Sequence[NanEvent], absorbed_idx: set[int], layers: Sequence[LayerStats],
                    **fields: Any) -> NanSummary:
    """Split absorbed births off, add hints, mark the birth row: the report's data."""
    kept = [e for i, e in enumerate(events) if i not in absorbed_idx]
    gone = [dataclasses.replace(e, cause=cause_of(e), hint=hint(e)) for i, e in enumerate(events) if i in absorbed_idx]
    kept_h = with_hints(kept, gone)
    return NanSummary(events=kept_h, absorbed=tuple(gone), layers=mark_births(layers, kept_h),
                      **fields)
