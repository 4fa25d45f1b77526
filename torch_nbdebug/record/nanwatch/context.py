"""What the recorder's components get from it: options, the event log, the clock, and a few services.

Components (module checks, optimizer watch, GradScaler/cast checks, the immediate and the deferred
op checks) receive a :class:`WatchContext` and use only what it declares, never the recorder's
private attributes.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Literal, Mapping, Optional, Protocol, Sequence

from torch_nbdebug.data.nanwatch import Kind, NanEvent
from torch_nbdebug.errors import NanBirthError
from torch_nbdebug.data.stats import TensorStats
from torch_nbdebug.record.compat import node_sequence_nr
from torch_nbdebug.record.nanwatch.core.rules import OpPhase, Verdict
from torch_nbdebug.record.nanwatch.core.events import Place, Site, backward_site, forward_site, site_event
from torch_nbdebug.record.nanwatch.core.layers import Later
from torch_nbdebug.record.nanwatch.core.log import EventLog
from torch_nbdebug.record.nanwatch.core.params import carriers
from torch_nbdebug.record.nanwatch.core.storage import StorageRegistry
from torch_nbdebug.record.nanwatch.replay.forward import ModelCalls


Mode = Literal["op", "module"]


@dataclass(frozen=True)
class WatchOptions:
    mode: Mode = "op"
    backward: bool = True
    optimizer: bool = True
    ignore_inf: bool = False
    raise_on_birth: bool = False
    defer: bool = False
    max_events: int = 50
    replay: bool = False  # op mode: per-op watch off inside modules in forward, births there replayed


def uses_replay(replay: bool, mode: Mode, defer: bool, raise_on_birth: bool) -> bool:
    """Whether a watch asked for ``replay`` replays: it needs op mode, the immediate path (CPU) and no raising
    at the op (the check comes after the call)."""
    return replay and mode == "op" and not defer and not raise_on_birth


class Clock:
    """The 1-based iteration: a forward after a backward starts the next one. ``starts`` also says how many
    optimizer steps had completed when each iteration began (a step of several forward/backward passes,
    gradient accumulation, is still one step)."""

    __slots__ = ("iteration", "saw_backward", "steps", "starts")

    def __init__(self) -> None:
        self.iteration = 1
        self.saw_backward = False
        self.steps = 0
        self.starts: list[tuple[int, int]] = [(1, 0)]  # (iteration, optimizer steps completed before it)

    def forward(self) -> None:
        if self.saw_backward:
            self.saw_backward = False
            self.iteration += 1

    def stepped(self) -> None:
        """An optimizer step of the watched thread completed: the next iteration starts after it (an
        optimizer's own ops may already have moved the clock when its post-hook runs)."""
        self.steps += 1
        nxt = self.iteration + (1 if self.saw_backward else 0)
        if nxt > self.starts[-1][0]:
            self.starts.append((nxt, self.steps))


class LrGrowth(Protocol):
    def growth(self) -> Optional[tuple[float, int]]:
        """(learning rate, optimizer step) when the learning rate grew a lot during the watch."""


class WatchContext(Protocol):
    options: WatchOptions
    log: EventLog
    clock: Clock
    produced: StorageRegistry
    namespace: Optional[Mapping[str, Any]]

    @property
    def lr(self) -> LrGrowth: ...

    def module_path(self) -> Optional[str]: ...

    def forward_place(self, seq: int) -> Optional[Place]: ...

    def quiet(self) -> ContextManager[None]: ...

    def internal_error(self, where: str, exc: Exception) -> None: ...

    def flush(self, extra: Sequence[Any] = ()) -> list[list[float]]:
        """Read everything waiting on the device and ``extra`` (tensors) at once; ``extra``'s values."""

    def keep_handle(self, handle: Any) -> None:
        """A hook on a tensor or an autograd node: removed when the watch stops."""

    def rounded_constant(self, iteration: int, module: Optional[str]) -> Optional[float]:
        """A constant (an eps) that a half-precision op in this iteration and module rounded to 0."""


def op_site(ctx: WatchContext, func: Any, phase: OpPhase, node: Any, seq: Optional[int],
            frame: types.FrameType) -> Site:
    """Where an op runs: its module and line in forward, its node and forward line in backward."""
    if phase == "backward":
        return backward_site(node, func, ctx.forward_place(node_sequence_nr(node)), frame)
    site = forward_site(ctx.module_path(), func, seq, frame)
    if node is not None:  # a forward op run by backward code (double backward, a checkpoint)
        site = site._replace(node=node.name(), seq=node_sequence_nr(node))
    return site


INPLACE = "in-place op: its input was overwritten by the result"


def shown_inputs(verdict: Verdict, in_bad: list[bool], inplace: bool) -> tuple[list[int], str]:
    """Which inputs an event shows, and a note: the culprits first for input data; an in-place op's
    input holds its result now, so only the other inputs."""
    if verdict == "input":
        return [i for i, b in enumerate(in_bad) if b][:2] + [i for i, b in enumerate(in_bad) if not b][:2], ""
    start = 1 if inplace else 0
    return list(range(start, len(in_bad)))[:4], INPLACE if inplace else ""


def report_op(ctx: WatchContext, site: Site, verdict: Verdict, kind: Kind, inputs: tuple[TensorStats, ...],
              output: Optional[TensorStats], culprit_keys: list[Optional[int]], input_op: Optional[str],
              iteration: int, deferred: bool, detail: str = "") -> Optional[NanEvent]:
    """Turn a judged op into its event (both check paths): None when ``ignore_inf`` drops it.

    The caller hands a forward birth to the log, and holds a backward birth until its node finishes."""
    if ctx.options.ignore_inf and kind == "inf":
        return None
    extra: dict[str, Any] = dict(deferred=deferred, input_op=input_op)
    if detail:
        extra.update(detail=detail)
    if verdict == "input":
        extra.update(carriers(ctx.namespace, culprit_keys).fields())
    if output is not None and output.dtype in ("float16", "bfloat16"):  # an eps the dtype cannot hold
        eps = ctx.rounded_constant(iteration, site.place.module)
        if eps is not None:
            extra.update(eps=eps)
    grown = ctx.lr.growth() if kind == "inf" else None
    if grown is not None:
        extra.update(lr=grown[0], lr_step=grown[1])
    return site_event(site, verdict, inputs, output, kind, iteration, **extra)


class NodeChecks(Protocol):
    """What a backward-node hook needs of the immediate or the deferred checks."""

    ctx: "WatchContext"

    def node_done(self, key: int, grad_inputs: Any) -> None: ...


class NodeDone:
    """Autograd node post hook, for both paths: hands the gradients the node produced to its checks
    (returns None, so the gradients are unchanged; our own failures are noted, never raised)."""

    __slots__ = ("checks", "key")

    def __init__(self, checks: NodeChecks, key: int) -> None:
        self.checks, self.key = checks, key

    def __call__(self, grad_inputs: Any, grad_outputs: Any) -> None:
        try:
            self.checks.node_done(self.key, grad_inputs)
        except NanBirthError:
            raise
        except Exception as exc:  # noqa: BLE001 - a debugging aid must not change the program
            self.checks.ctx.internal_error("a backward node's gradients", exc)


class ModuleQueue(Protocol):
    """The deferred path's queue as module mode uses it: module outputs and gradients into them, flagged by
    the per-layer table's reading (``DeferredChecks``)."""

    def queue_module(self, path: str, module: Any, args: Any, t: Any, reading: Later,
                     coming_in: Callable[[list[Any]], tuple[bool, ...]]) -> None: ...

    def queue_grad(self, path: str, grad: Any, reading: Later) -> None: ...


class OpExaminer(Protocol):
    """The immediate per-op check, as replay's backward runs an accumulation through it."""

    def examine(self, func: Any, args: tuple, kwargs: dict, bad: list[Any], phase: OpPhase, node: Any,
                pre: Optional[Any], seq: Optional[int]) -> None: ...


class ModuleReports(Protocol):
    """The module-level reports (``ModuleVerdicts``) replay falls back to when no replay names the op."""

    def module_fallback(self, entry: Any, first: int = 0) -> None: ...

    def module_birth(self, path: str, module: Any, args: Any, t: Any, place: Optional[Place] = None,
                     iteration: Optional[int] = None, first: int = 0) -> bool: ...

    def gradient_birth(self, path: str, grad: Optional[TensorStats], iteration: int) -> None: ...


class ThreadState(Protocol):
    """The watching thread (``WatchThread``), as replay's backward reads it."""

    @property
    def thread_id(self) -> int: ...

    @property
    def replaying(self) -> bool: ...


class ModeControl(Protocol):
    """The per-op mode as replay's backward switches it (``ModeSwitch``): whether it is on the dispatch stack
    (on top), and taking it off and back for a rerun or an unwatched backward."""

    def on_top(self) -> bool: ...

    def on_stack(self) -> bool: ...

    def pop(self) -> None: ...

    def push(self) -> None: ...


class ReplayHost(WatchContext, Protocol):
    """What replay's backward layer (``replay/backward.py``, ``replay/calls.py``) may touch of the recorder:
    the per-op mode (whether it is on, taking it off and back for a rerun), a replay's own isolated log, the
    watch's own hook ids, the immediate check, the watching thread, the model calls kept for replay and the
    module-level reports."""

    @property
    def immediate(self) -> OpExaminer: ...

    @property
    def thread(self) -> ThreadState: ...

    @property
    def model_calls(self) -> ModelCalls: ...

    @property
    def verdicts(self) -> ModuleReports: ...

    @property
    def switch(self) -> ModeControl: ...

    def watched(self, iteration: int) -> ContextManager[None]: ...

    def isolated(self, carry: bool = True) -> ContextManager[tuple[EventLog, dict[int, Place]]]: ...

    def own_hook_ids(self) -> set[int]: ...
