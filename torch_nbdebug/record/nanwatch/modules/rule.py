"""Module mode's one rule: what a module call saw (its inputs, what the log held) -> its verdict.

Both paths judge a non-finite module output with it: the immediate one as the module exits
(``ModuleVerdicts.module_birth``), the deferred one when its queued check is read (``DeferredChecks``).
:func:`judge_module_call` is pure and tested on hand-built facts, as ``judge`` is at op level;
:class:`LeftAt` keeps the one piece of state the rule reads across calls.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Literal, NamedTuple, Optional, Sequence

import torch

from torch_nbdebug.data.nanwatch import Kind, NanEvent
from torch_nbdebug.data.stats import TensorStats
from torch_nbdebug.record.nanwatch.context import WatchContext
from torch_nbdebug.record.nanwatch.core.events import Place, make_event
from torch_nbdebug.record.nanwatch.core.log import EventLog
from torch_nbdebug.record.nanwatch.core.params import bad_parameters, carriers
from torch_nbdebug.record.nanwatch.core.rules import Verdict, judge_module
from torch_nbdebug.record.tensors import storage_key

# "left": the inputs were made by an enclosing module's own code (no op is watched between submodules in
# module mode): the enclosing module is judged as it returns, not this one.
ModuleVerdict = Literal["birth", "input", "propagation", "left"]


class ModuleCall(NamedTuple):
    """What a module call with a non-finite output saw. ``in_bad``: which float inputs are non-finite;
    ``coming_in``: which inputs are data coming in (None: all of them, nothing is left to an enclosing
    module); ``inner``: a submodule already reported; ``had_events``: anything reported before;
    ``params_bad``: asked only when it decides (a walk over the module's weights)."""

    in_bad: tuple[bool, ...]
    coming_in: Optional[tuple[bool, ...]]
    inner: bool
    had_events: bool
    params_bad: Callable[[], bool]


def judge_module_call(call: ModuleCall) -> ModuleVerdict:
    """Non-finite inputs that are none of them data coming in, before any birth: left to the enclosing
    module. Else :func:`~torch_nbdebug.record.nanwatch.core.rules.judge_module`."""
    in_bad = any(call.in_bad)
    if in_bad and call.coming_in is not None and not call.inner and not call.had_events and \
            not any(b and c for b, c in zip(call.in_bad, call.coming_in)):
        return "left"
    params_bad = not call.inner and not in_bad and call.params_bad()
    return judge_module(True, in_bad, params_bad, call.had_events, call.inner)


class LeftAt:
    """Module path -> the log's mark when a submodule left the module its non-finite inputs."""

    def __init__(self) -> None:
        self._at: dict[str, int] = {}

    def seen(self, log: EventLog, path: str, first: int) -> tuple[bool, bool]:
        """(a submodule already reported, any event before) for the module at ``path``: as they were when a
        submodule left it its non-finite inputs, if one did (a later, independent birth in a sibling must
        not make this module's own one a propagation), else as they are now; ``first``: the log's mark
        when the check began."""
        cut = self._at.pop(path, None)
        events = log.events[first:cut] if cut is not None else log.since(first)
        inner = any(e.module and e.module.startswith(path + ".") for e in events)
        had_events = (cut > 0 or log.dropped > 0) if cut is not None else log.has_events()
        return inner, had_events

    def leave(self, log: EventLog, path: str) -> None:
        self._at.setdefault(path.rpartition(".")[0], log.mark())

    def clear(self) -> None:
        self._at.clear()


def judge_call(left: LeftAt, log: EventLog, path: str, first: int, in_bad: Sequence[bool],
               coming_in: Optional[Sequence[bool]], module: torch.nn.Module) -> ModuleVerdict:
    """The rule for the module at ``path``, with what the log and ``left`` know; a call left to its
    enclosing module is noted in ``left``."""
    inner, had_events = left.seen(log, path, first)
    verdict = judge_module_call(ModuleCall(tuple(in_bad), None if coming_in is None else tuple(coming_in), inner,
                                           had_events, lambda: bool(bad_parameters(module))))
    if verdict == "left":
        left.leave(log, path)
    return verdict


def module_event(ctx: WatchContext, place: Place, op: str, verdict: Verdict, inputs: tuple[TensorStats, ...],
                 output: TensorStats, kind: Kind, module: torch.nn.Module, inputs_bad: bool,
                 iteration: int) -> NanEvent:
    """A module-mode event; a non-finite weight (with finite inputs) is named as the carrier."""
    event = make_event("input" if verdict == "input" else "forward", op, place, inputs, output, kind=kind,
                       iteration=iteration)
    if verdict == "input" and not inputs_bad:
        params = bad_parameters(module)
        if params:
            event = dataclasses.replace(event, **carriers(ctx.namespace, [storage_key(p) for p in params]).fields())
    return event
