"""Where an op ran (:class:`Site`) and how a verdict becomes a :class:`NanEvent`, for both check paths.

The immediate and the deferred path build the same :class:`Site` for an op (the deferred one when
it queues the op, the immediate one when its check flags) and the same event from it.
"""
from __future__ import annotations

import sys
import types
from typing import Any, NamedTuple, Optional

import torch

from torch_nbdebug.data.nanwatch import Kind, NanEvent
from torch_nbdebug.data.stats import TensorStats
from torch_nbdebug.record.compat import node_sequence_nr
from torch_nbdebug.record.nanwatch.core.live import LiveRef
from torch_nbdebug.record.nanwatch.core.rules import OpPhase, Verdict
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


class Site(NamedTuple):
    """An op and where it ran: the op's forward place, its autograd node in backward."""

    phase: OpPhase
    op: str  # the ATen overload
    place: Place
    seq: Optional[int] = None  # autograd sequence nr: the node made in forward, or the running node
    node: Optional[str] = None  # the running autograd node's name (backward)
    forward_op: Optional[str] = None
    forward: Optional[Place] = None  # backward: where the node was made in forward
    user_backward: bool = False  # backward: run by the user's own backward code (place is that line)


def forward_site(module: Optional[str], func: Any, seq: Optional[int], start: types.FrameType) -> Site:
    return Site("forward", str(func), here(module, func, start), seq)


def backward_site(node: Any, func: Any, forward: Optional[Place], start: types.FrameType) -> Site:
    """The node's forward place, or the user's own backward line when their code runs the op."""
    # No forward place (AccumulateGrad, a node made before the watch): the line that ran backward().
    place = forward if forward is not None else here(None, None, start)
    mine = user_backward_frame(start)
    if mine is not None:
        place = Place(place.op, place.module, mine.f_code.co_filename, mine.f_lineno, mine.f_code.co_name)
    fwd_op = str(forward.op) if forward is not None and forward.op is not None else None
    return Site("backward", str(func), place, node_sequence_nr(node), node.name(), fwd_op, forward, mine is not None)


def producer(t: Any) -> Optional[str]:
    """The autograd node that made ``t`` (``ClampMinBackward0``), if it has one."""
    fn = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else t
    return fn.name() if fn is not None else None


def node_input_producer(node: Any) -> Optional[str]:
    """The node that made a backward node's first forward input (``sqrt(x.clamp(0))``: the clamp)."""
    for fn, _ in node.next_functions:
        if fn is not None:
            return fn.name()
    return None


def site_event(site: Site, verdict: Verdict, inputs: tuple[TensorStats, ...], output: Optional[TensorStats],
               kind: Kind, iteration: int, **extra: Any) -> NanEvent:
    """The event for a judged op (``verdict`` is birth or input)."""
    if site.phase == "backward" and verdict == "birth":
        fwd = site.forward
        if site.user_backward:
            extra.update(detail=USER_BACKWARD, cause="user_backward")
        return make_event("backward", site.node or site.op, site.place, inputs, output, kind=kind,
                          iteration=iteration, aten_op=site.op, node_name=site.node, sequence_nr=site.seq,
                          forward_op=site.forward_op, forward_module=fwd.module if fwd is not None else None,
                          forward_lineno=fwd.lineno if fwd is not None else None, **extra)
    if site.node is not None:
        extra.update(node_name=site.node)
    phase = "input" if verdict == "input" else "forward"
    return make_event(phase, site.op, site.place, inputs, output, kind=kind, iteration=iteration,
                      aten_op=site.op, sequence_nr=site.seq, **extra)


def kind_of(stats: list[TensorStats]) -> Kind:
    return "nan" if any(s.nan for s in stats) else "inf"


def stats_of(tensors: list[torch.Tensor], limit: int = 4) -> tuple[TensorStats, ...]:
    return tuple(summarize(t) for t in tensors[:limit])


def make_event(phase: str, op: str, place: Place, inputs: tuple[TensorStats, ...], output: Optional[TensorStats],
               *, kind: Kind, iteration: int, **extra: Any) -> NanEvent:
    """A :class:`NanEvent` at ``place`` (hints are added later by the process layer)."""
    line, function = "", place.function
    if place.filename is not None and place.lineno is not None:
        src = line_of(place.filename, place.lineno, place.function)
        line = src.text
    return NanEvent(phase=phase, op=op, kind=kind,  # type: ignore[arg-type]
                    module=place.module, filename=place.filename,
                    lineno=place.lineno, line=line, function=function, inputs=inputs, output=output,
                    iteration=iteration, **extra)


class Shape(NamedTuple):
    """What a deferred check keeps of a tensor until its flags are read: no data, no strong reference.

    ``held`` is a :class:`~torch_nbdebug.record.nanwatch.core.live.LiveRef`: if the tensor is still alive
    and unchanged when the flags are read, its exact statistics are taken then.
    """

    shape: tuple[int, ...]
    dtype: str
    device: str
    numel: int
    held: Optional[LiveRef] = None

    @classmethod
    def of(cls, t: torch.Tensor) -> "Shape":
        return cls(tuple(int(s) for s in t.shape), str(t.dtype).replace("torch.", ""), str(t.device), t.numel(),
                   LiveRef.of(t))

    def live(self) -> Optional[torch.Tensor]:
        """The tensor, if it is alive and still holds the values the op saw."""
        return self.held.get() if self.held is not None else None

    def stats(self, nan: bool, inf: bool, neg: bool = False) -> TensorStats:
        """Exact statistics of the live, unchanged tensor, else what the flags say (``neg``: -inf)."""
        t = self.live()
        if t is not None:
            return summarize(t)
        return TensorStats(shape=self.shape, dtype=self.dtype, device=self.device, numel=self.numel,
                           nan=int(nan), inf=int(inf), neg_inf=int(inf and neg),
                           note="deferred check on the device: at least one; exact counts were not kept")


def birth_message(event: NanEvent) -> str:
    """The NanBirthError text: what, where (the user's line), and how to look further."""
    where = f"line {event.lineno} of {event.filename}" if event.lineno is not None else "an unknown line"
    text = f"{event.title()}\n  at {where}"
    if event.line:
        text += f": {event.line}"
    if event.output is not None:
        text += f"\n  output: {event.output.brief()}"
    return text + "\n  (the full report is in the error's .report and, in a notebook, in _nanwatch)"
