"""What ``%%nanwatch`` found: NaN/Inf births and per-layer statistics, as plain frozen data.

Nothing here holds a tensor: statistics are :class:`TensorStats`, places are strings and ints.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, Optional

from torch_nbdebug.data.source import line_label
from torch_nbdebug.data.stats import TensorStats

Phase = Literal["forward", "backward", "optimizer", "input"]
Kind = Literal["nan", "inf"]
ParamKind = Literal["parameter", "buffer"]
# Why a NaN/Inf was born, when the recorder or the hint rules can tell (the hint is written from it).
Cause = Literal[
    "user_backward",            # a custom autograd.Function backward or a tensor hook made it
    "grad_scaler_skip",         # GradScaler found it and skipped the step (expected calibration)
    "nonfinite_parameter",      # a parameter held NaN/Inf before this op (``param`` names it)
    "nonfinite_buffer",         # a buffer (BatchNorm running statistics) held NaN/Inf (``param``)
    "input_data",               # the data coming in held NaN/Inf
    "where_trap",               # torch.where/masked_fill threw the forward value away, not its gradient
    "lr_growth",                # the learning rate grew until the update or the loss overflowed (``lr``)
    "ctc_target_too_long",      # CTC loss: a target longer than its input has no alignment (inf)
    "clamp_at_domain_edge",     # clamp to exactly 0 in front of sqrt/rsqrt/log: infinite gradient there
    "all_masked_row",           # logsumexp/softmax over a row that is entirely -inf
    "log_of_zero_probability",  # log of probabilities that underflowed to 0 (kl_div, entropy)
    "adam_eps_underflow",       # Adam's eps rounds to 0 in float16: 0/0 in the update
    "repeated_eigenvalues",     # eigh/svd backward divides by differences of equal eigenvalues
    "overflow",                 # values so large for their dtype that squares (a variance, a norm) or sums overflowed
    "minus_inf_flipped",        # an intentional -inf (a mask) turned into +inf (label smoothing's -sum of log p)
    "eps_rounds_to_zero",       # a small constant (``eps``) rounds to 0 in float16/bfloat16: 0/0 (``eps``)
    "logvar_exp",               # exp of a large log-variance (a VAE's std = exp(0.5 * logvar)): clamp it
    "handwritten_softplus",     # log(1 + exp(x)) written by hand (softplus, mish): exp overflows; F.softplus
    "zero_gradient_update",     # an adaptive step with eps=0 where the gradient is 0: 0/0, whatever the lr
]
# A constant below half its dtype's smallest subnormal rounds to 0 there (eps=1e-12 in float16): one table for
# the recorder (which constants to note) and the hints (which eps to blame).
ROUNDS_TO_ZERO = {"float16": 2.0 ** -25, "bfloat16": 2.0 ** -134}
PHASES: tuple[Phase, ...] = ("forward", "backward", "optimizer", "input")
KINDS: tuple[Kind, ...] = ("nan", "inf")


@dataclass(frozen=True)
class NanEvent:
    """One birth: the first place a NaN or Inf appeared from finite inputs.

    ``op`` is the ATen overload (``aten.log.default``) in forward, the autograd node
    (``SqrtBackward0``) in backward, ``Adam.step`` for the optimizer, and the consuming op for
    ``"input"`` events. ``filename``/``lineno`` are the user's own line (a notebook cell line):
    for backward births, the forward line that created the node. ``iteration`` is 1-based: the
    forward/backward pass (or optimizer step) of a loop in which the birth happened; ``step`` is what every
    view, ``to_json`` and export show: the optimizer steps completed before it, from 0 (the one step axis
    of every tool).

    Structured facts for the hint (never parsed back out of ``detail``, which is for people):
    ``cause``; ``param``/``param_kind`` for a parameter or buffer that carried it; ``lr``/``eps``/
    ``grad_finite`` for optimizer events (``lr`` also on later births when the learning rate grew; ``eps``
    also on a half-precision birth whose module passed an op a constant the dtype rounds to 0);
    ``input_op``, the autograd node that made the op's first input (``ClampMinBackward0``).
    """

    phase: Phase
    op: str
    kind: Kind
    module: Optional[str] = None
    filename: Optional[str] = None
    lineno: Optional[int] = None
    line: str = ""
    function: str = "<module>"
    inputs: tuple[TensorStats, ...] = ()
    output: Optional[TensorStats] = None
    hint: str = ""
    iteration: int = 1
    param: Optional[str] = None
    aten_op: Optional[str] = None
    node_name: Optional[str] = None
    sequence_nr: Optional[int] = None
    forward_op: Optional[str] = None
    forward_module: Optional[str] = None
    forward_lineno: Optional[int] = None
    absorbed_forward: bool = False
    deferred: bool = False
    detail: str = ""
    cause: Optional[Cause] = None
    param_kind: Optional[ParamKind] = None
    lr: Optional[float] = None
    lr_step: Optional[int] = None
    eps: Optional[float] = None
    grad_finite: Optional[bool] = None
    input_op: Optional[str] = None
    steps_before: Optional[int] = None  # optimizer steps completed before it, as the watch counted them

    @property
    def step(self) -> int:
        """The optimizer steps completed before the birth, from 0: the step every tool shows (with several
        forward/backward passes a step, gradient accumulation, the steps the watch counted, not the passes;
        ``iteration - 1`` when optimizer steps were not watched). For an ``"optimizer"`` event, the step
        whose update made it."""
        return self.steps_before if self.steps_before is not None else self.iteration - 1

    @property
    def where(self) -> str:
        """``cell line 3 in model.fc`` style location for messages."""
        parts = []
        if self.lineno is not None:
            parts.append(f"line {self.lineno}" + (f" ({self.filename})" if self.filename else ""))
        if self.module:
            parts.append(f"in {self.module}")
        if self.param:
            parts.append(f"parameter {self.param}")
        return " ".join(parts) or "outside any module"

    def title(self, line: Optional[str] = None) -> str:
        """One line: ``NaN born in forward: aten.log.default in model.fc (line 3)``; ``line`` names the line
        otherwise (``In [2], line 3``: see :meth:`NanSummary.line_label`)."""
        what = "NaN" if self.kind == "nan" else "Inf"
        if self.phase == "input" and self.param:
            carrier = f"{self.param_kind or 'parameter'} {self.param}"
            return f"{what} already in {carrier}, first used by {self.op}" + _at(self, line)
        if self.phase == "input":
            return f"{what} already in the input data, first used by {self.op}" + _at(self, line)
        if self.phase == "optimizer":
            return f"{what} born in optimizer step {self.step}: {self.param or '?'} ({self.op})"
        return f"{what} born in {self.phase}: {self.op}" + _at(self, line)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["step"] = self.step
        data["inputs"] = [s.to_dict() for s in self.inputs]
        data["output"] = self.output.to_dict() if self.output is not None else None
        data["title"] = self.title()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "NanEvent":
        """The event :meth:`to_dict` wrote (keys this version does not know are ignored)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["inputs"] = tuple(TensorStats.from_dict(s) for s in data.get("inputs") or ())
        values["output"] = TensorStats.from_dict(data["output"]) if data.get("output") else None
        return cls(**values)


def _at(event: NanEvent, line: Optional[str] = None) -> str:
    bits = []
    if event.module:
        bits.append(f"in {event.module}")
    if event.lineno is not None:
        bits.append(f"({line or f'line {event.lineno}'})")
    return (" " + " ".join(bits)) if bits else ""


@dataclass(frozen=True)
class LayerStats:
    """Forward activation and backward gradient statistics of one module (min/max/mean, finiteness).

    ``fwd_*`` are from the call where its output first went non-finite, else the last call;
    ``grad_*`` likewise for the gradient flowing into its output. ``None`` means never seen.
    """

    module: str
    calls: int = 0
    fwd_min: Optional[float] = None
    fwd_max: Optional[float] = None
    fwd_mean: Optional[float] = None
    fwd_finite: Optional[bool] = None
    grad_min: Optional[float] = None
    grad_max: Optional[float] = None
    grad_mean: Optional[float] = None
    grad_finite: Optional[bool] = None
    birth: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LayerStats":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class NanSummary:
    """Everything one watch recorded: births in order, absorbed births, layers, and notes."""

    events: tuple[NanEvent, ...] = ()
    absorbed: tuple[NanEvent, ...] = ()
    layers: tuple[LayerStats, ...] = ()
    mode: str = "op"
    ops_seen: int = 0
    ops_checked: int = 0
    dropped: int = 0
    notes: tuple[str, ...] = ()
    cell_filename: Optional[str] = None
    cell_source: str = ""
    source_first_line: int = 1
    sources: tuple[tuple[str, int, str], ...] = ()  # (filename, first line, text) of every event's file
    options: dict[str, Any] = field(default_factory=dict)
    cell: Optional[int] = None  # the notebook cell the watch ran in (In [4]), when known
    cells: tuple[tuple[str, int], ...] = ()  # (filename, In [n]) of every event's notebook cell

    def _event_dict(self, event: "NanEvent") -> dict[str, Any]:
        return {**event.to_dict(), "title": event.title(self.line_label(event))}

    def line_label(self, event: "NanEvent") -> str:
        """``line 3`` in the watched cell, ``In [2], line 3`` in another, ``model.py, line 3`` in a file."""
        cell = dict(self.cells).get(event.filename or "")
        return line_label(event.lineno or 0, event.filename, cell, self.cell)

    @property
    def first(self) -> Optional[NanEvent]:
        return self.events[0] if self.events else None

    @property
    def module_calls(self) -> int:
        """Module calls whose outputs were checked (the layer table's calls)."""
        return sum(layer.calls for layer in self.layers)

    def checked(self, sep: str = "") -> str:
        """What was checked, in words: ``"12 ops checked"``, ``"0 ops and 19 module calls checked"`` (with
        replay or in module mode a model's ops are covered by its module calls). ``sep``: "," for thousands."""
        calls = self.module_calls
        ops = f"{self.ops_checked:{sep}} op{'' if self.ops_checked == 1 else 's'}"
        return ops + (f" and {calls:{sep}} module call{'' if calls == 1 else 's'}" if calls else "") + " checked"

    def to_dict(self) -> dict[str, Any]:
        return {
            "events": [self._event_dict(e) for e in self.events],
            "absorbed": [self._event_dict(e) for e in self.absorbed],
            "layers": [layer.to_dict() for layer in self.layers],
            "mode": self.mode,
            "ops_seen": self.ops_seen,
            "ops_checked": self.ops_checked,
            "dropped": self.dropped,
            "notes": list(self.notes),
            "cell_filename": self.cell_filename,
            "cell_source": self.cell_source,
            "source_first_line": self.source_first_line,
            "sources": {name: {"first_line": first, "text": text} for name, first, text in self.sources},
            "options": dict(self.options),
            "cell": self.cell,
            "cells": {name: number for name, number in self.cells},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "NanSummary":
        """The summary :meth:`to_dict` wrote: ``NanSummary.from_dict(s.to_dict()) == s``."""
        return cls(events=tuple(NanEvent.from_dict(e) for e in data.get("events", ())),
                   absorbed=tuple(NanEvent.from_dict(e) for e in data.get("absorbed", ())),
                   layers=tuple(LayerStats.from_dict(layer) for layer in data.get("layers", ())),
                   mode=data.get("mode", "op"), ops_seen=data.get("ops_seen", 0),
                   ops_checked=data.get("ops_checked", 0), dropped=data.get("dropped", 0),
                   notes=tuple(data.get("notes", ())), cell_filename=data.get("cell_filename"),
                   cell_source=data.get("cell_source", ""), source_first_line=data.get("source_first_line", 1),
                   sources=tuple((name, s["first_line"], s["text"]) for name, s in (data.get("sources") or {}).items()),
                   options=dict(data.get("options") or {}))
