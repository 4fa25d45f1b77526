"""Record where NaN/Inf values are born: forward and backward ops, module outputs, optimizer steps.

A birth is an op whose output is non-finite while all its floating inputs are finite (the rules are
in :mod:`core.rules`, one pure function for every path). Checks are a NaN/Inf-propagating sum
of each output: read at once on the immediate path (CPU), queued on the device and read once per
training step (when the backward starts) and at the end of the watch on the deferred one (CUDA).
The recorder wires small components together; each gets a :class:`WatchContext` (options, the event
log, the clock, a few services), not the recorder itself; the module tracker tells its subscribers
(the per-layer table, module mode's verdicts, replay's model boundaries and kept outputs) of each call.
Everything installed here is in one :class:`~torch_nbdebug.record.lifecycle.HookScope`, all of it removed
in :meth:`NanRecorder.stop`, whatever happened.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from torch_nbdebug.record import compat
from torch_nbdebug.record.compiled import eager_stance_held
from torch_nbdebug.record.lifecycle import HookScope, Recorder, Removable, TensorHooks
from torch_nbdebug.record.nanwatch.checks.amp import AmpChecks
from torch_nbdebug.record.nanwatch.checks.deferred import DeferredChecks
from torch_nbdebug.record.nanwatch.checks.immediate import ImmediateChecks
from torch_nbdebug.record.nanwatch.checks.mode import ModeSwitch, OpWatchMode
from torch_nbdebug.record.nanwatch.checks.optim import LearningRates, OptimizerWatch
from torch_nbdebug.record.nanwatch.context import Clock, Mode, WatchOptions, uses_replay
from torch_nbdebug.record.nanwatch.core import ops
from torch_nbdebug.record.nanwatch.core.events import Place
from torch_nbdebug.record.nanwatch.core.layers import LayerRecorder
from torch_nbdebug.record.nanwatch.core.log import EventLog
from torch_nbdebug.record.nanwatch.core.places import ForwardPlaces
from torch_nbdebug.record.nanwatch.core.storage import StorageRegistry
from torch_nbdebug.record.nanwatch.modules.table import ModuleTable
from torch_nbdebug.record.nanwatch.modules.tracker import ThreadTracker, WatchThread, not_traced
from torch_nbdebug.record.nanwatch.modules.verdicts import ModuleVerdicts
from torch_nbdebug.record.nanwatch.recording import NanRecording
from torch_nbdebug.record.nanwatch.replay.backward import BackwardGate, BackwardWatch
from torch_nbdebug.record.nanwatch.replay.births import name_backward_births
from torch_nbdebug.record.nanwatch.replay.boundaries import ModelBoundaries, ModuleMoves
from torch_nbdebug.record.nanwatch.replay.forward import ModelCalls, Replayer
from torch_nbdebug.record.nanwatch.replay.outputs import KeptOutputs

_get_sequence_nr = compat.next_sequence_nr
_stack_len = compat.dispatch_stack_len
_stack_at = compat.dispatch_mode_at
_current_node = compat.current_autograd_node
_categories = ops._cache


class NanRecorder(Recorder):
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
        self.thread = WatchThread()
        self.switch = ModeSwitch()
        self.model_calls = ModelCalls()  # replay: the outermost calls, to name backward births' forward ops
        self.optim: Optional[OptimizerWatch] = None
        self._scope = HookScope()
        self._final: Optional[NanRecording] = None  # what stop() handed over (the helpers are let go then)
        self.places = ForwardPlaces()
        self._last_seq = -1
        self._op_seq: Optional[int] = None
        self._quiet = 0
        self._handles: list[Removable] = []  # this watch's global hooks (a replay knows them by their ids)
        self._tensor_hooks = TensorHooks()
        self._tracker: Optional[ThreadTracker] = None
        self._notes: list[str] = []
        self._build_helpers()

    def _build_helpers(self) -> None:
        """The checks, the module layer and replay's layers the hooks call (again when a stopped watch starts
        anew: :meth:`_release` let go of them)."""
        self.immediate = ImmediateChecks(self)
        self.deferred = DeferredChecks(self) if self.options.defer else None
        self.amp = AmpChecks(self, self.immediate, self.deferred)
        self.replayer = Replayer(self, self._replay_watch, self._module_fallback, self.own_hook_ids) \
            if self.options.replay else None
        if self.replayer is not None:
            self.replayer.notes = self._notes  # (the notes of an earlier start, if any)
        self.verdicts = ModuleVerdicts(self, self._depth, self.replayer.note if self.replayer is not None else None)
        self.table = ModuleTable(self, self.layers, self.thread, self.verdicts, self.deferred, self._depth,
                                 self._optimizer_busy)
        # replay: the backward runs without the per-op mode (replay.backward); the gate catches its start
        self.backward_watch: Optional[BackwardWatch] = None
        self.keeper: Optional[KeptOutputs] = None
        self.boundaries: Optional[ModelBoundaries] = None
        self.moves: Optional[ModuleMoves] = None  # replay without its backward layer: where forward ops ran
        if self.replayer is not None:
            self.keeper = self.table.keeper = KeptOutputs(self, self.layers, self.replayer, self.verdicts,
                                                          self.model_calls, self._depth)
            if self.options.backward:
                self.backward_watch = BackwardWatch(self, self.replayer.note)
                self.table.bad_gradient = self.backward_watch.gradient_bad
            else:  # where forward ops inside a model ran, from the module boundaries crossed
                self.moves = ModuleMoves(self)
            self.boundaries = ModelBoundaries(self, self.switch, self.model_calls, self.backward_watch,
                                              self._optimizer_busy)

    # -- what the report reads ------------------------------------------------------------------
    def saw_torch(self) -> bool:
        return self.ops_seen > 0 or self.layers.seen() or bool(self.optim and self.optim.steps)

    def recording(self) -> NanRecording:
        """What was recorded so far, as plain data (:meth:`stop` returns it once everything is off)."""
        if self._final is not None:
            return self._final
        log, replayer = self.log, self.replayer
        return NanRecording(self.options, tuple(log.events), frozenset(log.absorbed), self.layers.rows(set()),
                            self.ops_seen, self.ops_checked, log.dropped, log.full(), tuple(sorted(log.scaler_skips)),
                            self.saw_torch(), self.thread.other_thread,
                            tuple(replayer.notes if replayer is not None else ()) + tuple(self.errors),
                            tuple(self.clock.starts) if self.optim is not None else ())

    # -- lifetime --------------------------------------------------------------------------
    def start(self) -> None:
        if self._final is not None:  # a stopped watch entered again: what it recorded goes on
            self._final = None
            self._build_helpers()
        try:
            self._scope.open(self._install)
        except BaseException:
            self.stop()
            raise

    def _install(self, scope: HookScope) -> None:
        replay = self.options.replay
        scope.callback(lambda: self._tensor_hooks.remove_all(lambda exc: self.internal_error("removing a hook", exc)))
        scope.callback(self._handles.clear)
        # Our module post hook goes first so the tracker still shows the exiting module. Dynamo must
        # not trace it into a torch.compile'd model (it would graph-break on every .item()): unless compiled
        # code runs eagerly for the whole watch (the eager stance, record.compiled), it is wrapped.
        exit_hook = self.table.exit_kw if replay else self.table.exit_now
        if not eager_stance_held():
            exit_hook = not_traced(exit_hook)
        self._handles.append(scope.hook(compat.register_global_forward_hook(exit_hook, with_kwargs=replay,
                                                                            always_call=replay)))
        tracker = self._tracker = ThreadTracker(self.thread, self.namespace)
        self.table.stack = tracker.stack  # (replay's exit and call starts read the path stack directly)
        if self.keeper is not None:
            self.keeper.stack = tracker.stack
        # (the order matters: the table first; replay's boundaries before its kept outputs)
        for watcher in (self.table, self.moves, self.boundaries, self.keeper) if replay else (self.table,
                                                                                             self.verdicts):
            if watcher is not None:
                tracker.subscribe(watcher)
        scope.callback(tracker.remove)  # (idempotent; also what a failed enter left)
        tracker.__enter__()
        if self.options.optimizer:
            self.optim = self.table.optim = OptimizerWatch(self, self.lr, self.switch.suspend, self.switch.resume,
                                                           self.deferred)
            self._handles += [scope.hook(register_optimizer_step_pre_hook(self.optim.pre)),
                              scope.hook(register_optimizer_step_post_hook(self.optim.post))]
        if self.options.mode == "op":
            gate = BackwardGate(self.backward_watch.run) if self.backward_watch is not None else None
            self.switch.put_on(scope, OpWatchMode(self._on_op, self.internal_error), gate)
            # (undone first) an optimizer step, or with replay a model's forward, that raised left it suspended
            scope.callback(self._resume_all)
        if replay:  # before a step changes the weights: name the backward births of the forward just run
            self._handles.append(scope.hook(register_optimizer_step_pre_hook(self._before_step)))

    def stop(self) -> NanRecording:
        """Remove every hook and mode; read outstanding device flags (errors there are not raised); hand
        over what was recorded."""
        if self._final is not None:
            return self._final
        try:
            if self.options.replay and self.switch.mode is not None:  # while the hooks still name the modules
                with self.log.not_raising():
                    self.name_backward_births()
            try:
                self._scope.close()  # (a Stop here is raised once every hook and mode is removed)
            except Exception as exc:  # noqa: BLE001 - all of it was removed; the user's own error matters more
                self.internal_error("removing its hooks", exc)
        finally:
            self._finish()
        recording = self.recording()
        self._release(recording)
        return recording

    def _release(self, recording: NanRecording) -> None:
        """The watch is over and ``recording`` made: let go of the helpers its hooks called. Each points back
        at the recorder (its ``ctx`` or ``host``, bound methods), so they formed reference cycles that only
        the garbage collector freed: a few hundred objects per watch, and a collection every other watched
        step of a small model (more time than the rest of the watch's start and stop). Let go of, they are
        freed as soon as the watch is dropped. What the recording needs stays (the log, the clock, the table's
        rows)."""
        self._final = recording
        self._notes = self.replayer.notes if self.replayer is not None else []
        self._tracker = self.optim = self.replayer = self.deferred = None
        self.backward_watch = self.keeper = self.boundaries = self.moves = None
        del self.immediate, self.amp, self.verdicts, self.table
        self._scope = HookScope()  # (its undo callbacks, run already, hold the recorder)

    def _resume_all(self) -> None:
        if self.boundaries is not None:
            self.boundaries.model_off = False
        self.switch.resume()

    def _finish(self) -> None:
        """Read what is still on the device and forget every key (nothing of the user's is kept)."""
        try:
            with self.log.not_raising():
                self.flush()
                self.log.commit_held()
            if self.keeper is not None:
                self.keeper.finish()  # what this watch did not see, said plainly
        except Exception as exc:  # noqa: BLE001 - e.g. a CUDA error: the user's own error matters more
            self.internal_error("the flags still on the device", exc)
        finally:
            self.produced.clear()
            self.places.clear()
            if self.moves is not None:
                self.moves.forget()
            self.table.forget()
            if self.backward_watch is not None:
                self.backward_watch.forget(everything=True)
            self.log.clear_keys()

    # -- what replay uses (replay.forward, replay.backward, replay.births) ------------------------
    @contextlib.contextmanager
    def isolated(self, carry: bool = True) -> Iterator[tuple[EventLog, dict[int, Place]]]:
        """A replay's own event log and forward places (its births are brought over by the caller).
        ``carry``: its rules know whether a birth was reported before (else it starts as a new watch)."""
        saved = (self.log, self.places.by_seq)
        log, places = EventLog(self.options.max_events, False), dict[int, Place]()
        log.dropped = int(carry and self.log.has_events())  # the rules read "was a birth reported before"
        self.log, self.places.by_seq = log, places
        try:
            with self.moves.isolated() if self.moves is not None else contextlib.nullcontext():
                yield log, places
        finally:
            self.log, self.places.by_seq = saved

    def own_hook_ids(self) -> set[int]:
        """The ids of this watch's own global hooks (a replay runs them; they know to keep out of it)."""
        handles = self._handles + (self._tracker._handles if self._tracker is not None else [])
        return {h.id for h in handles}

    def _before_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        if threading.get_ident() == self.thread.thread_id and self.switch.mode is not None:
            self.name_backward_births()
            if self.backward_watch is not None:
                self.backward_watch.forget()  # the weights change: no call before this step replays

    def name_backward_births(self) -> None:
        """Replay: name the forward op and line of the backward births of the model calls just run."""
        name_backward_births(self)

    def _module_fallback(self, entry: Any, first: int) -> None:
        """The replayer's module-level report (it is made before the verdicts, which take its ``note``)."""
        self.verdicts.module_fallback(entry, first)

    def watched(self, iteration: int) -> Any:
        return self._replay_watch(iteration)

    @contextlib.contextmanager
    def _replay_watch(self, iteration: int) -> Iterator[None]:
        """The per-op watch, on for one replayed module call, as if the call ran at ``iteration``."""
        mode, clock, optim = self.switch.mode, self.clock, self.optim
        saved = (self._quiet, optim.active if optim is not None else 0, clock.iteration, clock.saw_backward)
        on_stack = self.switch.on_stack()
        self.thread.replaying = True
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
            self.thread.replaying = False

    # -- the WatchContext services ------------------------------------------------------------
    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Our own statistics ops inside hooks: neither checked nor dispatched through the mode."""
        outer = self.switch.suspended
        self._quiet += 1
        if not outer:
            self.switch.suspend()
        try:
            yield
        finally:
            if not outer:
                self.switch.resume()
            self._quiet -= 1

    def internal_error(self, where: str, exc: Exception) -> None:
        """Our check failed (an exotic tensor or op): note it, never disturb the user's code."""
        text = f"could not check {where}: {type(exc).__name__}: {exc}"
        if len(self.errors) < 3 and text not in self.errors:  # (the same failure on every node: once)
            self.errors.append(text)

    def module_path(self) -> Optional[str]:
        return self._tracker.current if self._tracker is not None else None

    def forward_place(self, seq: int) -> Optional[Place]:
        place = self.places.by_seq.get(seq)
        if place is None and self.moves is not None:  # replay: an op inside a model's forward, no mode ran
            return self.moves.place_of(seq)
        return place

    def keep_handle(self, handle: Any) -> None:
        self._tensor_hooks.keep(handle)

    def flush(self, extra: Sequence[torch.Tensor] = ()) -> list[list[float]]:
        """Read what waits on the device — module statistics, deferred checks (see checks.deferred)
        and ``extra`` — in one transfer per device (one host synchronisation on CUDA); replay the
        checks in order; return ``extra``'s values."""
        self._quiet += 1
        try:
            if self.keeper is not None:
                self.keeper.check_kept()  # the CPU path's kept module outputs and gradients, first
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
                    self.places.remember(seq - 1, self.module_path(), func)
            else:
                self._op_seq = None
            phase = "forward"
        else:
            if not self.options.backward:
                return
            if not self.clock.saw_backward:
                self.table.backward_started()  # the deferred path reads the forward's checks now
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
            self.places.note_rounded(self.clock.iteration, self.module_path(), value)

    def rounded_constant(self, iteration: int, module: Optional[str]) -> Optional[float]:
        """The constant that rounded to 0 in this iteration and module (see :meth:`_note_rounded`), if any."""
        return self.places.rounded(iteration, module)
