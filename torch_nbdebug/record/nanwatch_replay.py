"""Pinpoint by replay: re-run one module call under the per-op watch when its output went non-finite.

With ``replay=True`` the per-op dispatch mode is off while a model's forward runs; the cheap module
layer (:mod:`nanwatch_kept`) keeps each module call's output, arguments, the RNG state it started
with and the arguments' ``_version``. When the kept output is non-finite, :func:`replay_call` runs
that call again, with the same arguments and parameters (the check runs before ``optimizer.step``
changes them) and the same RNG state, under the per-op watch, so the event names the op and line the
always-on watch would. The replay changes nothing of the user's: the RNG streams are put back,
buffers (BatchNorm's running statistics) are restored, no backward runs (no ``.grad``), and the
replay's outputs are dropped. When the arguments were changed in place since the call, the replay
is not attempted; the caller then reports at module level and says why.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from torch_nbdebug.record import compat
from torch_nbdebug.record import nanwatch_ops as ops
from torch_nbdebug.record.nanwatch_events import here
from torch_nbdebug.record.source import line_of
from torch_nbdebug.record.nanwatch_ops import propagating_sum


@dataclass
class Call:
    """What a replay needs of one module call (references: dropped with the kept entry)."""

    args: tuple
    kwargs: dict
    versions: tuple[int, ...]  # of ``tensors``, when the call started
    tensors: tuple[torch.Tensor, ...]
    rng: Optional[torch.Tensor]
    cuda_rng: Optional[list[torch.Tensor]]
    grad_enabled: bool
    seq: Optional[int] = None  # the autograd sequence number when the call started

    def changed(self) -> bool:
        """An argument was written in place after the call: a replay would see other values."""
        return any(ops.version_of(t) != v for t, v in zip(self.tensors, self.versions))


def rng_state() -> tuple[torch.Tensor, Optional[list[torch.Tensor]]]:
    """The CPU generator's state (a 5 KB copy, under a microsecond) and CUDA's when CUDA is in use."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


Start = tuple[tuple[torch.Tensor, Optional[list[torch.Tensor]]], tuple[int, ...], int]  # RNG, versions, seq


def call_start(args: Any) -> Start:
    """Taken in the forward pre-hook: the RNG state and the positional tensors' versions."""
    versions = tuple(ops.version_of(t) for t in args if isinstance(t, torch.Tensor)) \
        if isinstance(args, tuple) else ()
    return rng_state(), versions, compat.next_sequence_nr()


def capture(args: tuple, kwargs: dict, start: Optional[Start]) -> Call:
    """The call as the exit hook sees it; versions from its start (a forward that wrote its own input
    in place cannot be replayed)."""
    tensors = tuple(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor))
    versions = tuple(ops.version_of(t) for t in tensors)
    rng: tuple[Optional[torch.Tensor], Optional[list[torch.Tensor]]] = (None, None)
    seq = None
    if start is not None:
        rng, before, seq = start
        versions = before + versions[len(before):]
    return Call(tuple(args), dict(kwargs), versions, tensors, rng[0], rng[1], torch.is_grad_enabled(), seq)


def replay_call(module: torch.nn.Module, call: Call, watched: Callable[[], Any]) -> None:
    """Run ``module(*args, **kwargs)`` again inside ``watched()`` (a context that puts the per-op
    watch on); the user's RNG streams, buffers and grad mode are as before afterwards."""
    with _restored_rng(call), _restored_buffers(module), _grad_mode(call.grad_enabled), watched():
        module(*call.args, **call.kwargs)


@contextlib.contextmanager
def _grad_mode(enabled: bool) -> Iterator[None]:
    """The call's grad mode, set inside the try (``torch.set_grad_enabled`` sets it on construction,
    before its ``with`` protects it: a Stop landing there would leave it changed)."""
    before = torch.is_grad_enabled()
    try:
        torch.set_grad_enabled(enabled)
        yield
    finally:
        torch.set_grad_enabled(before)


@contextlib.contextmanager
def _restored_rng(call: Call) -> Iterator[None]:
    now_cpu, now_cuda = rng_state()
    try:
        if call.rng is not None:
            torch.set_rng_state(call.rng)
        if call.cuda_rng is not None:
            torch.cuda.set_rng_state_all(call.cuda_rng)
        yield
    finally:
        torch.set_rng_state(now_cpu)
        if now_cuda is not None:
            torch.cuda.set_rng_state_all(now_cuda)


@contextlib.contextmanager
def _restored_buffers(module: torch.nn.Module) -> Iterator[None]:
    """BatchNorm's running mean/var and batch counter (any buffer) are put back after the replay."""
    saved = [(b, b.detach().clone()) for b in module.buffers() if isinstance(b, torch.Tensor)]
    try:
        yield
    finally:
        with torch.no_grad():
            for buf, value in saved:
                buf.copy_(value)


NOT_REPLAYED = ("{module}: replay not possible ({why}); reported at module level")


class Replayer:
    """Turns a non-finite kept module output into the per-op event of its first bad op.

    ``watched`` is the recorder's context that puts the per-op watch on for a replay (and keeps the
    module layer out of it); ``fallback(entry)`` reports the call at module level."""

    def __init__(self, ctx: Any, watched: Callable[[], Any], fallback: Callable[[Any], None]) -> None:
        self.ctx, self._watched, self._fallback = ctx, watched, fallback
        self.notes: list[str] = []
        self.replays = 0

    def birth(self, entry: Any) -> None:
        """``entry`` (a forward :class:`~nanwatch_kept.Kept`) came out non-finite: find who made it."""
        log, path = self.ctx.log, entry.paths[0]
        if any(e.module and (e.module == path or e.module.startswith(path + ".")) for e in log.events):
            return  # an inner call's birth, replayed already: this output only carries it
        if log.has_events() and any(ops.has_nan(x) for x in entry.inputs if not _finite(x)):
            return  # an earlier birth's NaN flowing through (an Inf turning into a NaN is replayed)
        call: Optional[Call] = entry.call
        why = ("its arguments were not kept" if call is None
               else "its arguments were changed in place after the call" if call.changed()
               else "it has hooks of its own, which a replay would run again" if compat.module_hooks_in(entry.module)
               else "")
        before = len(log.events)
        if not why:
            self.replays += 1
            probe, seq = user_line(), compat.next_sequence_nr()
            try:
                replay_call(entry.module, call, lambda: self._watched(entry.iteration))  # type: ignore[arg-type]
            except Exception as exc:  # noqa: BLE001 - the module-level answer stands (unless it found the op)
                if len(log.events) == before:
                    why = f"the replay raised {type(exc).__name__}: {exc}"
        if not why:
            shift = call.seq - seq if call.seq is not None else None
            relocate(log.events, before, probe, entry.place, shift)
            if shift is not None:
                log.renumber(before, shift)
            if len(log.events) > before:
                return
            why = "the replay stayed finite (randomness or state outside the call, or nondeterminism)"
        self._fallback(entry)
        if len(log.events) > before and len(self.notes) < 3:
            self.notes.append(NOT_REPLAYED.format(module=path, why=why))


def _finite(t: torch.Tensor) -> bool:
    with torch.no_grad():
        return bool(torch.isfinite(propagating_sum(t)))


def user_line() -> tuple[Optional[str], Optional[int]]:
    place = here(None, None)
    return place.filename, place.lineno


def relocate(events: list, start: int, probe: tuple[Optional[str], Optional[int]], place: Any,
              seq_shift: Optional[int]) -> None:
    """Events of a replayed library module carry the line the replay ran from: give them the line of
    the original call (a module whose forward is the user's own code keeps its own line); their
    autograd sequence numbers are moved to the original call's (same ops in the same order)."""
    for i in range(start, len(events)):
        event = events[i]
        if (event.filename, event.lineno) == probe and place is not None:
            event = at_place(event, place)
        if event.sequence_nr is not None:
            event = dataclasses.replace(event, sequence_nr=event.sequence_nr + seq_shift if seq_shift is not None
                                        else None)
        events[i] = event


def at_place(event: Any, place: Any) -> Any:
    """``event`` moved to ``place``'s line (the source text too)."""
    text = line_of(place.filename, place.lineno, place.function).text if place.filename and place.lineno else ""
    return dataclasses.replace(event, filename=place.filename, lineno=place.lineno, function=place.function,
                               line=text)


def with_forward(event: Any, place: Any) -> Any:
    """A backward birth given the forward op, module and line a replay found for its node."""
    event = dataclasses.replace(event, forward_op=str(place.op) if place.op is not None else None,
                                forward_module=place.module, forward_lineno=place.lineno)
    if event.cause == "user_backward":  # the user's own backward code keeps its line
        return event
    return dataclasses.replace(at_place(event, place), module=place.module)


class ModelCalls:
    """The outermost module calls since the last optimizer step (arguments, RNG state, autograd sequence
    range): a backward birth inside one is given its forward op and line by replaying that forward."""

    def __init__(self, limit: int = 8) -> None:
        self.calls: list[tuple[torch.nn.Module, Call, int, Any]] = []
        self._limit = limit

    def add(self, module: torch.nn.Module, call: Call, end: int, place: Any) -> None:
        """``end``: the sequence number after the call; ``place``: the user's line that made it."""
        if call.seq is not None and call.grad_enabled:
            self.calls = self.calls[-(self._limit - 1):] + [(module, call, end, place)]

    def clear(self) -> None:
        self.calls = []
