"""Module-level checks: per-module statistics at each module exit, gradients into module outputs,
and the cheap ``mode="module"`` check (only module outputs, no dispatch mode).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import threading
import weakref
from typing import Any, Callable, Optional

import torch

from torch_nbdebug.data.nanwatch import Kind
from torch_nbdebug.data.stats import TensorStats
from torch_nbdebug.errors import NanBirthError
from torch_nbdebug.record import compat
from torch_nbdebug.record.nanwatch.core import ops
from torch_nbdebug.record.nanwatch.core.rules import judge_gradient, judge_module
from torch_nbdebug.record.nanwatch.context import ModuleQueue, WatchContext
from torch_nbdebug.record.nanwatch.core.events import Place, here, kind_of, make_event, stats_of
from torch_nbdebug.record.nanwatch.modules.rule import LeftAt, judge_call, module_event
from torch_nbdebug.record.nanwatch.replay.inside import KeptCheck
from torch_nbdebug.record.nanwatch.replay.kept import CallSite, Kept, KeptReadings
from torch_nbdebug.record.nanwatch.core.layers import (LayerRecorder, Later, first_float_tensor, nonfinite_reading,
                                                       stat_values)
from torch_nbdebug.record.nanwatch.core.live import LiveRef
from torch_nbdebug.record.nanwatch.core.params import bad_parameters
from torch_nbdebug.record.nanwatch.replay.forward import ModelCalls, Replayer, Start, call_start, capture
from torch_nbdebug.record.tensors import storage_key

_MAX_BACKLOG = 4096  # deferred module statistics waiting before they are read early


class ModuleChecks:
    """Module enter/exit and gradient callbacks. ``depth`` is the module nesting (1: a top-level
    model), ``busy`` is True while an optimizer step runs (its modules are not checked)."""

    def __init__(self, ctx: WatchContext, layers: LayerRecorder, deferred: Optional[ModuleQueue],
                 depth: Callable[[], int], busy: Callable[[], bool]) -> None:
        self.ctx, self.layers, self.deferred = ctx, layers, deferred
        self._depth, self._busy = depth, busy
        # (the options are frozen: read once here, not at every module exit)
        self._module_mode, self._backward = ctx.options.mode == "module", ctx.options.backward
        self._queue = deferred if self._module_mode else None  # deferred module mode: its checks are queued
        self.thread_id = threading.get_ident()
        self.other_thread = False
        # (weakref, values, hook, version) of the last output: a container returning it unchanged has its numbers
        self._last_exit: Optional[tuple[LiveRef, Optional[list[float]], Optional[_GradHook]]] = None
        self._awaiting: Optional[int] = None  # id of the model whose forward waits for its backward's start
        # replay=True (see use_replay): outputs and gradients are kept and checked together (replay.kept).
        # Without replay each output is read as its module exits: on a CPU that is as cheap (the same
        # statistics ops, and reading a CPU scalar is no synchronisation), and CUDA has its deferred path.
        self.kept: Optional[KeptReadings] = None
        self.replayer: Optional[Replayer] = None
        self.model_calls = ModelCalls()  # replay: the outermost calls, to name backward births' forward ops
        self.replaying = False  # a replay runs: the module layer keeps out of it
        self._starts: list[Start] = []  # replay: RNG state and argument versions of each running call, by depth
        self._outer_call: Optional[Kept] = None  # replay: the outermost call, until its exit's check
        self._kwargs: dict = {}
        self._model_seq = 0  # module mode: the outermost call's first autograd node number
        self._left_inside: Optional[weakref.ref[torch.Tensor]] = None  # module mode: an output left to its enclosing module
        self.left_at = LeftAt()  # module mode: calls left to their enclosing module
        self.saw_half = False  # replay: a float16/bfloat16 module output was kept (see HALF_UNWATCHED)
        # replay: told of each non-finite gradient into a module output (replay.backward marks the model call)
        self.bad_gradient: Optional[Callable[[str, torch.Tensor], None]] = None

    def mine(self) -> bool:
        """Module hooks are global: another thread's modules (its own watch, a worker) are not ours."""
        if threading.get_ident() == self.thread_id:
            return True
        self.other_thread = True
        return False

    def enter(self, path: str, module: torch.nn.Module) -> None:
        if self.replaying:
            return
        if self._depth() == 1:
            self.ctx.clock.forward()
        self.layers.enter(path)
        if self.kept is not None and self.kept.entries and declares_inplace(module):
            with self.ctx.quiet():  # it may overwrite a kept output: read what was kept first
                self.ctx.flush()

    def model_started(self) -> None:
        """Module mode: an outermost call starts (see :meth:`_coming_in`)."""
        if not self.replaying:
            self._model_seq = compat.next_sequence_nr()

    def _coming_in(self, inputs: list[torch.Tensor]) -> tuple[bool, ...]:
        """Module mode: which of a call's inputs count as data coming in. A top-level call's do; a nested
        call's unless the model's call made them (:func:`~torch_nbdebug.record.nanwatch.core.ops.made_since`): an enclosing module's
        code between its submodules (no op is watched there), and that module is judged when it returns."""
        if self._depth() <= 1:
            return tuple(True for _ in inputs)
        seq = self._model_seq
        return tuple(not ops.made_since(x, seq) for x in inputs)

    def use_replay(self, replayer: Replayer) -> None:
        self.kept, self.replayer = KeptReadings(), replayer

    def started(self, args: Any) -> None:
        """Replay: the forward pre-hook's view of a call (before ``enter``; depth not yet counted)."""
        if not self.replaying:
            del self._starts[self._depth():]
            self._starts.append(call_start(args))

    def exit_kw(self, module: torch.nn.Module, args: Any, *rest: Any) -> None:
        """The exit hook with the call's keyword arguments (replay needs them): ``(kwargs, output)``.
        Installed with ``always_call``: torch also calls it while a forward's exception propagates, then
        as ``(module, args, None)``."""
        if len(rest) != 2:
            if rest and rest[0] is None and sys.exc_info()[0] is not None:
                kwargs = compat.failed_call_kwargs(module)
                if kwargs is not None:
                    self._raised(module, args, kwargs)
            return
        kwargs, output = rest
        self._kwargs = kwargs
        try:
            self.exit(module, args, output)
        finally:
            self._kwargs = {}

    def _raised(self, module: torch.nn.Module, args: Any, kwargs: dict) -> None:
        """The outermost forward raised (``torch.multinomial`` on NaN probabilities, an assert on the
        values): check what its inner modules returned, and if that names no birth, replay the whole
        call under the per-op watch up to the same error, as the always-on watch would have seen it."""
        if self.replaying or self.replayer is None or not self.mine() or self._depth() != 1 or self._busy():
            return
        try:
            path = self.ctx.module_path()
            call = capture(tuple(args), dict(kwargs), self._starts[0] if self._starts else None)
            first = self.ctx.log.mark()
            with self.ctx.quiet():
                self.ctx.flush()  # the kept outputs of the modules that returned
            if not self.ctx.log.since(first) and path is not None:
                entry = Kept(None, [path], self.ctx.clock.iteration, module, (), here(path, None), call=call)
                self.replayer.birth(entry, first, fallback=False)
        except Exception as exc:  # noqa: BLE001 - the user's own error is the one that propagates
            self.ctx.internal_error(f"the forward of {type(module).__name__} that raised", exc)

    def exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.replaying or not self.mine():
            return
        try:
            self._check_exit(module, args, output)
            if self._depth() == 1 and not self._busy():
                if self.replayer is not None:  # replay now: outside any backward, the weights unchanged
                    with self.ctx.quiet():
                        self.ctx.flush()
                elif self.deferred is not None:
                    self._model_done(module, output)
        except NanBirthError:
            raise
        except Exception as exc:  # noqa: BLE001 - see OpWatchMode
            self.ctx.internal_error(f"the output of {type(module).__name__}", exc)

    def _model_done(self, module: torch.nn.Module, output: Any) -> None:
        """A top-level module finished (deferred path): read what waits on the device while the
        activations it names are alive (exact statistics). When a backward will follow, wait for it
        to start instead: the loss computed after the model is read too, in the same single read."""
        t = first_float_tensor(output)
        backward = self._backward and t is not None and t.requires_grad and torch.is_grad_enabled()
        if backward and self._awaiting != id(module):  # the same model again without a backward: read now
            if self._awaiting is None:
                self._awaiting = id(module)
            return
        self._awaiting = None
        with self.ctx.quiet():
            self.ctx.flush()

    def backward_started(self) -> None:
        """The first backward op or gradient after a forward: read the forward's checks (see ``_model_done``)."""
        if self._awaiting is not None:
            self._awaiting = None
            with self.ctx.quiet():
                self.ctx.flush()

    def forget(self) -> None:
        self._last_exit = None
        self.left_at.clear()
        self._outer_call = None
        self._awaiting = None
        self._starts.clear()
        self.model_calls.clear()
        if self.kept is not None:
            self.kept.clear()

    def forward_over(self) -> None:
        """The outermost module call ended (this hook runs also when it raised): what is still kept was
        not checked because the forward raised; drop it (an OOM-retry loop must not keep activations)."""
        self._starts.clear()
        self._outer_call = None
        if self.kept is not None:
            self.kept.clear()

    def check_kept(self) -> None:
        """Replay: read every kept output (one transfer), in the order the modules exited: the table's
        statistics, and a non-finite output goes to the replayer (innermost call first). See
        :class:`~replay.inside.KeptCheck`."""
        outer, self._outer_call = self._outer_call, None
        if self.kept is None or not self.kept.entries or self.replayer is None:  # (both set by use_replay)
            return
        # The model call's first autograd node (a tensor made from there on was made inside the call).
        model_seq = outer.call.seq if outer is not None and outer.call is not None else \
            self._starts[0][2] if self._starts else None
        KeptCheck(self, self.replayer, outer, model_seq).run()

    def _check_exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        path = self.ctx.module_path()
        if path is None or self._busy():
            return
        t: Optional[torch.Tensor] = first_float_tensor(output)
        leaves = ops.float_leaves(output) if self.kept is not None and not isinstance(output, torch.Tensor) else []
        if t is None and leaves:
            t = leaves[0]  # a dataclass (or deeper) output
        if t is None:
            return
        last = self._last_exit
        if last is not None and last[0].get() is not t:
            last = None  # another tensor, or the same one written in place (ReLU(inplace=True)): new numbers
        if self.kept is not None:
            self._keep_exit(path, module, args, t, last, [x for x in leaves if x is not t])
            return
        if last is not None and last[1] is not None:
            # A container returning its last child's output (Sequential, a model's head): same numbers.
            self.layers.take_forward(path, last[1])
            if last[2] is not None:
                last[2].paths.append(path)
            if self._left_inside is not None and self._left_inside() is t:  # the child left it to us
                if not self.module_birth(path, module, args, t, coming_in=self._coming_in):
                    self._left_inside = None
            return
        if self._module_mode:  # no dispatch mode runs: our statistics ops need no quieting
            self._record_exit(path, module, args, t)
        else:
            with self.ctx.quiet():
                self._record_exit(path, module, args, t)

    def _record_exit(self, path: str, module: torch.nn.Module, args: Any, t: torch.Tensor) -> None:
        """Without replay: the output's statistics now (CPU) or queued on the device (deferred), the
        module-mode check, and the hook that reads the gradient into the output."""
        queue = self._queue
        if queue is not None:  # judged from the table's reading of the output, when the flush reads it
            later = Later()
            values = self.layers.forward(path, t, later)
            queue.queue_module(path, module, args, t, later, self._coming_in)
        else:
            values = self.layers.forward(path, t)
            if self._module_mode and nonfinite_reading(values):
                left = self.module_birth(path, module, args, t, coming_in=self._coming_in)
                self._left_inside = weakref.ref(t) if left else None
        hook = None
        if self._backward and t.requires_grad and torch.is_grad_enabled():
            hook = _GradHook(self, path)
            self.ctx.keep_handle(t.register_hook(hook))
        self._last_exit = (LiveRef(t), values, hook)
        if self.layers.deferred:
            self._bound_backlog()

    def _keep_exit(self, path: str, module: torch.nn.Module, args: Any, t: torch.Tensor, last: Any,
                   others: list[torch.Tensor]) -> None:
        """The replay's module layer: keep the output (:meth:`_keep`); :meth:`check_kept` reads it later."""
        kept = self.kept
        assert kept is not None
        ctx = self.ctx
        depth = self._depth()
        site = CallSite(self._starts[depth - 1] if 0 < depth <= len(self._starts) else None, args, self._kwargs, path)
        if depth == 1:  # checked as this exit returns (``exit``), then dropped
            call, place = site.call(), site.place()
            if t.requires_grad:
                self.model_calls.add(module, call, compat.next_sequence_nr(), place._replace(module=None))
            self._outer_call = Kept(t, [path], ctx.clock.iteration, module, (), place, call=call)
        container = last is not None and kept.entries and kept.entries[-1].value() is t
        main = kept.entries.pop() if container else None
        for other in others:  # the other outputs (a tuple's 2nd element, a dataclass field): births only
            self._keep(other, module, site, table=False)
        if main is not None:
            kept.entries.append(main)  # last again: the next container can find it
            main.paths.append(path)  # a container returning its last child's output
            if last is not None and last[2] is not None:
                last[2].paths.append(path)
            return
        self._keep(t, module, site)
        hook = None
        if self._backward and t.requires_grad and torch.is_grad_enabled():
            hook = _GradHook(self, path)
            ctx.keep_handle(t.register_hook(hook))
        self._last_exit = (LiveRef(t), None, hook)
        if kept.full():
            with ctx.quiet():
                ctx.flush()

    def _keep(self, t: torch.Tensor, module: torch.nn.Module, site: CallSite, table: bool = True) -> None:
        """Keep one output of a module call. A CPU output is read at once (reading a CPU scalar is no
        synchronisation): a finite one keeps only what the table needs (unless it is float16/bfloat16: see
        KeptCheck), a non-finite one what a replay needs too. Another device's statistics are computed now,
        while the output is still in the cache (not read: :meth:`check_kept` reads every entry's together).
        Our ops pass no dispatch mode."""
        weak = not t.requires_grad  # no autograd keeps it: neither do we (inference, generation)
        kept, iteration = self.kept, self.ctx.clock.iteration
        assert kept is not None
        values = None
        if t.dtype in ops.HALF:
            self.saw_half = True
        with self.ctx.quiet() if compat.dispatch_stack_len() else _NOTHING:
            if t.is_cpu and READ_AT_EXIT:
                values = stat_values(t)
                # (a half-precision call is kept whole: its inputs may have overflowed inside, see KeptCheck)
                if not nonfinite_reading(values) and t.dtype not in ops.HALF:
                    if table:
                        kept.read(t, site.path, module, iteration, values, weak)
                    return
            entry = kept.output(t, site.path, module, site.inputs(), site.place(), iteration, weak, table, values)
            if t.dtype in ops.HALF and (weak or values is not None) and not nonfinite_reading(values):
                # (read now while the inputs live: a no-grad call's are gone by the check; on a device, a sync)
                entry.squares_risk = ops.squares_may_overflow(site.inputs())
        call = site.call()
        entry.call = call.weakened() if weak else call

    def _bound_backlog(self) -> None:
        """Deferred statistics are read once per forward (see ``_model_done``); code without modules
        reads them every few thousand instead of keeping them all until the end of the watch."""
        if self.layers.backlog > _MAX_BACKLOG:
            self.ctx.flush()

    def module_fallback(self, entry: Kept, first: int = 0) -> None:
        """A kept forward call reported at module level (replay impossible or not reproducing);
        ``first``: the log's length when the check began."""
        assert entry.module is not None
        t, inputs = entry.value(), entry.live_inputs()
        if t is None:
            self._freed_birth(entry, first)
            return
        self.module_birth(entry.paths[0], entry.module, inputs or (), t, entry.place, entry.iteration, first)

    def _freed_birth(self, entry: Kept, first: int) -> None:
        """A weakly kept (no-grad) output freed before the check: the event has what was read of it
        (its kind; shape and dtype), not its full statistics."""
        log, path = self.ctx.log, entry.paths[0]
        inner = any(e.module and e.module.startswith(path + ".") for e in log.since(first))
        params_bad = not inner and bool(bad_parameters(entry.module))
        # Its inputs were freed with it: after a birth they are taken as carrying it (the modules after a
        # non-finite one in generation are not births of their own).
        verdict = judge_module(True, log.has_events(), params_bad, log.has_events(), inner)
        if verdict == "propagation":
            return
        # min and max say NaN (aminmax propagates it); a mean of +Inf and -Inf is NaN without one
        kind: Kind = "nan" if math.isnan(entry.values[0]) or math.isnan(entry.values[1]) else "inf"
        if self.ctx.options.ignore_inf and kind == "inf":
            return
        shape, dtype, device, numel = entry.meta
        out = TensorStats(tuple(shape), str(dtype).replace("torch.", ""), str(device), numel,
                          note="freed before the check: statistics not kept")
        op = f"{type(entry.module).__name__} (module output)"
        if self.replayer is not None:
            self.replayer.note(f"{path}: its output was freed before the check (no_grad: generation or evaluation) "
                               "and the model's call could not be replayed; reported at module level")
        log.add(module_event(self.ctx, entry.place or here(path, None), op, verdict, (), out, kind, entry.module,
                             False, entry.iteration))

    def module_birth(self, path: str, module: torch.nn.Module, args: Any, t: torch.Tensor,
                     place: Optional[Place] = None, iteration: Optional[int] = None, first: int = 0,
                     coming_in: Optional[Callable[[list[torch.Tensor]], tuple[bool, ...]]] = None) -> bool:
        """``coming_in`` (module mode): which inputs are data coming in (:meth:`_coming_in`). True when
        the output is left to the enclosing module (inputs an enclosing module's own code made)."""
        log = self.ctx.log
        inputs = ops.float_inputs(args, {})
        bad = [not math.isfinite(ops.sum_value(x)) and ops.any_nonfinite(x) for x in inputs]
        verdict = judge_call(self.left_at, log, path, first, bad, None if coming_in is None else coming_in(inputs),
                             module)
        if verdict == "left":
            return True  # an enclosing module's own code made them: judged as that module returns
        if verdict == "propagation":
            return False
        out = stats_of([t], 1)[0]
        kind = kind_of([out])
        if self.ctx.options.ignore_inf and kind == "inf":
            return False
        log.add(module_event(self.ctx, place or here(path, None), f"{type(module).__name__} (module output)", verdict,
                             stats_of(inputs), out, kind, module, any(bad),
                             self.ctx.clock.iteration if iteration is None else iteration))
        return False

    def on_grad(self, paths: list[str], grad: torch.Tensor) -> None:
        """A gradient reached a module's output (tensor hook): table stats, and module-mode check."""
        ctx = self.ctx
        if not ctx.clock.saw_backward:
            self.backward_started()
        ctx.clock.saw_backward = True
        if grad is None or not grad.is_floating_point() or grad.numel() == 0:
            return
        path = paths[0]
        # No dispatch mode on at all (the backward of replay=True, module mode): nothing to keep quiet.
        with ctx.quiet() if compat.dispatch_stack_len() else _NOTHING:
            queue = self._queue
            later = Later() if queue is not None else None
            values = self.layers.gradient(path, grad, later)
            for other in paths[1:]:
                if values is not None:
                    self.layers.take_gradient(other, values)
            if self.layers.deferred:
                self._bound_backlog()
            if not self._module_mode:
                if self.bad_gradient is not None and nonfinite_reading(values):
                    self.bad_gradient(path, grad)
                return
            if queue is not None and later is not None:
                queue.queue_grad(path, grad, later)
            elif nonfinite_reading(values):
                self._grad_birth(path, grad, ctx.clock.iteration)

    def gradient_birth(self, path: str, grad: Optional[TensorStats], iteration: int) -> None:
        """A backward birth known only at module level (replay: the model call could not be replayed)."""
        self._grad_birth(path, grad, iteration)

    def _grad_birth(self, path: str, grad: "torch.Tensor | TensorStats | None", iteration: int) -> None:
        """Module mode: a non-finite gradient into a module output, a birth when nothing came before."""
        ctx = self.ctx
        if judge_gradient(ctx.log.has_events()) != "birth":
            return
        out = stats_of([grad], 1)[0] if isinstance(grad, torch.Tensor) else grad
        kind = kind_of([out]) if out is not None else "nan"
        if not (ctx.options.ignore_inf and kind == "inf"):
            place = Place(None, path, None, None, "<module>")
            ctx.log.add(make_event("backward", f"gradient into {path}", place, (), out, kind=kind,
                                   iteration=iteration))


HALF_UNWATCHED = ("float16/bfloat16 module calls ran without the per-op watch (replay): an Inf born inside a "
                  "module and absorbed before its output (its output finite, but wrong) is looked for only where "
                  "the module's inputs reach the square root of the dtype's largest number (256 in float16), "
                  "where squares overflow; run with --no-replay (replay=False) to watch every op")


_NOTHING = contextlib.nullcontext()
# Replay: a CPU output is read as its module returns (see ``ModuleChecks._keep``); an output on a device
# waits on it and is read with the others when the model returns. Tests switch this off to run the
# device's path on a CPU.
READ_AT_EXIT = True


# module class -> whether ``inplace`` may come from the class (weak: a class redefined in a cell goes)
_INPLACE_CLASSES: "weakref.WeakKeyDictionary[type, bool]" = weakref.WeakKeyDictionary()


def declares_inplace(module: torch.nn.Module) -> bool:
    """``getattr(module, "inplace", False) is True`` without ``Module.__getattr__``'s raise for the many
    modules that have no such attribute: an instance attribute (``nn.ReLU(inplace=True)``) is read from
    ``__dict__``; a class attribute, property or ``__getattr__`` of the class's own goes through getattr."""
    cls = type(module)
    from_class = _INPLACE_CLASSES.get(cls)
    if from_class is None:
        from_class = _INPLACE_CLASSES[cls] = (any("inplace" in vars(k) for k in cls.__mro__)
                                              or cls.__getattr__ is not torch.nn.Module.__getattr__)
    if from_class:
        return getattr(module, "inplace", False) is True
    return module.__dict__.get("inplace", False) is True


class _GradHook:
    """Tensor hook that only reads the gradient (returns None, so the value is unchanged)."""

    __slots__ = ("checks", "paths")

    def __init__(self, checks: ModuleChecks, path: str) -> None:
        self.checks, self.paths = checks, [path]

    def __call__(self, grad: torch.Tensor) -> None:
        try:
            self.checks.on_grad(self.paths, grad)
        except NanBirthError:
            raise
        except Exception as exc:  # noqa: BLE001 - see OpWatchMode
            self.checks.ctx.internal_error(f"the gradient into {self.paths[0]}", exc)
