"""Build :class:`NanEvent` records from live tensors (only when a check flagged: precise stats here)."""
from __future__ import annotations

import sys
import types
from typing import Any, NamedTuple, Optional

import torch

from torch_nbdebug.data.nanwatch import NanEvent
from torch_nbdebug.data.stats import TensorStats
from torch_nbdebug.record.source import is_user_code, line_of, user_frame
from torch_nbdebug.record.stats import summarize


class Place(NamedTuple):
    """Where a forward op ran: kept per autograd node so a backward birth can name its forward line."""

    op: Any
    module: Optional[str]
    filename: Optional[str]
    lineno: Optional[int]
    function: str


def here(module: Optional[str], op: Any, start: Optional[types.FrameType] = None) -> Place:
    """The user's current line (cheap: a cached walk up the stack) with the running module."""
    frame = user_frame(start if start is not None else sys._getframe(1))
    if frame is None:
        return Place(op, module, None, None, "<module>")
    return Place(op, module, frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


USER_BACKWARD = "made by your own backward code (a custom autograd.Function backward or a tensor hook)"


def user_backward_frame(start: Optional[types.FrameType]) -> Optional[types.FrameType]:
    """The user's frame running *inside* the autograd engine (a custom Function's backward, a hook),
    or None when the engine runs a built-in formula (then the forward line is the place to show)."""
    frame = start
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_engine_run_backward":
            return None
        if is_user_code(code):
            return frame
        frame = frame.f_back
    return None


def kind_of(stats: list[TensorStats]) -> str:
    return "nan" if any(s.nan for s in stats) else "inf"


def stats_of(tensors: list[torch.Tensor], limit: int = 4) -> tuple[TensorStats, ...]:
    return tuple(summarize(t) for t in tensors[:limit])


def make_event(phase: str, op: str, place: Place, inputs: tuple[TensorStats, ...], output: Optional[TensorStats],
               *, kind: str, iteration: int, **extra: Any) -> NanEvent:
    """A :class:`NanEvent` at ``place`` (hints are added later by the process layer)."""
    line, function = "", place.function
    if place.filename is not None and place.lineno is not None:
        src = line_of(place.filename, place.lineno, place.function)
        line = src.text
    return NanEvent(phase=phase, op=op, kind=kind, module=place.module, filename=place.filename,
                    lineno=place.lineno, line=line, function=function, inputs=inputs, output=output,
                    iteration=iteration, **extra)


class Shape(NamedTuple):
    """What a deferred check keeps of a tensor until its flags are read: no data, no reference."""

    shape: tuple[int, ...]
    dtype: str
    device: str
    numel: int

    @classmethod
    def of(cls, t: torch.Tensor) -> "Shape":
        return cls(tuple(int(s) for s in t.shape), str(t.dtype).replace("torch.", ""), str(t.device), t.numel())

    def stats(self, nan: bool, inf: bool) -> TensorStats:
        return TensorStats(shape=self.shape, dtype=self.dtype, device=self.device, numel=self.numel,
                           nan=int(nan), inf=int(inf),
                           note="deferred check on the device: at least one; exact counts were not kept")
