"""nanwatch's backward without the per-op dispatch mode (``replay=True``, the CPU path).

The per-op mode costs most in backward (a no-op mode there alone is 1.3x on a small model), and the
autograd engine captures the dispatch-mode stack when ``backward()``/``autograd.grad()`` starts, so
the mode has to be off when the engine starts. :class:`BackwardGate`, a pass-through
``TorchFunctionMode``, catches the three entry points (``Tensor.backward``, ``autograd.backward``,
``autograd.grad``), takes the dispatch mode off for the engine's run and puts it back after. What ran
unwatched is then checked:

- **Nodes outside a model** (the loss, a custom Function, code without modules): as the backward
  starts, a post hook goes on each of them (:meth:`BackwardWatch._plan`, walking from the
  backward's roots; removed when it ends). A node whose gradients came out non-finite where the rules
  (:func:`may_hold_birth`) allow a birth is run again, under the dispatch mode, from inside that hook
  (its saved tensors are still there and it is the current autograd node): the per-op watch sees
  exactly the backward ops the always-on watch sees. A leaf's ``.grad += grad`` that overflows is run
  again on a copy of the old ``.grad``; a tensor hook the user registered outside a model runs under
  the dispatch mode (it is the user's own backward code).
- **A model's call** (its forward ran without the per-op mode): checked at module granularity and
  replayed, forward and backward, under the per-op watch when a gradient inside went non-finite
  (:mod:`replay.calls`). A non-finite gradient that a masking node inside zeroes (``relu``,
  ``clamp``, ``where``, ``masked_fill``...: ``ABSORBS``) leaves every gradient the module checks see
  finite; a pre hook on each such node of the calls the backward reaches (found by the same walk, removed
  when it ends) marks the call for its replay.

When in doubt the backward runs watched (the dispatch mode stays on, as with ``replay=False``): a model
call it reaches that cannot be replayed (arguments or weights changed, hooks of its own, saved-tensor
hooks, hooks on its weights), a custom ``autograd.Function`` or a hooked leaf outside the models (running
them again would repeat the user's code), saved-tensor hooks active at the backward, or more model calls
than are kept. A hook the user puts on an autograd node outside the models cannot be seen beforehand: when
a node run again makes finite gradients where it made non-finite ones, a note says so.

Nothing is kept after the check: the gradients are dropped, the hooks go with the backward or the watch;
the tensor hooks registered during the watch are the user's functions again when it ends.
"""
from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

from torch_nbdebug.errors import NanBirthError
from torch_nbdebug.record import compat
from torch_nbdebug.record.nanwatch.context import ReplayHost
from torch_nbdebug.record.nanwatch.core import ops
from torch_nbdebug.record.nanwatch.core.log import EventLog
from torch_nbdebug.record.nanwatch.replay.calls import CallChecks, may_hold_birth
from torch_nbdebug.record.nanwatch.replay.nodes import (KINDS, MOVES_ONLY, OWN_HOOKS, Absorber, Accumulation, NodeRerun,
                                                        WatchedHook, absorbs)
from torch_nbdebug.record.nanwatch.replay.forward import at_place

__all__ = ["BackwardGate", "BackwardWatch", "may_hold_birth"]

NODE_HOOK = ("a hook on an autograd node outside the models made its gradients non-finite; its ops are not "
             "watched with replay=True (run with replay=False to see them)")
UNNAMED = ("{module}: its backward was watched op by op, but its forward cannot be replayed ({why}): "
           "the birth is given the model call's line")
_WRAPPED_CAP = 4096  # tensor hooks remembered (to unwrap at the watch's end) before the dead are forgotten
_BACKWARDS = frozenset({torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad,
                        torch.Tensor.register_hook})
class BackwardGate(TorchFunctionMode):
    """Passes every torch function through; hands the backward entry points to ``run``."""

    def __init__(self, run: Callable[[Any, tuple, dict], Any]) -> None:
        super().__init__()
        self._run = run

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        __tracebackhide__ = True  # noqa: F841 - IPython hides this frame in the user's tracebacks
        if func in _BACKWARDS:
            return self._run(func, args, kwargs or {})
        return func(*args, **kwargs) if kwargs else func(*args)


class BackwardWatch:
    """The backward layer of ``replay=True``. ``host`` is the recorder, seen as a :class:`ReplayHost`: its
    ``log``, ``clock``, ``thread``, ``immediate``, ``produced``, ``keep_handle``, ``internal_error``, ``quiet``
    and ``switch`` (the per-op mode), and :class:`CallChecks` more."""

    def __init__(self, host: ReplayHost, note: Callable[[str], None]) -> None:
        self.host, self._note = host, note
        self.rerun_node: Any = None  # the node being run again: its births are judged by our hook
        self.unwatched = False  # a backward runs without the per-op mode
        self._node_handles: list[Any] = []  # this backward's node hooks (removed when it ends)
        self._absorbers: list[tuple[Any, Any]] = []  # (masking node in a model call, its region): from _plan
        self._wrapped: list[tuple[Any, int, WatchedHook]] = []  # (tensor weakref, handle id, wrapper)
        me = weakref.ref(self)  # (no reference cycle: the watch's helpers are freed with it, see NanRecorder._release)
        self.calls = CallChecks(host, note, lambda: me().unwatched)  # type: ignore[union-attr]

    # -- the gate ------------------------------------------------------------------------------
    def run(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func`` is a backward entry point: run it without the dispatch mode, then check it."""
        __tracebackhide__ = True  # noqa: F841
        host = self.host
        if func is torch.Tensor.register_hook:
            return self._register_hook(func, args, kwargs)
        if threading.get_ident() != host.thread.thread_id or host.thread.replaying or not host.switch.on_top() \
                or self.unwatched:
            return func(*args, **kwargs)
        nodes, reached, why = self._plan(func, args, kwargs)
        if why:  # a backward the unwatched path cannot check exactly: watched, as the always-on watch
            self._absorbers = []  # (no node held past the backward)
            return self._run_watched(func, args, kwargs, reached)
        given = _given_gradients(func, args, kwargs)
        if given is None and host.clock.saw_backward:
            # The implicit gradient (``ones_like`` of a scalar) is a forward op to the always-on watch:
            # after a backward it starts the next iteration (a second backward on a retained graph).
            host.clock.forward()
        host.clock.saw_backward = True  # (replay has no deferred checks: none waits for the backward's start)
        popped = False
        try:
            try:
                self._hook(nodes)
                host.switch.pop()
                popped = self.unwatched = True
                self.calls.grads_before(reached)  # (its ops are ours: the mode is off)
                result = func(*args, **kwargs)
            finally:
                self._ended(popped)
            self._check(result if func is torch.autograd.grad else None)
            return result
        except Exception:
            self._check(None)  # what ran before the error; the user's error goes on unchanged
            raise
        finally:
            self.calls.drop_gradients()

    def _run_watched(self, func: Any, args: tuple, kwargs: dict, reached: list[Any]) -> Any:
        """The backward with the per-op mode on. A birth in a model call that cannot be replayed (so
        its forward op cannot be named) is given the call's module and line."""
        __tracebackhide__ = True  # noqa: F841
        log = self.host.log
        before = log.mark()
        spans = [(r.call.seq, r.end, r.path, r.where, self.calls.not_replayable(r, forward=True)) for r in reached
                 if r.call.seq is not None]
        spans = [s for s in spans if s[4]] + [(*d, "") for d in self.calls.dropped]
        self.calls.dropped = []  # (dropped before this backward: named by it)
        try:
            return func(*args, **kwargs)
        finally:
            try:
                self._name_births(log, before, spans)
            except Exception as exc:  # noqa: BLE001 - the op-level answer stands
                self.host.internal_error("the backward of a model", exc)

    def _name_births(self, log: EventLog, before: int, spans: list[tuple[int, int, str, Any, str]]) -> None:
        """Births of this backward in the model calls ``spans`` (sequence range, path, line, why not replayable)
        whose forward nobody can replay: the call's module (and line) with a note."""
        for i, event in enumerate(log.since(before), before):
            seq = event.sequence_nr
            span = next((s for s in spans if seq is not None and s[0] <= seq < s[1]), None)
            if span is not None and event.phase == "backward" and event.module is None:
                if span[3] is not None and event.cause != "user_backward":
                    event = at_place(event, span[3])
                log.rewrite(i, dataclasses.replace(event, module=span[2], forward_module=span[2]))
                self._note(UNNAMED.format(module=span[2], why=span[4] or "more model calls than are kept"))

    def _ended(self, popped: bool) -> None:
        self.unwatched = False
        if popped:
            self.host.switch.push()
        handles, self._node_handles = self._node_handles, []
        for handle in handles:
            handle.remove()

    def _register_hook(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``Tensor.register_hook`` outside a model: the hook runs watched in an unwatched backward. The
        tensor and the handle are remembered: the user's function goes back in place when the watch ends."""
        if not (len(args) == 2 and callable(args[1]) and not kwargs and isinstance(args[0], torch.Tensor)
                and threading.get_ident() == self.host.thread.thread_id):
            return func(*args, **kwargs)
        wrapper = WatchedHook(args[1], self)
        handle = func(args[0], wrapper)
        if len(self._wrapped) >= _WRAPPED_CAP:  # a hook per step in a long loop: forget the dead tensors
            self._wrapped = [w for w in self._wrapped if w[0]() is not None]
        self._wrapped.append((weakref.ref(args[0]), handle.id, wrapper))
        return handle

    def _unwrap_hooks(self) -> None:
        """The watch ends: every tensor hook registered during it is the user's own function again."""
        wrapped, self._wrapped = self._wrapped, []
        for ref, handle_id, wrapper in wrapped:
            tensor = ref()
            if tensor is not None:
                compat.replace_tensor_hook(tensor, handle_id, wrapper, wrapper.hook)

    def watched_hook(self, hook: Callable[..., Any], args: tuple) -> Any:
        self.host.switch.push()
        try:
            return hook(*args)
        finally:
            self.host.switch.pop()

    def _check(self, results: Any) -> None:
        try:
            with self.host.quiet():  # our checks' ops are not the user's (a replay puts the watch back on)
                self.calls.after(results)
        except NanBirthError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's backward ran; our check failed
            self.host.internal_error("the backward of a model", exc)

    # -- ops outside a model -------------------------------------------------------------------
    def _plan(self, func: Any, args: tuple, kwargs: dict) -> tuple[list[Any], list[Any], str]:
        """Before the engine starts: the nodes of the graph outside the model calls (the loss, code without
        modules), found by walking from the backward's roots (the walk stops at a model call's nodes, its
        replay checks them, and goes on from its arguments), and the model calls the backward reaches.
        And why the backward has to run watched, if it has to: the unwatched check could not give the
        always-on watch's report (:meth:`_watched_reason`)."""
        name = "tensors" if func is torch.autograd.backward else "outputs"
        roots = args[0] if args else kwargs.get(name)
        stack = [t.grad_fn for t in (roots if isinstance(roots, (tuple, list)) else (roots,))
                 if isinstance(t, torch.Tensor)]
        stack += [t.grad_fn for r in self.regions for t in r.call.tensors]
        ranges = [(r.call.seq, r.end, r) for r in self.regions if r.call.seq is not None]
        seen: dict[int, Any] = {}  # (the nodes held while walking: an id is unique only while its object lives)
        nodes: list[Any] = []
        reached: dict[int, Any] = {}
        absorbers = self._absorbers = []
        while stack:
            fn = stack.pop()
            if fn is None or id(fn) in seen:
                continue
            seen[id(fn)] = fn
            seq = compat.node_sequence_nr(fn)
            span = next((s for s in ranges if s[0] <= seq < s[1]), None)
            if span is not None:  # a model call's nodes (the walk goes on from the call's arguments)
                lo, hi, region = span
                reached[id(region)] = region
                self._walk_call(fn, lo, hi, region, seen, absorbers)
                continue
            if seq == compat.NO_SEQUENCE and hasattr(fn, "variable"):
                if compat.leaf_hooks(fn.variable, OWN_HOOKS):  # the user's code on a leaf's gradient
                    return [], [], "a leaf tensor has hooks"
            elif not callable(fn):  # running a custom Function's backward again could repeat its side effects
                return [], [r for r in self.regions if r.call.seq is not None], "a custom autograd.Function"
            nodes.append(fn)
            stack += [f for f, _ in fn.next_functions if f is not None]
        regions = [r for r in self.regions if id(r) in reached]
        return nodes, regions, self._watched_reason(regions)

    @staticmethod
    def _walk_call(fn: Any, lo: int, hi: int, region: Any, seen: dict[int, Any], absorbers: list[Any]) -> None:
        """The nodes of a model call (sequence numbers in ``[lo, hi)``) from ``fn``: its masking nodes
        (``ABSORBS``) with their region, for a pre hook each."""
        sequence_nr, stack, kinds = compat.node_sequence_nr, [fn], KINDS
        while stack:
            node = stack.pop()
            kind = kinds.get(type(node))  # (most nodes: a known class that does not mask, no call)
            if (kind is None or kind) and absorbs(node):
                absorbers.append((node, region))
            for f, _ in node.next_functions:
                if f is not None and id(f) not in seen and lo <= sequence_nr(f) < hi:
                    seen[id(f)] = f
                    stack.append(f)

    def _watched_reason(self, regions: list[Any]) -> str:
        """Why the backward through ``regions`` must run watched (empty: it can run unwatched)."""
        if self.calls.dropped or compat.saved_tensors_hooks_active():
            return "more model calls than are kept before one backward, or saved-tensor hooks"
        return next((why for why in map(self.calls.not_replayable, regions) if why), "")

    def _hook(self, nodes: list[Any]) -> None:
        """A post hook on each node outside the model calls that can make a non-finite value (removed
        when this backward ends); pre and post hooks on a leaf's ``AccumulateGrad``."""
        handles = self._node_handles
        absorbers, self._absorbers = self._absorbers, []
        for fn, region in absorbers:
            handles.append(fn.register_prehook(Absorber(self, region)))
        for fn in nodes:
            if compat.node_sequence_nr(fn) != compat.NO_SEQUENCE:
                if fn.name() not in MOVES_ONLY:
                    handles.append(fn.register_hook(NodeRerun(self)))
            elif hasattr(fn, "variable"):  # AccumulateGrad of a leaf used outside the models
                acc = Accumulation(self, fn)
                handles += [fn.register_prehook(acc.pre), fn.register_hook(acc.post)]

    def node_finished(self, grad_inputs: Any, grad_outputs: Any) -> None:
        """A node ran unwatched: when the always-on watch could call what it made a birth or input data,
        run it again under the per-op watch (its backward ops are judged exactly as that watch judges)."""
        host = self.host
        if self.rerun_node is not None or not self.unwatched or host.switch.on_stack():
            return  # our own rerun, a replay, or a backward the per-op mode watches anyway
        with torch.no_grad():
            made = [g for g in grad_inputs if isinstance(g, torch.Tensor) and ops.checkable(g)]
            bad = [not ops.finite(g) for g in made]
            if not any(bad):
                return
            came = [g for g in grad_outputs if isinstance(g, torch.Tensor) and not ops.finite(g)]
            if not may_hold_birth(bool(came), any(ops.has_nan(g) for g in came),
                                  any(ops.has_nan(g) for g, b in zip(made, bad) if b), host.log.has_events()):
                return
        node = compat.current_autograd_node()
        if node is None:
            return
        # The gradients reaching the node were made by backward ops, as the always-on watch saw them made.
        host.produced.add_all([g for g in grad_outputs if isinstance(g, torch.Tensor)])
        # A built-in node is callable; a custom Function's node runs its backward through ``apply``.
        self.rerun(lambda: (node if callable(node) else node.apply)(*grad_outputs), bad)

    def rerun(self, run: Callable[[], Any], bad: list[bool]) -> None:
        """``run`` again, under the per-op watch, from the running node's own hook: the births it holds
        are kept when a non-finite gradient left the node (``bad``)."""
        host = self.host
        if self.rerun_node is not None or host.switch.on_stack():
            return
        self.rerun_node = True
        rng = torch.get_rng_state()  # the user's random stream goes on as if nothing ran again
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        with host.log.rerunning(bad):  # a hook added to the running node would not run: held births decided here
            host.switch.push()
            try:
                made = run()
            finally:
                host.switch.pop()
                self.rerun_node = None
                torch.set_rng_state(rng)
                if cuda_rng is not None:
                    torch.cuda.set_rng_state_all(cuda_rng)
        if any(bad) and all(ops.finite(g) for g in (made if isinstance(made, (tuple, list)) else (made,))):
            # Run again, the node made finite gradients: a hook the user put on the node changed them.
            self._note(NODE_HOOK)
        del made

    # -- model calls ---------------------------------------------------------------------------
    # -- model calls (replay.calls) --------------------------------------------------
    @property
    def regions(self) -> list[Any]:
        return self.calls.regions

    def model_called(self, module: torch.nn.Module, output: Any, path: Optional[str]) -> None:
        self.calls.model_called(module, output, path)

    def gradient_bad(self, path: str, grad: torch.Tensor) -> None:
        self.calls.gradient_bad(path, grad)

    def forget(self, everything: bool = False) -> None:
        self.calls.forget(everything)
        if everything:
            self._unwrap_hooks()


def _given_gradients(func: Any, args: tuple, kwargs: dict) -> Optional[list[Any]]:
    """The ``gradient``/``grad_tensors``/``grad_outputs`` the user passed to a backward entry point; None
    when torch makes them (``ones_like`` of a scalar output)."""
    position, name = ((1, "gradient") if func is torch.Tensor.backward else (1, "grad_tensors")
                      if func is torch.autograd.backward else (2, "grad_outputs"))
    value = args[position] if len(args) > position else kwargs.get(name)
    if value is None:
        return None
    values = list(value) if isinstance(value, (tuple, list)) else [value]
    return None if all(v is None for v in values) else values
