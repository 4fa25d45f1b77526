"""Pure rules from failure facts (and a recording) to a :class:`Diagnosis`: which kind of error, which
op, the culprit, and the cause and fix in one hint. One rule per message family, in one table."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

from torch_nbdebug.data.explain import Diagnosis, FailureFacts, Kind, Recording
from torch_nbdebug.process.explain_hints import (
    bmm_hint, broadcast_hint, cat_hint, conv_channels_hint, conv_rank_hint, device_hint, dtype_hint, inplace,
    loss_size_hint, matmul_hint, no_grad, target_dtype_hint, view_hint)
from torch_nbdebug.process.explain_graph_reuse import graph_reuse
from torch_nbdebug.process.explain_indices import index_dtype_hint, index_hint

Hint = Callable[["re.Match[str]", FailureFacts, Optional[Recording]], dict[str, object]]


@dataclass(frozen=True)
class Rule:
    """A message family: its pattern, its kind, the ATen op it comes from, and how to explain it."""

    pattern: "re.Pattern[str]"
    kind: Kind
    op: str  # "" -> the call on the failing line
    explain: Hint


def _r(pattern: str, kind: Kind, op: str, explain: Hint) -> Rule:
    return Rule(re.compile(pattern, re.S), kind, op, explain)


RULES: tuple[Rule, ...] = (
    _r(r"device-side assert triggered", "index", "", index_hint),
    _r(r"index (-?\d+) is out of range for (\w+) with (\d+) ", "index", "group:2", index_hint),  # --check-indices
    _r(r"mat1 and mat2 shapes cannot be multiplied \((\d+)x(\d+) and (\d+)x(\d+)\)", "shape", "aten::mm", matmul_hint),
    _r(r"Expected size for first two dimensions of batch2 tensor to be: \[(\d+), (\d+)\] but got: \[(\d+), (\d+)\]",
       "shape", "aten::bmm", bmm_hint),
    _r(r"size mismatch, got input \((\d+)\), mat \((\d+)x(\d+)\)", "shape", "aten::mv", matmul_hint),
    _r(r"Given groups=\d+, weight of size \[([\d, ]+)\], expected input\[([\d, ]+)\] to have (\d+) channels, "
       r"but got (\d+) channels", "shape", "aten::convolution", conv_channels_hint),
    _r(r"Expected (\w+) \(unbatched\) or (\w+) \(batched\) input to (\w+), but got input of size: \[([\d, ]*)\]",
       "shape", "aten::convolution", conv_rank_hint),
    _r(r"Sizes of tensors must match except in dimension (\d+)\. Expected size (\d+) but got size (\d+) "
       r"for tensor number (\d+)", "shape", "aten::cat", cat_hint),
    _r(r"shape '\[([-\d, ]*)\]' is invalid for input of size (\d+)", "shape", "aten::view", view_hint),
    _r(r"view size is not compatible with input tensor's size and stride", "shape", "aten::view", view_hint),
    _r(r"Target size \(torch\.Size\(\[([\d, ]*)\]\)\) must be the same as input size \(torch\.Size\(\[([\d, ]*)\]\)\)|"
       r"Using a target size \(torch\.Size\(\[([\d, ]*)\]\)\) that is different to the input size "
       r"\(torch\.Size\(\[([\d, ]*)\]\)\)", "shape", "loss", loss_size_hint),
    _r(r"The size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\) at non-singleton dimension (\d+)",
       "shape", "", broadcast_hint),
    _r(r"Expected input batch_size \((\d+)\) to match target batch_size \((\d+)\)", "shape", "aten::nll_loss",
       broadcast_hint),
    _r(r"Expected all tensors to be on the same device|is not on the expected device|"
       r"Input type \(torch\.cuda\.\w+\) and weight type \(torch\.\w+\)|"
       r"Input type \(torch\.\w+\) and weight type \(torch\.cuda\.\w+\)|should be on the same device",
       "device", "", device_hint),
    _r(r"expected target dtype to be Long or Byte, but got (\w+)|expected scalar type Long but found (\w+)",
       "dtype", "aten::nll_loss", target_dtype_hint),
    _r(r"(\w+)\(\): Expected dtype int(?:32|64)(?:/int64| or int64)? for index", "dtype", "group:1",
       index_dtype_hint),
    _r(r"tensors used as indices must be long, int, byte or bool tensors", "dtype", "aten::index", index_dtype_hint),
    _r(r"must have the same dtype, but got (\w+) and (\w+)|expected m1 and m2 to have the same dtype|"
       r"Input type \((\w+)\) and (?:bias|weight) type \((\w+)\) should be the same|"
       r"expected scalar type (\w+) but found (\w+)|Found dtype (\w+) but expected (\w+)|"
       r"result type (\w+) can't be cast to the desired output type (\w+)", "dtype", "", dtype_hint),
    _r(r"modified by an inplace operation: \[[\w.]+ \[([\d, ]*)\]\], which is output (\d+) of (\w+), "
       r"is at version (\d+); expected version (\d+)", "inplace", "backward", inplace),
    _r(r"Trying to backward through the graph a second time", "graph_reuse", "backward", graph_reuse),
    _r(r"does not require grad and does not have a grad_fn", "no_grad", "backward", no_grad),
    _r(r"Target (-?\d+) is out of bounds|index out of range in self|"
       r"index (-?\d+) is out of bounds for dimension (\d+) with size (\d+)|"
       r"INDICES element is out of DATA bounds, id=(-?\d+) axis_dim=(\d+)", "index", "", index_hint),
)

_CALL_OPS = {"linear": "aten::linear", "embedding": "aten::embedding", "cross_entropy": "aten::cross_entropy_loss",
             "cross_entropy_loss": "aten::cross_entropy_loss", "nll_loss": "aten::nll_loss",
             "nll_loss_nd": "aten::nll_loss", "nll_loss2d": "aten::nll_loss2d"}


def classify(message: str) -> tuple[Kind, Optional[Rule], Optional["re.Match[str]"]]:
    """The kind of a PyTorch error message, with the rule and match that recognised it."""
    for rule in RULES:
        match = rule.pattern.search(message)
        if match is not None:
            return rule.kind, rule, match
    return "other", None, None


def failing_op(rule: Optional[Rule], facts: FailureFacts, match: Optional["re.Match[str]"] = None) -> str:
    """The ATen op that failed: the rule's op, refined by the call on the failing line."""
    by_call = _CALL_OPS.get(facts.call) or (f"aten::{facts.call}" if facts.call else "")
    if rule is None:
        return by_call
    if facts.loss and rule.kind == "shape" and rule.op in ("", "loss"):  # a loss's own size check
        return f"aten::{facts.loss}"
    if rule.op == "loss":
        return by_call
    if rule.op.startswith("group:") and match is not None:  # the message names the op
        return f"aten::{match.group(int(rule.op[6:]))}"
    if facts.call in _CALL_OPS:  # the call names the op more precisely than the message family
        return _CALL_OPS[facts.call]
    return rule.op or by_call


def diagnose(facts: FailureFacts, recording: Optional[Recording] = None) -> Optional[Diagnosis]:
    """The diagnosis of a failure, or None when it is not a PyTorch error (those stay silent)."""
    kind, rule, match = classify(facts.message)
    if kind == "other" and not facts.from_torch:
        return None
    fields: dict[str, object] = {}
    if rule is not None and match is not None:
        fields = rule.explain(match, facts, recording)
    if kind == "other":
        fields = _other(facts)
    if recording is not None:  # recorded already: "run it with %%explain" would send the user round in circles
        fields.pop("suggest_record", None)
    return Diagnosis(kind=kind, message=facts.message, exc_type=facts.exc_type, op=failing_op(rule, facts, match),
                     module=facts.module, filename=facts.filename, lineno=facts.lineno, line=facts.line,
                     operands=facts.operands, recorded=recording is not None, **fields)  # type: ignore[arg-type]


def _other(facts: FailureFacts) -> dict[str, object]:
    where = f" in `{facts.module}`" if facts.module else ""
    return {"summary": f"{facts.exc_type} raised inside PyTorch{where}",
            "hint": "the message above is PyTorch's own; the operands below show what the failing line handed it"}

