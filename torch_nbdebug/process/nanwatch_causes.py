"""Known causes (:data:`~torch_nbdebug.data.nanwatch.Cause`): the rules that recognise them from an
event's fields, and one hint per cause written from those fields. Never from ``detail`` (prose)."""
from __future__ import annotations

import re
from typing import Callable, Optional, Sequence

from torch_nbdebug.data.nanwatch import Cause, NanEvent
from torch_nbdebug.data.stats import TensorStats
from torch_nbdebug.process.nanwatch_scale import SMALLEST, limit_words, magnitude, squares_overflow, sum_overflows


def base_op(op: str) -> str:
    """``aten.log.default`` -> ``log``; ``SqrtBackward0`` -> ``sqrt``; ``aten.add_.Tensor`` -> ``add``."""
    if op.endswith("Backward0") or op.endswith("Backward1"):
        return op[: -len("Backward0")].lower()
    parts = op.split(".")
    name = parts[1] if len(parts) >= 2 and parts[0] == "aten" else parts[0]
    return name.rstrip("_").lstrip("_")


def cause_of(event: NanEvent, absorbed_ops: Sequence[str] = ()) -> Optional[Cause]:
    """The cause the recorder set, else the first rule that matches (None: unknown)."""
    if event.cause is not None:
        return event.cause
    thrown = event.absorbed_forward or (event.forward_op is not None and event.forward_op in absorbed_ops)
    if event.phase == "backward" and thrown:
        return "where_trap"
    name = base_op(event.op)
    return next((cause for cause, rule in RULES if rule(event, name)), None)


_DOMAIN_EDGE = ("sqrt", "rsqrt", "log", "log2", "log10", "pow")
_NOT_OVERFLOW = ("sqrt", "rsqrt", "log", "log2", "log10", "log1p", "div", "reciprocal", "acos", "asin", "atanh")
_ROW_REDUCTIONS = ("logsumexp", "softmax", "log_softmax")
_SPECTRAL = ("LinalgEighBackward", "LinalgSvdBackward", "SvdBackward", "LinalgEigBackward", "SymeigBackward")
# Reductions over squares (a variance, a norm): huge finite inputs overflow them.
_SQUARES = ("native_layer_norm", "native_group_norm", "native_batch_norm", "batch_norm", "layer_norm", "group_norm",
            "_native_batch_norm_legit", "_native_batch_norm_legit_no_training", "var", "std", "var_mean", "std_mean",
            "norm", "linalg_vector_norm", "_fused_rms_norm", "rms_norm")
_SUMS = ("sum", "mean", "nansum", "cumsum")
_GUARDED = ("div", "rsqrt", "reciprocal")  # what an eps guards: 0/0 and 1/0 when it rounds to 0
_NORM_MODULES = ("LayerNorm", "GroupNorm", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "RMSNorm", "InstanceNorm1d",
                 "InstanceNorm2d", "InstanceNorm3d")
MODULE_OUTPUT = " (module output)"  # module mode names the module, not the op: ``LayerNorm (module output)``
# The user's own line (source, not our prose): a log-variance, a softplus written by hand.
_LOGVAR = re.compile(r"log_?var|log_?sigma|log_?std", re.IGNORECASE)
_SOFTPLUS = re.compile(r"log1p\s*\(\s*(torch\.)?exp|log\s*\(\s*1(\.0*)?\s*\+\s*(torch\.)?\(?\s*[\w.]*exp\b|"
                       r"log\s*\(\s*(torch\.)?exp\s*\(.*\)\s*\+\s*1")


def _probabilities(stats: Sequence[TensorStats]) -> bool:
    """Zeros in values within [0, 1]: probabilities (a softmax that underflowed, a one-hot target)."""
    return any(s.zeros and s.min is not None and s.min >= 0 and s.max is not None and s.max <= 1 for s in stats)


def _masked_row_rule(e: NanEvent, name: str) -> bool:
    masked = any(s.neg_inf for s in e.inputs) and not any(s.nan for s in e.inputs)
    return name in _ROW_REDUCTIONS and masked and (e.kind == "nan" or e.phase == "backward")


def _tiny(e: NanEvent) -> float:
    return SMALLEST.get(e.output.dtype, 0.0) if e.output is not None else 0.0


def _adam_eps_rule(e: NanEvent, name: str) -> bool:
    return e.phase == "optimizer" and e.op.startswith(("Adam", "NAdam", "RAdam")) and \
        e.eps is not None and 0 < e.eps < _tiny(e)


def _flipped_rule(e: NanEvent, name: str) -> bool:
    """-inf in (only), +inf out: an intentional mask changed sign (``-log p`` of a masked class)."""
    minus_only = any(s.neg_inf for s in e.inputs) and all(s.inf == s.neg_inf and not s.nan for s in e.inputs)
    return e.phase == "forward" and e.kind == "inf" and minus_only and e.output is not None and \
        e.output.inf > e.output.neg_inf


def _zero_gradient_rule(e: NanEvent, name: str) -> bool:
    """An adaptive step with eps=0 made NaN from a finite gradient: v = 0 where the gradient was 0 (0/0)."""
    return e.phase == "optimizer" and e.kind == "nan" and e.grad_finite is True and e.eps == 0


def _overflow_rule(e: NanEvent, name: str) -> bool:
    """Finite inputs so large for the dtype that the op's squares or sums overflowed."""
    if e.phase != "forward":
        return False
    if name in _SQUARES or (name.endswith(MODULE_OUTPUT) and name[: -len(MODULE_OUTPUT)] in _NORM_MODULES):
        return squares_overflow(e.inputs[:1]) is not None
    return name in _SUMS and bool(e.inputs) and sum_overflows(e.inputs[0], e.output.dtype if e.output else None)


def _softplus_rule(e: NanEvent, name: str) -> bool:
    return name in ("exp", "log", "log1p") and bool(_SOFTPLUS.search(e.line))


def _logvar_rule(e: NanEvent, name: str) -> bool:
    return name == "exp" and e.kind == "inf" and bool(_LOGVAR.search(e.line))


# In order: the first match names the cause. An overflow after the learning rate grew comes last, so
# that a log of zero or a CTC loss keeps its own cause.
RULES: tuple[tuple[Cause, Callable[[NanEvent, str], bool]], ...] = (
    ("ctc_target_too_long", lambda e, name: "ctc" in name and e.kind == "inf" and e.phase == "forward"),
    ("clamp_at_domain_edge", lambda e, name: name in _DOMAIN_EDGE and (e.input_op or "").startswith("Clamp")),
    ("all_masked_row", _masked_row_rule),
    ("minus_inf_flipped", _flipped_rule),
    ("log_of_zero_probability", lambda e, name: name in ("log", "log2", "log10") and e.kind == "inf"
     and e.phase == "forward" and _probabilities(e.inputs[:1])),
    ("adam_eps_underflow", _adam_eps_rule),
    ("zero_gradient_update", _zero_gradient_rule),
    ("eps_rounds_to_zero", lambda e, name: e.phase != "optimizer" and name in _GUARDED and e.eps is not None
     and 0 < e.eps < _tiny(e)),
    ("repeated_eigenvalues", lambda e, name: e.phase == "backward" and (e.node_name or e.op).startswith(_SPECTRAL)),
    ("handwritten_softplus", _softplus_rule),
    ("logvar_exp", _logvar_rule),
    ("lr_growth", lambda e, name: e.lr_step is not None and e.kind == "inf" and name not in _NOT_OVERFLOW),
    ("overflow", _overflow_rule),
)


def _fwd(event: NanEvent) -> str:
    return f" (created by {event.forward_op} at line {event.forward_lineno})" if event.forward_op else ""


def _parameter(event: NanEvent) -> str:
    return (f"A non-finite parameter {event.param} already held NaN/Inf before this code ran: an earlier "
            "training step diverged. Reload a checkpoint or re-initialise the model, then watch the "
            "training loop to find the step where it was born.")


def _buffer(event: NanEvent) -> str:
    name = event.param or "a buffer"
    if name.rsplit(".", 1)[-1] in ("running_mean", "running_var"):
        return (f"The BatchNorm running statistics {name} already held NaN/Inf: BatchNorm updates them from "
                "every training batch, so an earlier batch with NaN/Inf (or one whose variance overflowed) "
                "poisoned them, and eval mode now uses them. Call reset_running_stats() on that module (or "
                "reload a checkpoint) and watch the training loop to find the batch.")
    return (f"The buffer {name} already held NaN/Inf before this code ran: the code that last wrote it (an "
            "earlier step, a buffer update) made it. Re-initialise it and watch the code that updates it.")


def _user_backward(event: NanEvent) -> str:
    op = (event.aten_op or "").split(".")
    name = op[1] if len(op) > 1 and op[0] == "aten" else "an op"
    return (f"Your own backward code made this gradient {event.kind.upper()} at line {event.lineno} "
            f"({name} on finite values): a custom autograd.Function.backward or a gradient hook. Guard its "
            "divisions and logs (add eps, clamp) or check its formula with torch.autograd.gradcheck.")


def _where_trap(event: NanEvent) -> str:
    return ("The torch.where trap: the forward threw the bad branch away, but its gradient is still "
            f"computed: {event.op}{_fwd(event)} gives NaN at the masked positions. Make the unused branch "
            "safe instead, e.g. torch.log(torch.where(mask, x, 1.0)) inside the where.")


def _lr_growth(event: NanEvent) -> str:
    lr = f"{event.lr:.4g}" if event.lr is not None else "?"
    what = ("the update overflowed" if event.phase == "optimizer" else
            "the weights grew so large that this op overflowed")
    grown = f"optimizer step {event.lr_step - 1}" if event.lr_step is not None else "an optimizer step"
    return (f"The learning rate grew to lr={lr} ({grown}) and {what} in step "
            f"{event.step}: check the scheduler (a warmup or multiplicative schedule without a cap) and "
            "lower the learning rate; clip gradients (torch.nn.utils.clip_grad_norm_).")


def _clamp(event: NanEvent) -> str:
    op = event.forward_op if event.phase == "backward" and event.forward_op else event.op
    name = op.split(".")[1] if op.startswith("aten.") else op
    what = (f"the value is finite there but {name}'s gradient at 0 is infinite, and clamp passes it on"
            if event.phase == "backward" else f"{name}(0) is infinite (and so is its gradient)")
    return (f"The input of {name} was clamped to exactly 0 ({event.input_op}), not replaced with torch.where: "
            f"{what}{_fwd(event)}. Clamp to a small positive eps instead (x.clamp_min(1e-12)), or add eps inside.")


def _masked_row(event: NanEvent) -> str:
    if event.phase == "backward":
        return ("logsumexp/softmax over a row that is entirely -inf: the forward was not finite there (-inf, "
                f"or NaN), and its gradient is NaN{_fwd(event)}. Keep at least one unmasked position per row, "
                "or mask with a large negative number (torch.finfo(dtype).min) instead of -inf.")
    return ("softmax over a row that is entirely -inf (fully masked) gives NaN: make sure every row keeps "
            "at least one unmasked position, or use a large negative number instead of -inf.")


def _adam_eps(event: NanEvent) -> str:
    dtype = event.output.dtype if event.output is not None else "float16"
    return (f"Adam's eps={event.eps:g} rounds to 0 in {dtype} (its smallest value is about 6e-8), so "
            f"sqrt(v) + eps is 0 where the gradient is tiny and the update divides by zero ({event.param}). "
            "Keep the parameters and optimizer state in float32 (autocast for the forward), or use eps=1e-4.")


def _eigen(event: NanEvent) -> str:
    return (f"The gradient of {event.forward_op or 'eigh/svd'} divides by differences of eigenvalues (singular "
            f"values): repeated ones make it infinite or NaN{_fwd(event)}. Use eigvalsh/svdvals when only the "
            "values are needed, or break the degeneracy (add a tiny random perturbation).")


def _overflow(event: NanEvent) -> str:
    op = base_op(event.op)
    squares = op in _SQUARES or op.endswith(MODULE_OUTPUT)
    op = op[: -len(MODULE_OUTPUT)] if op.endswith(MODULE_OUTPUT) else op
    s = squares_overflow(event.inputs[:1]) if squares else (event.inputs[0] if event.inputs else None)
    size = f"{magnitude(s):.4g}" if s is not None and magnitude(s) is not None else "?"
    if squares and s is not None:
        what = (f"its inputs reach {size} and {limit_words(s)}, so the sum of squares (the variance) "
                f"overflowed and normalising gave {'NaN' if event.kind == 'nan' else 'Inf'}")
    else:
        dtype = event.output.dtype if event.output is not None else "the dtype"
        what = f"its inputs reach {size} and their sum passed {dtype}'s largest number"
    lr = f" (lr={event.lr:.4g})" if event.lr is not None else ""
    return (f"{op} overflowed: {what}. Nothing is wrong with its eps: the values grew too large before this op. "
            f"In training the weights diverged: lower the learning rate{lr} and clip gradients "
            "(torch.nn.utils.clip_grad_norm_); else scale the inputs down.")


def _flipped(event: NanEvent) -> str:
    return (f"An intentional -inf (a mask) became +inf here ({base_op(event.op)} flipped its sign): a sum over every "
            "class of log-probabilities (label smoothing's -log p, an entropy) meets log p = -inf at the masked "
            "classes. Mask with torch.finfo(dtype).min (a large finite negative) instead of -inf, or leave the "
            "masked classes out of that sum.")


def _eps_zero(event: NanEvent) -> str:
    dtype = event.output.dtype if event.output is not None else "float16"
    return (f"eps={event.eps:g} rounds to 0 in {dtype} (its smallest value is about {2 * SMALLEST.get(dtype, 0):.2g}): "
            f"the guarded denominator is 0 where the norm or variance is 0, and {base_op(event.op)} divides by it. "
            f"Use an eps {dtype} can hold (1e-6 or more in float16, e.g. F.normalize(x, eps=1e-6)), or compute this "
            "in float32.")


def _logvar(event: NanEvent) -> str:
    s = event.inputs[0] if event.inputs else None
    top = f" (it reaches {s.max:.4g}; exp passes the largest number from about 88.7 in float32, 11.1 in float16)" \
        if s is not None and s.max is not None else ""
    return (f"exp of a large log-variance overflowed{top}: clamp it before the exp, e.g. "
            "logvar = logvar.clamp(-30, 20) (a VAE's std = torch.exp(0.5 * logvar)), or predict it through softplus.")


def _zero_gradient(event: NanEvent) -> str:
    return (f"{event.param or 'A parameter'} became NaN in optimizer step {event.step} with eps=0: where its "
            "gradient is exactly 0 (a weight the loss does not use, an embedding row not in the batch) the "
            "adaptive step divides 0 by sqrt(v) = 0. The learning rate plays no part: keep eps > 0 (the default "
            "1e-8).")


# The causes whose hint needs none of the event's fields.
_FIXED_HINTS: dict[Cause, str] = {
    "input_data": (
        "The data coming in already holds NaN/Inf, before any op made one: check the dataset or preprocessing "
        "(e.g. assert torch.isfinite(x).all() when loading), or clean it with torch.nan_to_num. This op only "
        "consumed it."),
    "grad_scaler_skip": (
        "GradScaler saw this overflow, skipped the optimizer step and lowered the loss scale: expected now "
        "and then with float16 (it is how the scale is calibrated). Only a concern when most steps are "
        "skipped: then find why the gradients overflow even at a small scale."),
    "ctc_target_too_long": (
        "CTC loss is infinite when a target is longer than its input sequence (more labels, plus one blank "
        "between repeats, than time steps): no alignment exists. Check input_lengths against target_lengths, "
        "or pass zero_infinity=True to drop those samples' loss and gradient."),
    "log_of_zero_probability": (
        "log of zero probabilities gives -inf (a softmax that underflowed, a target with zeros): for kl_div "
        "pass log-probabilities from F.log_softmax (not probs.log()), or use torch.log(p.clamp_min(eps)) / "
        "torch.xlogy."),
    "handwritten_softplus": (
        "A softplus written by hand (torch.log(1 + torch.exp(x)), also inside mish) overflows: exp(x) is inf "
        "for large x, and its gradient inf * 0 is NaN. Use F.softplus(x) (F.mish for mish): it is exact and "
        "stable for every x."),
}


def _fixed(text: str) -> Callable[[NanEvent], str]:
    return lambda event: text


CAUSE_HINTS: dict[Cause, Callable[[NanEvent], str]] = {
    "nonfinite_parameter": _parameter,
    "nonfinite_buffer": _buffer,
    "user_backward": _user_backward,
    "where_trap": _where_trap,
    "lr_growth": _lr_growth,
    "clamp_at_domain_edge": _clamp,
    "all_masked_row": _masked_row,
    "adam_eps_underflow": _adam_eps,
    "repeated_eigenvalues": _eigen,
    "overflow": _overflow,
    "minus_inf_flipped": _flipped,
    "eps_rounds_to_zero": _eps_zero,
    "logvar_exp": _logvar,
    "zero_gradient_update": _zero_gradient,
    **{cause: _fixed(text) for cause, text in _FIXED_HINTS.items()},
}
