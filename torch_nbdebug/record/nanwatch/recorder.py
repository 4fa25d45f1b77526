"""Record where NaN/Inf values are born: forward and backward ops, module outputs, optimizer steps.

A birth is an op whose output is non-finite while all its floating inputs are finite (the rules are
in :mod:`core.rules`, one pure function for every path). Checks are a NaN/Inf-propagating sum
of each output: read at once on the immediate path (CPU), queued on the device and read once per
training step (when the backward starts) and at the end of the watch on the deferred one (CUDA).
The recorder wires small components together; each gets a :class:`WatchContext` (options, the event
log, the clock, a few services), not the recorder itself.
Everything installed here is removed in :meth:`NanRecorder.stop`, whatever happened.
"""
from __future__ import annotations

import bisect
import contextlib
import threading
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from torch_nbdebug.record import compat
from torch_nbdebug.record.nanwatch.core import ops
from torch_nbdebug.record.interrupts import deferred_interrupts
from torch_nbdebug.record.nanwatch.checks.amp import AmpChecks
from torch_nbdebug.record.nanwatch.replay.backward import BackwardGate, BackwardWatch
from torch_nbdebug.record.nanwatch.context import Clock, Mode, WatchOptions, uses_replay
from torch_nbdebug.record.nanwatch.checks.deferred import DeferredChecks
from torch_nbdebug.record.nanwatch.core.events import Place, here
from torch_nbdebug.record.nanwatch.checks.immediate import ImmediateChecks
from torch_nbdebug.record.nanwatch.core.layers import LayerRecorder
from torch_nbdebug.record.nanwatch.core.log import EventLog
from torch_nbdebug.record.nanwatch.checks.mode import OpWatchMode, take_function_mode
from torch_nbdebug.record.nanwatch.modules.checks import HALF_UNWATCHED, ModuleChecks
from torch_nbdebug.record.nanwatch.modules.tracker import ThreadTracker, not_traced
from torch_nbdebug.record.nanwatch.checks.optim import LearningRates, OptimizerWatch
from torch_nbdebug.record.nanwatch.replay.births import name_backward_births
from torch_nbdebug.record.nanwatch.replay.forward import Replayer
from torch_nbdebug.record.nanwatch.core.storage import StorageRegistry
from torch_nbdebug.record.nanwatch.recording import NanRecording

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
                 raise_on_birth: bool = False, defer: Optional[bool] = None, max_events: int = 50,
                 replay: bool = False) -> None:
        self.options = WatchOptions(mode, backward, optimizer, ignore_inf, raise_on_birth, bool(defer), max_events,
                                    uses_replay(replay, mode, bool(defer), raise_on_birth))
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
        self._rounded: dict[tuple[int, Optional[str]], float] = {}  # (iteration, module) -> an eps rounded to 0
        self._last_seq = -1
        self._op_seq: Optional[int] = None
        self._quiet = 0
        self._handles: list[Any] = []
        self._grad_handles: list[Any] = []
        self._tracker: Optional[ThreadTracker] = None
        self._mode: Optional[OpWatchMode] = None
        self._suspended_mode: Optional[OpWatchMode] = None
        self._model_off = False  # replay: the mode was taken off while a model's forward runs
        # replay: (sequence nr, module path now) at each module boundary in forward, and the model call's
        # line, so a backward birth names the module (and the call's line) of its forward op.
        self._moves: list[tuple[int, Optional[str]]] = []
        self._model_place: Optional[Place] = None
        # replay: the backward runs without the per-op mode (replay.backward); the gate catches its start
        self.backward_watch: Optional[BackwardWatch] = None
        self._gate: Optional[BackwardGate] = None
        self._suspended_gate: Optional[BackwardGate] = None
        if self.options.replay:
            replayer = Replayer(self, self._replay_watch, self.modules.module_fallback, self.own_hook_ids)
            self.modules.use_replay(replayer)
            if self.options.backward:
                self.backward_watch = BackwardWatch(self, replayer.note)
                self.modules.bad_gradient = self.backward_watch.gradient_bad

    # -- what the report reads ------------------------------------------------------------------
    def saw_torch(self) -> bool:
        return self.ops_seen > 0 or self.layers.seen() or bool(self.optim and self.optim.steps)

    def recording(self) -> NanRecording:
        """What was recorded so far, as plain data (:meth:`stop` returns it once everything is off)."""
        log, replayer = self.log, self.modules.replayer
        return NanRecording(self.options, tuple(log.events), frozenset(log.absorbed), self.layers.rows(set()),
                            self.ops_seen, self.ops_checked, log.dropped, log.full(), tuple(sorted(log.scaler_skips)),
                            self.saw_torch(), self.modules.other_thread,
                            tuple(replayer.notes if replayer is not None else ()) + tuple(self.errors),
                            tuple(self.clock.starts) if self.optim is not None else ())

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
        replay = self.options.replay
        exit_hook = self.modules.exit_kw if replay else self.modules.exit
        self._handles.append(compat.register_global_forward_hook(not_traced(exit_hook), with_kwargs=replay,
                                                                 always_call=replay))
        self._tracker = ThreadTracker(self.modules, self.namespace, on_enter=self.modules.enter,
                                       outer=self._outer if replay else None,
                                       # (the module of a backward birth in a model: the backward layer replays it)
                                       moved=self.module_moved if self.backward_watch is None else None,
                                       ended=self._model_ended if self.backward_watch is not None else None)
        self._tracker.__enter__()
        if self.options.optimizer:
            self.optim = OptimizerWatch(self, self.lr, self.suspend, self.resume, self.deferred)
            self._handles += [register_optimizer_step_pre_hook(self.optim.pre),
                              register_optimizer_step_post_hook(self.optim.post)]
        if self.options.mode == "op":
            self._mode = OpWatchMode(self._on_op, self.internal_error)
            self._mode.__enter__()
            if self.backward_watch is not None:
                self._gate = BackwardGate(self.backward_watch.run)
                self._gate.__enter__()
        if replay:  # before a step changes the weights: name the backward births of the forward just run
            self._handles.append(register_optimizer_step_pre_hook(self._before_step))

    def stop(self) -> NanRecording:
        """Remove every hook and mode; read outstanding device flags (errors there are not raised); hand
        over what was recorded."""
        try:
            if self.options.replay and self._mode is not None:  # while the hooks still name the modules
                with self.log.not_raising():
                    self.name_backward_births()
            with deferred_interrupts():  # a Stop here is raised once every hook and mode is removed
                self._remove()
        finally:
            self._remove()  # if a Stop came before the block above took effect; else a no-op
            self._finish()
        return self.recording()

    def _remove(self) -> None:
        """Take off the mode and every hook; safe to run twice."""
        try:
            self._model_off = False
            self.resume()  # an optimizer step (or, with replay, a model's forward) that raised left it suspended
            try:
                if self._gate is not None:
                    gate, self._gate = self._gate, None
                    if compat.function_stack_len() and \
                            compat.function_mode_at(compat.function_stack_len() - 1) is gate:
                        gate.__exit__(None, None, None)
                    else:  # the user's own function mode above it (left on by their code): take ours out only
                        take_function_mode(gate)
            finally:
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
            if self.modules.saw_half and self.modules.replayer is not None and not self.log.has_events():
                self.modules.replayer.note(HALF_UNWATCHED)  # what this watch did not see, said plainly
        except Exception as exc:  # noqa: BLE001 - e.g. a CUDA error: the user's own error matters more
            self.internal_error("the flags still on the device", exc)
        finally:
            self.produced.clear()
            self._places.clear()
            self._rounded.clear()
            self._moves.clear()
            self._model_place = None
            self.modules.forget()
            if self.backward_watch is not None:
                self.backward_watch.forget(everything=True)
            self.log.clear_keys()

    def suspend(self) -> None:
        """Take our dispatch mode off the stack (only when it is on top) while our own code or an
        optimizer step runs: those ops are not checked, so they should not pay the Python dispatch."""
        mode = self._mode
        if mode is not None and self._suspended_mode is None and _stack_len() and _stack_at(_stack_len() - 1) is mode:
            compat.pop_dispatch_mode()
            self._suspended_mode = mode
            gate = self._gate  # the backward gate goes with it (a compiled model sees no mode at all)
            if gate is not None and compat.function_stack_len() and \
                    compat.function_mode_at(compat.function_stack_len() - 1) is gate:
                compat.pop_function_mode()
                self._suspended_gate = gate

    def resume(self) -> None:
        mode, self._suspended_mode = self._suspended_mode, None
        gate, self._suspended_gate = self._suspended_gate, None
        if mode is not None:
            compat.push_dispatch_mode(mode)
        if gate is not None:
            compat.push_function_mode(gate)

    def _outer(self, entering: bool) -> None:
        """Replay: the per-op mode is off while a model's forward runs (its module layer watches it)."""
        if entering:
            if _current_node() is not None:
                return  # a forward run by backward (checkpointing): part of the running backward
            if self.modules.model_calls.calls and self._mode is not None:
                self.name_backward_births()  # a new forward: the last one's backward is done
            self._model_place = here(None, None)
            mode = self._mode
            if (mode is None or self._suspended_mode is not None or self._optimizer_busy()
                    or not _stack_len() or _stack_at(_stack_len() - 1) is not mode):
                return
            self.suspend()
            self._model_off = True
        elif self._model_off:
            self._model_off = False
            self.resume()

    def _model_ended(self, module: torch.nn.Module, output: Any, path: Optional[str]) -> None:
        """Replay: the outermost call returned; if its forward ran without the per-op mode, its backward
        is checked by the backward layer (the gradients into its outputs are kept until then)."""
        if self._model_off and self.backward_watch is not None and torch.is_grad_enabled():
            try:
                self.backward_watch.model_called(module, output, path)
            except Exception as exc:  # noqa: BLE001 - see OpWatchMode
                self.internal_error(f"the output of {type(module).__name__}", exc)

    # -- what the backward layer uses (replay.backward) ---------------------------------------
    def mode_on_top(self) -> bool:
        mode = self._mode
        return mode is not None and bool(_stack_len()) and _stack_at(_stack_len() - 1) is mode

    def mode_on_stack(self) -> bool:
        mode = self._mode
        return mode is not None and any(_stack_at(i) is mode for i in range(_stack_len()))

    def pop_mode(self) -> None:
        compat.pop_dispatch_mode()

    def push_mode(self) -> None:
        compat.push_dispatch_mode(self._mode)

    def watched(self, iteration: int) -> Any:
        return self._replay_watch(iteration)

    @contextlib.contextmanager
    def isolated(self, carry: bool = True) -> Iterator[tuple[EventLog, dict[int, Place]]]:
        """A replay's own event log and forward places (its births are brought over by the caller).
        ``carry``: its rules know whether a birth was reported before (else it starts as a new watch)."""
        saved = (self.log, self._places, self._moves, self._model_place)
        log, places = EventLog(self.options.max_events, False), dict[int, Place]()
        log.dropped = int(carry and self.log.has_events())  # the rules read "was a birth reported before"
        self.log, self._places, self._moves = log, places, []
        try:
            yield log, places
        finally:
            self.log, self._places, self._moves, self._model_place = saved

    def own_hook_ids(self) -> set[int]:
        """The ids of this watch's own global hooks (a replay runs them; they know to keep out of it)."""
        handles = self._handles + (self._tracker._handles if self._tracker is not None else [])
        return {h.id for h in handles}

    def _before_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        if threading.get_ident() == self.modules.thread_id and self._mode is not None:
            self.name_backward_births()
            if self.backward_watch is not None:
                self.backward_watch.forget()  # the weights change: no call before this step replays

    def name_backward_births(self) -> None:
        """Replay: name the forward op and line of the backward births of the model calls just run."""
        name_backward_births(self)

    @contextlib.contextmanager
    def _replay_watch(self, iteration: int) -> Iterator[None]:
        """The per-op watch, on for one replayed module call, as if the call ran at ``iteration``."""
        mode, clock, optim = self._mode, self.clock, self.optim
        saved = (self._quiet, optim.active if optim is not None else 0, clock.iteration, clock.saw_backward)
        on_stack = any(_stack_at(i) is mode for i in range(_stack_len()))
        self.modules.replaying = True
        self._quiet, clock.iteration, clock.saw_backward = 0, iteration, False
        if optim is not None:
            optim.active = 0
        if mode is not None and not on_stack:
            compat.push_dispatch_mode(mode)
        try:
            yield
        finally:
            if mode is not None and not on_stack:
                compat.pop_dispatch_mode()
            self._quiet, active, clock.iteration, clock.saw_backward = saved
            if optim is not None:
                optim.active = active
            self.modules.replaying = False

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
        text = f"could not check {where}: {type(exc).__name__}: {exc}"
        if len(self.errors) < 3 and text not in self.errors:  # (the same failure on every node: once)
            self.errors.append(text)

    def module_path(self) -> Optional[str]:
        return self._tracker.current if self._tracker is not None else None

    def forward_place(self, seq: int) -> Optional[Place]:
        place = self._places.get(seq)
        if place is None and self._moves:  # replay: an op inside a model's forward, where no mode ran
            i = bisect.bisect_right(self._moves, (seq, "\uffff")) - 1
            path = self._moves[i][1] if i >= 0 else None
            if path is not None and self._model_place is not None:
                return self._model_place._replace(module=path)
        return place

    def module_moved(self) -> None:
        """Replay: a module call started or ended in forward (see ``forward_place``)."""
        if len(self._moves) > _NODE_CAP:
            del self._moves[: _NODE_CAP // 2]
        self._moves.append((_get_sequence_nr(), self.module_path()))

    def keep_handle(self, handle: Any) -> None:
        self._grad_handles.append(handle)
        if len(self._grad_handles) > _HANDLE_CAP:  # long loops: forget hooks whose tensor or node is gone
            self._grad_handles = [h for h in self._grad_handles if h.hooks_dict_ref() is not None]

    def flush(self, extra: Sequence[torch.Tensor] = ()) -> list[list[float]]:
        """Read what waits on the device — module statistics, deferred checks (see checks.deferred)
        and ``extra`` — in one transfer per device (one host synchronisation on CUDA); replay the
        checks in order; return ``extra``'s values."""
        self._quiet += 1
        try:
            self.modules.check_kept()  # the CPU path's kept module outputs and gradients, first
            stats = self.layers.take_pending()
            pending, flags = self.deferred.take() if self.deferred is not None else ([], [])
            if not stats and not pending and not extra:
                return []
            if not stats and not pending and len(extra) == 1:  # (an optimizer step's norms, alone: no copy)
                return [extra[0].detach().reshape(-1).tolist()]
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
        if outs and outs[0].dtype in ops.HALF:  # (one dtype test: float32 ops pay nothing more)
            self._note_rounded(args, kwargs, outs[0].dtype)
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

    def _note_rounded(self, args: tuple, kwargs: dict, dtype: torch.dtype) -> None:
        """A constant the op's half dtype rounds to 0 (an eps): kept by iteration and module, for the hint of a
        0/0 born there (:meth:`rounded_constant`)."""
        value = ops.rounded_constant(args, kwargs, dtype)
        if value is not None:
            if len(self._rounded) >= _HANDLE_CAP:  # a long loop: the earlier iterations' are forgotten
                self._rounded.clear()
            self._rounded[(self.clock.iteration, self.module_path())] = value

    def rounded_constant(self, iteration: int, module: Optional[str]) -> Optional[float]:
        """The constant that rounded to 0 in this iteration and module (see :meth:`_note_rounded`), if any."""
        return self._rounded.get((iteration, module))

    def _remember(self, seq: int, func: Any) -> None:
        if len(self._places) > _NODE_CAP:
            for key in list(self._places)[: _NODE_CAP // 2]:
                del self._places[key]
        self._places[seq] = here(self.module_path(), func)
