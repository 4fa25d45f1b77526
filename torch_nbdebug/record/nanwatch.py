"""Record where NaN/Inf values are born: forward and backward ops, module outputs, optimizer steps.

A birth is an op whose output is non-finite while all its floating inputs are finite (the rules are
in :mod:`nanwatch_births`, one pure function for every path). Checks are a NaN/Inf-propagating sum
of each output: read at once on the immediate path (CPU), queued on the device and read once per
training step (when the backward starts) and at the end of the watch on the deferred one (CUDA).
The recorder wires small components together; each gets a :class:`WatchContext` (options, the event
log, the clock, a few services), not the recorder itself.
Everything installed here is removed in :meth:`NanRecorder.stop`, whatever happened.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
from torch.nn.modules.module import register_module_forward_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from torch_nbdebug.record import compat
from torch_nbdebug.record import nanwatch_ops as ops
from torch_nbdebug.record.interrupts import deferred_interrupts
from torch_nbdebug.record.modules import ModuleTracker
from torch_nbdebug.record.nanwatch_amp import AmpChecks
from torch_nbdebug.record.nanwatch_context import Clock, Mode, WatchOptions
from torch_nbdebug.record.nanwatch_deferred import DeferredChecks
from torch_nbdebug.record.nanwatch_events import Place, here
from torch_nbdebug.record.nanwatch_immediate import ImmediateChecks
from torch_nbdebug.record.nanwatch_layers import LayerRecorder
from torch_nbdebug.record.nanwatch_log import EventLog
from torch_nbdebug.record.nanwatch_mode import OpWatchMode
from torch_nbdebug.record.nanwatch_modules import ModuleChecks
from torch_nbdebug.record.nanwatch_optim import LearningRates, OptimizerWatch
from torch_nbdebug.record.nanwatch_storage import StorageRegistry

_get_sequence_nr = compat.next_sequence_nr
_stack_len = compat.dispatch_stack_len
_stack_at = compat.dispatch_mode_at
_current_node = compat.current_autograd_node
_categories = ops._cache
_NODE_CAP = 200_000  # forward places remembered for backward births (oldest dropped first)
_HANDLE_CAP = 4096  # tensor/node hooks kept before forgetting those whose tensor or node is gone


class NanRecorder:
    """Context manager: watch everything torch does inside; births go to ``log`` (an :class:`EventLog`)."""

    def __init__(self, namespace: Optional[Mapping[str, Any]] = None, *, mode: Mode = "op",
                 backward: bool = True, optimizer: bool = True, ignore_inf: bool = False,
                 raise_on_birth: bool = False, defer: Optional[bool] = None, max_events: int = 50) -> None:
        self.options = WatchOptions(mode, backward, optimizer, ignore_inf, raise_on_birth, bool(defer), max_events)
        self.namespace = namespace
        self.log = EventLog(max_events, raise_on_birth)
        self.clock = Clock()
        self.produced = StorageRegistry()
        self.lr = LearningRates()
        self.layers = LayerRecorder(deferred=bool(defer))
        self.errors: list[str] = []
        self.ops_seen = self.ops_checked = 0
        self.immediate = ImmediateChecks(self)
        self.deferred = DeferredChecks(self) if defer else None
        self.amp = AmpChecks(self, self.immediate, self.deferred)
        self.modules = ModuleChecks(self, self.layers, self.deferred, self._depth, self._optimizer_busy)
        self.optim: Optional[OptimizerWatch] = None
        self._places: dict[int, Place] = {}
        self._last_seq = -1
        self._op_seq: Optional[int] = None
        self._quiet = 0
        self._handles: list[Any] = []
        self._grad_handles: list[Any] = []
        self._tracker: Optional[ModuleTracker] = None
        self._mode: Optional[OpWatchMode] = None
        self._suspended_mode: Optional[OpWatchMode] = None

    # -- what the report reads (besides ``log``, ``layers``, ``options``, ``errors``) ---------------
    @property
    def other_thread(self) -> bool:
        return self.modules.other_thread

    def saw_torch(self) -> bool:
        return self.ops_seen > 0 or self.layers.seen() or bool(self.optim and self.optim.steps)

    # -- lifetime --------------------------------------------------------------------------
    def __enter__(self) -> "NanRecorder":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        try:
            with deferred_interrupts():  # a Stop now is raised once everything is installed
                self._install()
        except BaseException:
            self.stop()
            raise

    def _install(self) -> None:
        # Our module post hook goes first so the tracker still shows the exiting module. Dynamo must
        # not trace it into a torch.compile'd model (it would graph-break on every .item()).
        self._handles.append(register_module_forward_hook(torch.compiler.disable(self.modules.exit)))
        self._tracker = _ThreadTracker(self.modules, self.namespace, on_enter=self.modules.enter)
        self._tracker.__enter__()
        if self.options.optimizer:
            self.optim = OptimizerWatch(self, self.lr, self.suspend, self.resume, self.deferred)
            self._handles += [register_optimizer_step_pre_hook(self.optim.pre),
                              register_optimizer_step_post_hook(self.optim.post)]
        if self.options.mode == "op":
            self._mode = OpWatchMode(self._on_op, self.internal_error)
            self._mode.__enter__()

    def stop(self) -> None:
        """Remove every hook and mode; read outstanding device flags (errors there are not raised)."""
        try:
            with deferred_interrupts():  # a Stop here is raised once every hook and mode is removed
                self._remove()
        finally:
            self._remove()  # if a Stop came before the block above took effect; else a no-op
            self._finish()

    def _remove(self) -> None:
        """Take off the mode and every hook; safe to run twice."""
        try:
            self.resume()  # an optimizer step that raised left the mode suspended
            if self._mode is not None:
                mode, self._mode = self._mode, None
                mode.__exit__(None, None, None)
        finally:
            # Every global hook goes, even if removing the mode or another hook failed.
            handles, self._handles, self._grad_handles = self._handles + self._grad_handles, [], []
            for handle in handles:
                try:
                    handle.remove()
                except Exception as exc:  # noqa: BLE001 - keep removing: a left hook changes the program
                    self.internal_error("removing a hook", exc)
            if self._tracker is not None:
                self._tracker.remove()  # idempotent

    def _finish(self) -> None:
        """Read what is still on the device and forget every key (nothing of the user's is kept)."""
        try:
            with self.log.not_raising():
                self.flush()
                self.log.commit_held()
        except Exception as exc:  # noqa: BLE001 - e.g. a CUDA error: the user's own error matters more
            self.internal_error("the flags still on the device", exc)
        finally:
            self.produced.clear()
            self._places.clear()
            self.modules.forget()
            self.log.clear_keys()

    def suspend(self) -> None:
        """Take our dispatch mode off the stack (only when it is on top) while our own code or an
        optimizer step runs: those ops are not checked, so they should not pay the Python dispatch."""
        mode = self._mode
        if mode is not None and self._suspended_mode is None and _stack_len() and _stack_at(_stack_len() - 1) is mode:
            compat.pop_dispatch_mode()
            self._suspended_mode = mode

    def resume(self) -> None:
        mode, self._suspended_mode = self._suspended_mode, None
        if mode is not None:
            compat.push_dispatch_mode(mode)

    # -- the WatchContext services ------------------------------------------------------------
    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Our own statistics ops inside hooks: neither checked nor dispatched through the mode."""
        outer = self._suspended_mode is not None
        self._quiet += 1
        if not outer:
            self.suspend()
        try:
            yield
        finally:
            if not outer:
                self.resume()
            self._quiet -= 1

    def internal_error(self, where: str, exc: Exception) -> None:
        """Our check failed (an exotic tensor or op): note it, never disturb the user's code."""
        if len(self.errors) < 3:
            self.errors.append(f"could not check {where}: {type(exc).__name__}: {exc}")

    def module_path(self) -> Optional[str]:
        return self._tracker.current if self._tracker is not None else None

    def forward_place(self, seq: int) -> Optional[Place]:
        return self._places.get(seq)

    def keep_handle(self, handle: Any) -> None:
        self._grad_handles.append(handle)
        if len(self._grad_handles) > _HANDLE_CAP:  # long loops: forget hooks whose tensor or node is gone
            self._grad_handles = [h for h in self._grad_handles if h.hooks_dict_ref() is not None]

    def flush(self, extra: Sequence[torch.Tensor] = ()) -> list[list[float]]:
        """Read what waits on the device — module statistics, deferred checks (see nanwatch_deferred)
        and ``extra`` — in one transfer per device (one host synchronisation on CUDA); replay the
        checks in order; return ``extra``'s values."""
        self._quiet += 1
        try:
            stats = self.layers.take_pending()
            pending, flags = self.deferred.take() if self.deferred is not None else ([], [])
            if not stats and not pending and not extra:
                return []
            values = ops.read_together([t for _, t in stats] + flags + list(extra))
            self.layers.apply(stats, values[:len(stats)])
            if self.deferred is not None:
                self.deferred.replay(pending, values[len(stats):len(stats) + len(flags)])
            return values[len(stats) + len(flags):]
        finally:
            self._quiet -= 1

    def _depth(self) -> int:
        return len(self._tracker.stack) if self._tracker is not None else 0

    def _optimizer_busy(self) -> bool:
        return self.optim is not None and self.optim.active > 0

    # -- op level --------------------------------------------------------------------------
    def _on_op(self, func: Any, args: tuple, kwargs: dict, out: Any, pre: Optional[torch.Tensor] = None) -> None:
        # The hot path: runs for every op, so it is kept flat (no helper calls for the common cases).
        if self._quiet or (self.optim is not None and self.optim.active):
            return
        self.ops_seen += 1
        cat = _categories.get(func)
        if cat is None:
            cat = ops.category(func)
        node = _current_node()
        if node is None:
            clock = self.clock
            if clock.saw_backward:  # a forward after a backward: the next iteration of a loop
                clock.saw_backward = False
                clock.iteration += 1
            seq = _get_sequence_nr()
            if seq != self._last_seq:
                # The autograd kernel made a node for this op just before calling us: remember where.
                self._last_seq = seq
                self._op_seq = seq - 1
                if cat != ops.VIEW and self.options.backward:  # places serve backward births only
                    self._remember(seq - 1, func)
            else:
                self._op_seq = None
            phase = "forward"
        else:
            if not self.options.backward:
                return
            if not self.clock.saw_backward:
                self.modules.backward_started()  # the deferred path reads the forward's checks now
            self.clock.saw_backward = True
            phase = "backward"
        if cat == ops.VIEW:
            return
        if cat == ops.SCALER:
            self.amp.scaler_checked(args)
            return
        if cat == ops.CAST:
            self.amp.check_cast(func, args, out, phase, node, self._op_seq)  # type: ignore[arg-type]
            cat = ops.SKIP
        if cat == ops.SKIP:
            # A copy of data from outside the watch (a DataLoader's stack, .to(), an index) is still
            # outside data: only tensors made from what the watch produced count as produced.
            if ops.any_external(func, args, self.produced):
                self.produced.discard_all(out)
            else:
                self.produced.add_all(out)
            return
        outs = ops.float_outputs(out)
        if cat == ops.CHECK:
            if outs and len(self.log.events) < self.log.max_events:
                self.ops_checked += 1
                if self.deferred is not None:
                    self.deferred.queue_op(func, args, kwargs, outs, phase, node, pre,  # type: ignore[arg-type]
                                           self._op_seq)
                else:
                    bad = [t for t in outs if ops.is_bad_value(ops.sum_value(t))]
                    if bad:
                        self.immediate.examine(func, args, kwargs, bad, phase, node, pre,  # type: ignore[arg-type]
                                               self._op_seq)
        elif cat == ops.LIFT:
            # A tensor literal: infinities the user wrote are intentional, a NaN counts as input data.
            if any(ops.has_nan(t) for t in outs):
                return
        elif outs:  # ABSORB: a where/masked_fill may throw a born NaN/Inf away
            if self.deferred is not None:
                self.deferred.queue_absorb(args, kwargs, outs, node is not None)
            elif self.log.tracking_births():
                self.immediate.absorb(args, kwargs, outs)
        self.produced.add_all(out)

    def _remember(self, seq: int, func: Any) -> None:
        if len(self._places) > _NODE_CAP:
            for key in list(self._places)[: _NODE_CAP // 2]:
                del self._places[key]
        self._places[seq] = here(self.module_path(), func)


class _ThreadTracker(ModuleTracker):
    """Module hooks are global: only modules running in the watching thread enter its path stack
    (another thread's modules, under their own watch or none, would be named in our events)."""

    def __init__(self, checks: ModuleChecks, namespace: Optional[Mapping[str, Any]], **kw: Any) -> None:
        super().__init__(namespace, **kw)
        self._checks = checks

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        if self._checks.mine():
            super()._pre(module, args)

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() == self._checks.thread_id:
            super()._post(module, args, output)
