"""Pinpoint by replay: re-run one module call under the per-op watch when its output went non-finite.

With ``replay=True`` the per-op dispatch mode is off while a model's forward runs; the cheap module
layer (:mod:`replay.kept`) keeps each module call's output, arguments, the RNG state it started
with and the arguments' ``_version``. When the kept output is non-finite, :func:`replay_call` runs
that call again, with the same arguments and parameters (the check runs before ``optimizer.step``
changes them) and the same RNG state, under the per-op watch, so the event names the op and line the
always-on watch would. The replay changes nothing of the user's: the RNG streams are put back,
it runs on clones of the buffers (BatchNorm's running statistics; the user's are never written, so
autograd's version checks still pass), the modules' plain attributes (counters, lists) are put back,
no backward runs (no ``.grad``), autocast is as it was in the call, and the replay's outputs are
dropped. When the arguments were changed in place since the call, or one is an object the call may
update (a KV cache), or a hook would run again, the replay is not attempted; the caller then reports
at module level and says why. A birth in a model's backward is replayed the same way, forward and
backward together (:mod:`replay.calls`, with :func:`replay_context`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Collection, ContextManager, Iterator, Optional, Protocol

import torch

from torch_nbdebug.data.nanwatch import NanEvent
from torch_nbdebug.record import compat
from torch_nbdebug.record.nanwatch.core import ops
from torch_nbdebug.record.nanwatch.core.events import here
from torch_nbdebug.record.nanwatch.core.live import LiveRef
from torch_nbdebug.record.nanwatch.core.log import EventLog
from torch_nbdebug.record.nanwatch.core.params import bad_parameters
from torch_nbdebug.record.nanwatch.replay.restore import (autocast_as, grad_mode, restored_attributes, restored_buffers,
                                                          restored_rng)
from torch_nbdebug.record.source import line_of


@dataclass(slots=True)
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

    refs: bool = False  # args, kwargs and tensors hold weak references (see ``weakened``)
    autocast: tuple = ()  # compat.autocast_state() when the call ran: the replay runs under the same
    params: Optional[tuple[int, ...]] = None  # the module's parameter versions (ModelCalls.add)
    parameters: tuple[torch.Tensor, ...] = ()  # the module's parameters, in order (ModelCalls.add)

    def with_parameters(self, parameters: tuple[torch.Tensor, ...]) -> "Call":
        """The call with the module's parameters and their versions now (:meth:`ModelCalls.add`): a new
        object, the kept entry's own is unchanged (``dataclasses.replace`` costs ten times as much)."""
        return type(self)(self.args, self.kwargs, self.versions, self.tensors, self.rng, self.cuda_rng,
                          self.grad_enabled, self.seq, self.refs, self.autocast, versions_of(parameters), parameters)

    def params_changed(self, parameters: tuple[torch.Tensor, ...]) -> bool:
        """A weight was updated (a manual ``p -= lr * p.grad``) since the call: a replay computes other values.
        ``parameters``: the module's parameters now (:func:`parameters_of`)."""
        return self.params is not None and self.params != versions_of(parameters)

    def changed(self) -> bool:
        """An argument was written in place after the call: a replay would see other values."""
        return any(ops.version_of(t) != v for t, v in zip(self.tensors, self.versions))

    def weakened(self) -> "Call":
        """The call with its tensors (in lists, tuples and dicts too) held by weak reference: a no-grad
        call keeps nothing alive (:meth:`resolved` gives them back while they live)."""
        return dataclasses.replace(self, args=_weak(self.args), kwargs=_weak(self.kwargs),
                                   tensors=_weak(self.tensors), refs=True)

    def resolved(self) -> Optional["Call"]:
        """The call with strong references again; None when one of its tensors was freed."""
        if not self.refs:
            return self
        try:
            return dataclasses.replace(self, args=_strong(self.args), kwargs=_strong(self.kwargs),
                                       tensors=_strong(self.tensors), refs=False)
        except _Freed:
            return None


class _Freed(Exception):
    pass


def _weak(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return LiveRef(value)
    if type(value) in (list, tuple):
        return type(value)(_weak(v) for v in value)
    if type(value) is dict:
        return {k: _weak(v) for k, v in value.items()}
    return value


def _strong(value: Any) -> Any:
    if isinstance(value, LiveRef):
        t = value.alive()
        if t is None:
            raise _Freed
        return t
    if type(value) in (list, tuple):
        return type(value)(_strong(v) for v in value)
    if type(value) is dict:
        return {k: _strong(v) for k, v in value.items()}
    return value


Start = tuple[tuple[torch.Tensor, Optional[list[torch.Tensor]]], tuple[int, ...], int]  # RNG, versions, seq


_cpu_generator = torch.default_generator
_cuda_initialized = torch.cuda.is_initialized
_next_sequence_nr = compat.next_sequence_nr


def call_start(args: Any) -> Start:
    """Taken in the forward pre-hook (at every module call: :func:`~replay.restore.rng_state` inlined): the
    RNG state and the positional tensors' versions."""
    if type(args) is tuple and len(args) == 1 and isinstance(args[0], torch.Tensor):  # the common call
        t = args[0]
        versions: tuple[int, ...] = (-1 if t.is_inference() else compat.tensor_version(t),)  # (version_of)
    else:
        versions = tuple([ops.version_of(t) for t in args if isinstance(t, torch.Tensor)]) \
            if isinstance(args, tuple) else ()
    cuda = torch.cuda.get_rng_state_all() if _cuda_initialized() else None
    return (_cpu_generator.get_state(), cuda), versions, _next_sequence_nr()


def capture(args: tuple, kwargs: dict, start: Optional[Start]) -> Call:
    """The call as the exit hook sees it; versions from its start (a forward that wrote its own input
    in place cannot be replayed)."""
    tensors = tuple([t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)] if kwargs
                    else [t for t in args if isinstance(t, torch.Tensor)])
    rng: tuple[Optional[torch.Tensor], Optional[list[torch.Tensor]]] = (None, None)
    seq: Optional[int] = None
    before: tuple[int, ...] = ()
    if start is not None:
        rng, before, seq = start
    # (the tensors the start saw keep its versions; only those after them are read now)
    versions = before + tuple([ops.version_of(t) for t in tensors[len(before):]])
    return Call(tuple(args), dict(kwargs), versions, tensors, rng[0], rng[1], torch.is_grad_enabled(), seq,
                autocast=compat.autocast_state() if compat.autocast_may_be_on() else ())


def replay_call(module: torch.nn.Module, call: Call, watched: Callable[[], Any]) -> bool:
    """Run ``module(*args, **kwargs)`` again inside ``watched()`` (a context that puts the per-op
    watch on); the user's RNG streams, buffers, module attributes and grad mode are as before
    afterwards. True when the replay changed an attribute (put back)."""
    with replay_context(module, call, watched) as changed:
        module(*call.args, **call.kwargs)
    return bool(changed)


@contextlib.contextmanager
def replay_context(module: torch.nn.Module, call: Call, watched: Callable[[], Any]) -> Iterator[list[bool]]:
    """What :func:`replay_call` runs the call in (for a caller that also runs its backward): the
    yielded list gets True when the replay changed a module attribute (put back)."""
    changed: list[bool] = []
    with restored_attributes(module, changed), restored_rng(call.rng, call.cuda_rng), restored_buffers(module), \
            grad_mode(call.grad_enabled), autocast_as(call.autocast), watched():
        yield changed


_PLAIN_LEAVES = (torch.Tensor, int, float, complex, str, bool, type(None))


def plain_arguments(value: Any, depth: int = 0) -> bool:
    """Tensors, numbers, strings, None and lists/tuples/dicts of them: a replay cannot change anything
    through them (a KV-cache object that ``forward`` updates would be updated twice)."""
    if isinstance(value, (_PLAIN_LEAVES, LiveRef)):
        return True
    if depth < 6 and type(value) in (list, tuple):
        return all(plain_arguments(v, depth + 1) for v in value)
    if depth < 6 and type(value) is dict:
        return all(plain_arguments(v, depth + 1) for v in value.values())
    return False


def why_not_replayable(call: Call, module: torch.nn.Module, own_hooks: Collection[int]) -> str:
    """Why the forward of ``call`` cannot be replayed exactly ("" when it can): one walk of the module
    tree serves the weights and the hooks (walked afresh: a weight may have been replaced since the call,
    ``load_state_dict(assign=True)``). ``own_hooks``: the watch's own global hook ids."""
    modules, parameters = module_tree(module)
    return ("its arguments were changed in place" if call.changed()
            else "its weights were changed since the call" if call.params_changed(parameters)
            else "an argument is an object the call may update (a cache)"
            if not plain_arguments((call.args, call.kwargs))
            else "it has hooks of its own (or a global module hook is installed), which a replay would run again"
            if compat.hooks_in_modules(modules, own_hooks)
            else "")


NOT_REPLAYED = ("{module}: replay not possible ({why}); reported at module level")


class HasLog(Protocol):
    """What a replayer reads of the recorder: its event log (a replay's isolated one while it runs)."""

    @property
    def log(self) -> EventLog: ...


class Replayer:
    """Turns a non-finite kept module output into the per-op event of its first bad op.

    ``watched`` is the recorder's context that puts the per-op watch on for a replay (and keeps the
    module layer out of it); ``fallback(entry)`` reports the call at module level."""

    def __init__(self, ctx: HasLog, watched: Callable[[int], ContextManager[None]], fallback: Callable[[Any, int], None],
                 own_hooks: Callable[[], Collection[int]] = tuple) -> None:
        self.ctx, self._watched, self._fallback, self._own_hooks = ctx, watched, fallback, own_hooks
        self.notes: list[str] = []
        self.replays = 0

    def birth(self, entry: Any, first: int = 0, fallback: bool = True) -> bool:
        """``entry`` (a forward :class:`~replay.kept.Kept`) came out non-finite: find who made it.
        ``first``: the log's length when this check began (events of earlier checks are other births)."""
        log, path = self.ctx.log, entry.paths[0]
        if compat.current_autograd_node() is not None:
            return False  # a forward run by backward (checkpointing): the backward's own check replays it
        if any(e.module and (e.module == path or e.module.startswith(path + ".")) for e in log.since(first)):
            return False  # an inner call's birth, replayed already: this output only carries it
        inputs = entry.live_inputs() or ()
        if log.has_events() and any(ops.has_nan(x) for x in inputs if not ops.finite(x)):
            return False  # an earlier birth's NaN flowing through (an Inf turning into a NaN is replayed)
        call: Optional[Call] = entry.call.resolved() if entry.call is not None else None
        why = ("its arguments were not kept" if entry.call is None
               else "its arguments were freed before the check (no_grad)" if call is None
               else "its arguments were changed in place after the call" if call.changed()  # (at the module's exit)
               else why_not_replayable(call, entry.module, self._own_hooks()))
        before = log.mark()
        if not why:
            self.replays += 1
            probe, seq = user_line(), compat.next_sequence_nr()
            try:
                if replay_call(entry.module, call, lambda: self._watched(entry.iteration)):  # type: ignore[arg-type] # (call: not None here)
                    self.note(f"{path}: the replay changed the module's attributes (put back)")
            except Exception as exc:  # noqa: BLE001 - the module-level answer stands (unless it found the op)
                if not log.since(before):
                    why = f"the replay raised {type(exc).__name__}: {exc}"
        if not why:
            assert call is not None  # (no reason not to replay: its arguments were found)
            shift = call.seq - seq if call.seq is not None else None
            for i, event in enumerate(log.since(before), before):
                log.rewrite(i, relocated(event, probe, entry.place, shift))
            if shift is not None:
                log.renumber(before, shift)
            if log.since(before):
                return True
            why = "the replay stayed finite (randomness or state outside the call, or nondeterminism)"
            if bad_parameters(entry.module):  # copied out by ops no check watches (an embedding's row)
                why = ""
        if not fallback:
            return False
        self._fallback(entry, first)
        if log.since(before) and why:
            self.note(NOT_REPLAYED.format(module=path, why=why))
        return False

    def note(self, note: str) -> None:
        """A sentence for the report's notes (at most three, each once)."""
        if len(self.notes) < 3 and note not in self.notes:
            self.notes.append(note)


def user_line() -> tuple[Optional[str], Optional[int]]:
    place = here(None, None)
    return place.filename, place.lineno


def relocated(event: NanEvent, probe: tuple[Optional[str], Optional[int]], place: Any,
              seq_shift: Optional[int]) -> NanEvent:
    """An event of a replayed library module carries the line the replay ran from: give it the line of
    the original call (a module whose forward is the user's own code keeps its own line); its autograd
    sequence number is moved to the original call's (same ops in the same order)."""
    if (event.filename, event.lineno) == probe and place is not None:
        event = at_place(event, place)
    if event.sequence_nr is not None:
        event = dataclasses.replace(event, sequence_nr=event.sequence_nr + seq_shift if seq_shift is not None
                                    else None)
    return event


def at_place(event: Any, place: Any) -> Any:
    """``event`` moved to ``place``'s line (the source text too)."""
    text = line_of(place.filename, place.lineno, place.function).text if place.filename and place.lineno else ""
    return dataclasses.replace(event, filename=place.filename, lineno=place.lineno, function=place.function,
                               line=text)


def with_forward(event: Any, place: Any) -> Any:
    """A backward birth given the forward op, module and line a replay found for its node."""
    event = dataclasses.replace(event, forward_op=str(place.op) if place.op is not None else None,
                                forward_module=place.module, forward_lineno=place.lineno)
    if event.cause == "user_backward":  # the user's own backward code keeps its line (the module is the node's)
        return dataclasses.replace(event, module=place.module)
    return dataclasses.replace(at_place(event, place), module=place.module)


class ModelCalls:
    """The outermost module calls since the last optimizer step (arguments, RNG state, autograd sequence
    range): a backward birth inside one is given its forward op and line by replaying that forward."""

    def __init__(self, limit: int = 8) -> None:
        self.calls: list[tuple[torch.nn.Module, Call, int, Any]] = []
        self._limit = limit

    def add(self, module: torch.nn.Module, call: Call, end: int, place: Any) -> None:
        """``end``: the sequence number after the call; ``place``: the user's line that made it."""
        if call.seq is not None and call.grad_enabled and compat.current_autograd_node() is None:
            # (a forward run by backward, a checkpoint's recomputation, is part of that backward)
            parameters = parameters_of(module)  # one walk of the module tree per call
            call = call.with_parameters(parameters)
            self.calls = self.calls[-(self._limit - 1):] + [(module, call, end, place)]

    def clear(self) -> None:
        self.calls = []


class ByClass:
    """A flag per class, computed once by ``compute(cls)``, looked up by the class's id: no weak reference is
    made at each lookup (``WeakKeyDictionary.get`` makes one; these run at every module of a walk or call).
    Weak all the same: a class that dies (redefined in a cell) leaves."""

    __slots__ = ("_flags", "_compute")

    def __init__(self, compute: Callable[[type], bool]) -> None:
        self._flags: dict[int, tuple[weakref.ref, bool]] = {}
        self._compute = compute

    def get(self, cls: type) -> bool:
        entry = self._flags.get(id(cls))
        if entry is not None and entry[0]() is cls:
            return entry[1]
        key, flags, value = id(cls), self._flags, self._compute(cls)

        def gone(ref: weakref.ref, key: int = key) -> None:
            if flags.get(key, (None, False))[0] is ref:
                del flags[key]

        flags[key] = (weakref.ref(cls, gone), value)
        return value


def _lists_plainly(cls: type) -> bool:
    module = torch.nn.Module
    return all(getattr(cls, name, None) is getattr(module, name) for name in
               ("parameters", "named_parameters", "named_modules", "_named_members", "modules"))


# module classes whose parameters() is nn.Module's own walk
_PLAIN_WALK = ByClass(_lists_plainly)


def parameters_of(module: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """``tuple(module.parameters())``, the same tensors in the same order (see :func:`module_tree`)."""
    return module_tree(module)[1]


def versions_of(parameters: tuple[torch.Tensor, ...]) -> tuple[int, ...]:
    """Each parameter's version counter: another tuple once a weight was written in place."""
    return compat.tensor_versions(parameters)


def module_tree(module: torch.nn.Module) -> tuple[list[torch.nn.Module], tuple[torch.Tensor, ...]]:
    """``list(module.modules())`` and ``tuple(module.parameters())``, the same objects in the same order,
    in one loop over the ``_modules`` and ``_parameters`` dicts (the generator chain of ``named_modules``
    and ``_named_members`` costs four times as much); a class that overrides how modules or parameters
    are listed gets its own ``modules()`` and ``parameters()``."""
    found: list[torch.Tensor] = []
    modules: list[torch.nn.Module] = []
    seen_modules: set = set()
    seen: set[int] = set()
    stack = [module]
    plain_flags, dicts = _PLAIN_WALK, compat.parameter_and_child_dicts
    while stack:
        m = stack.pop()
        if m in seen_modules:
            continue
        if not plain_flags.get(type(m)):
            return list(module.modules()), tuple(module.parameters())
        seen_modules.add(m)
        modules.append(m)
        params, children = dicts(m)
        for p in params.values():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                found.append(p)
        if children:
            stack += [c for c in reversed(children.values()) if c is not None]
    return modules, tuple(found)
