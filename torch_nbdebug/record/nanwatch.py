"""Record where NaN/Inf values are born: forward and backward ops, module outputs, optimizer steps.

A birth is an op whose output is non-finite while all its floating inputs are finite. Checks are
a NaN/Inf-propagating sum of each output (confirmed precisely only when it flags); on CPU the
result is read at once, on CUDA the flags wait on the device and are read at module boundaries.
Everything installed here is removed in :meth:`NanRecorder.stop`, whatever happened.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
from typing import Any, Iterator, Mapping, Optional

import torch
from torch.nn.modules.module import register_module_forward_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from torch_nbdebug.data.nanwatch import NanEvent
from torch_nbdebug.errors import NanBirthError
from torch_nbdebug.record import nanwatch_ops as ops
from torch_nbdebug.record.modules import ModuleTracker, module_roots
from torch_nbdebug.record.nanwatch_events import (USER_BACKWARD, Place, here, kind_of, make_event, stats_of,
                                                  user_backward_frame)
from torch_nbdebug.record import nanwatch_deferred as deferred
from torch_nbdebug.record.nanwatch_layers import LayerRecorder
from torch_nbdebug.record.nanwatch_amp import AmpChecks
from torch_nbdebug.record.nanwatch_held import HeldBackward
from torch_nbdebug.record.nanwatch_modules import ModuleChecks
from torch_nbdebug.record.tensors import storage_key
from torch_nbdebug.record.nanwatch_mode import OpWatchMode, Pending
from torch_nbdebug.record.nanwatch_optim import OptimizerWatch
from torch_nbdebug.record.nanwatch_storage import StorageRegistry

_get_sequence_nr = torch._C._autograd._get_sequence_nr
_stack_len = torch._C._len_torch_dispatch_stack
_stack_at = torch._C._get_dispatch_stack_at
_current_node = torch._C._current_autograd_node
_categories = ops._cache
_NODE_CAP = 200_000  # forward places remembered for backward births (oldest dropped first)


class NanRecorder(ModuleChecks, HeldBackward, AmpChecks):
    """Context manager: watch everything torch does inside, collect :class:`NanEvent` births."""

    def __init__(self, namespace: Optional[Mapping[str, Any]] = None, *, mode: str = "op",
                 backward: bool = True, optimizer: bool = True, ignore_inf: bool = False,
                 raise_on_birth: bool = False, defer: Optional[bool] = None, max_events: int = 50) -> None:
        self.namespace, self.mode = namespace, mode
        self.backward, self.optimizer, self.ignore_inf = backward, optimizer, ignore_inf
        self.raise_on_birth, self.max_events = raise_on_birth, max_events
        self.defer = defer
        self.events: list[NanEvent] = []
        self.absorbed: set[int] = set()
        self.dropped = self.ops_seen = self.ops_checked = 0
        self.iteration = 1
        self.layers = LayerRecorder(deferred=bool(defer))
        self.produced = StorageRegistry()
        self._birth_keys: dict[int, int] = {}
        self._birth_seqs: dict[int, int] = {}
        self._places: dict[int, Place] = {}
        self._held: dict[int, list[NanEvent]] = {}  # backward births waiting for their node to finish
        self.pending: list[Pending] = []
        self._last_seq = -1
        self._op_seq: Optional[int] = None
        self._saw_backward = False
        self._quiet = 0
        self._handles: list[Any] = []
        self._grad_handles: list[Any] = []
        self._tracker: Optional[ModuleTracker] = None
        self._mode: Optional[OpWatchMode] = None
        self._optim: Optional[OptimizerWatch] = None
        self._suspended_mode: Optional[OpWatchMode] = None
        self.errors: list[str] = []
        self.thread_id = threading.get_ident()
        self.scaler_skips: set[int] = set()  # iterations whose step GradScaler skipped (inf gradients)
        self._scaler_mark = 0  # events before this index were seen by an earlier GradScaler check
        self.other_thread = False
        self._last_exit: Optional[tuple[Any, Optional[list[float]], Any]] = None  # (weakref, values, hook)

    # -- lifetime --------------------------------------------------------------------------
    def __enter__(self) -> "NanRecorder":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        try:
            # Our module post hook goes first so the tracker still shows the exiting module. Dynamo must
            # not trace it into a torch.compile'd model (it would graph-break on every .item()).
            self._handles.append(register_module_forward_hook(torch.compiler.disable(self._module_exit)))
            self._tracker = ModuleTracker(self.namespace, on_enter=self._module_enter)
            self._tracker.__enter__()
            if self.optimizer:
                self._optim = OptimizerWatch(self)
                self._handles += [register_optimizer_step_pre_hook(self._optim.pre),
                                  register_optimizer_step_post_hook(self._optim.post)]
            if self.mode == "op":
                self._mode = OpWatchMode(self._on_op, self.internal_error)
                self._mode.__enter__()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Remove every hook and mode; read outstanding device flags (errors there are not raised)."""
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
                self._tracker.remove()
        try:
            self.commit_held()
            self.flush(raising=False)
        except Exception as exc:  # noqa: BLE001 - e.g. a CUDA error: the user's own error matters more
            self.internal_error("the flags still on the device", exc)
        finally:
            self.produced.clear()
            self._places.clear()
            self._last_exit = None
            self._birth_keys.clear()
            self.pending.clear()

    def suspend(self) -> None:
        """Take our dispatch mode off the stack (only when it is on top) while our own code or an
        optimizer step runs: those ops are not checked, so they should not pay the Python dispatch."""
        mode = self._mode
        if mode is not None and self._suspended_mode is None and _stack_len() and _stack_at(_stack_len() - 1) is mode:
            torch._C._pop_torch_dispatch_stack(None)
            self._suspended_mode = mode

    def resume(self) -> None:
        mode, self._suspended_mode = self._suspended_mode, None
        if mode is not None:
            torch._C._push_on_torch_dispatch_stack(mode)

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

    def has_events(self) -> bool:
        return bool(self.events) or self.dropped > 0

    # -- iteration bookkeeping ----------------------------------------------------------------
    def _forward_tick(self) -> None:
        """A forward after a backward starts the next iteration (module entry; ops inline this)."""
        if self._saw_backward:
            self._saw_backward = False
            self.iteration += 1

    # -- op level --------------------------------------------------------------------------
    def _on_op(self, func: Any, args: tuple, kwargs: dict, out: Any, pre: Optional[torch.Tensor] = None) -> None:
        # The hot path: runs for every op, so it is kept flat (no helper calls for the common cases).
        if self._quiet or (self._optim is not None and self._optim.active):
            return
        self.ops_seen += 1
        cat = _categories.get(func)
        if cat is None:
            cat = ops.category(func)
        node = _current_node()
        if node is None:
            if self._saw_backward:  # a forward after a backward: the next iteration of a loop
                self._saw_backward = False
                self.iteration += 1
            seq = _get_sequence_nr()
            if seq != self._last_seq:
                # The autograd kernel made a node for this op just before calling us: remember where.
                self._last_seq = seq
                self._op_seq = seq - 1
                if cat != ops.VIEW and self.backward:  # places serve backward births only
                    self._remember(seq - 1, func)
            else:
                self._op_seq = None
            phase = "forward"
        else:
            if not self.backward:
                return
            self._saw_backward = True
            phase = "backward"
        if cat == ops.VIEW:
            return
        if cat == ops.SCALER:
            self._scaler_checked(args)
            return
        if cat == ops.CAST:
            self._check_cast(func, args, out, phase, node)
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
            if outs and len(self.events) < self.max_events:
                self.ops_checked += 1
                if self.layers.deferred:
                    deferred.queue_op(self, func, args, kwargs, outs, phase, node, pre)
                else:
                    bad = [t for t in outs if ops.is_bad_value(ops.sum_value(t))]
                    if bad:
                        self._examine(func, args, kwargs, bad, phase, node, pre)
        elif cat == ops.LIFT:
            # A tensor literal: infinities the user wrote are intentional, a NaN counts as input data.
            if any(ops.has_nan(t) for t in outs):
                return
        elif self._birth_keys and outs:  # ABSORB
            self._absorb(args, kwargs, outs)
        self.produced.add_all(out)

    def _remember(self, seq: int, func: Any) -> None:
        if len(self._places) > _NODE_CAP:
            for key in list(self._places)[: _NODE_CAP // 2]:
                del self._places[key]
        self._places[seq] = here(self.module_path(), func)

    def _examine(self, func: Any, args: tuple, kwargs: dict, bad: list[torch.Tensor], phase: str, node: Any,
                 pre: Optional[torch.Tensor] = None) -> None:
        """A cheap check flagged: decide birth / input / propagation, precisely, while tensors are alive."""
        if ops.has_nonfinite_scalar(args, kwargs):
            return  # masked_fill(m, -inf), x * inf: the user asked for it
        inputs = ops.op_inputs(func, args, kwargs)  # out= tensors are outputs, not inputs
        in_vals = [_confirmed(t, ops.sum_value(t)) for t in inputs]
        inplace = pre is not None and bool(inputs) and inputs[0] is args[0]
        if inplace:
            in_vals[0] = float(pre.item())  # x.log_(): judge self by its value before the op
        in_bad = [ops.is_bad_value(v) for v in in_vals]
        if not any(in_bad):
            bad = [t for t in bad if ops.any_nonfinite(t)]  # the sum may have overflowed
            if not bad:
                return
            verdict = "birth"
        else:
            verdict = self._verdict_with_bad_inputs(inputs, in_bad, in_vals, bad, phase)
            if verdict is None:
                return
        out_stats = stats_of(bad, 1)
        kind = kind_of(list(out_stats))
        if self.ignore_inf and kind == "inf":
            return
        # An in-place op's input now holds its result: show the other inputs only.
        shown, detail = (inputs[1:], "in-place op: its input was overwritten by the result") if inplace \
            else (inputs, "")
        if verdict == "input":
            culprits = [t for t, b in zip(inputs, in_bad) if b]
            shown = culprits[:2] + [t for t, b in zip(inputs, in_bad) if not b][:2]
            detail = self._describe_inputs(culprits)
        event = self._event(func, phase, node, verdict, stats_of(shown), out_stats[0], kind)
        if detail:
            event = dataclasses.replace(event, detail=", ".join(d for d in (event.detail, detail) if d))
        if event.phase == "backward" and node is not None:
            self._hold(node, event)
        else:
            self.add_event(event, bad)

    def _describe_inputs(self, culprits: list[torch.Tensor]) -> str:
        """``non-finite parameter model.fc.weight`` when a parameter (not the data) carries it."""
        # Ops see views (``weight.t()``), so parameters are matched by storage, not identity.
        by_storage: dict[int, str] = {}
        for root_name, root in module_roots(self.namespace):
            for name, p in root.named_parameters():
                by_storage.setdefault(storage_key(p) or -1, f"{root_name}.{name}")
        names = [by_storage[k] for k in (storage_key(t) for t in culprits) if k in by_storage]
        if not names:
            return "non-finite input data (not a parameter)"
        return "non-finite parameter " + ", ".join(names)

    def _verdict_with_bad_inputs(self, inputs: list[torch.Tensor], in_bad: list[bool], in_vals: list[float],
                                 bad: list[torch.Tensor], phase: str) -> Optional[str]:
        culprits = [t for t, b in zip(inputs, in_bad) if b]
        if phase == "backward" and self._from_absorbed(culprits):
            return "birth"  # the torch.where trap: a value the forward threw away poisons the gradient
        external = [v for t, b, v in zip(inputs, in_bad, in_vals) if b and not self.produced.contains(t)]
        out_nan = any(ops.has_nan(t) for t in bad)
        if external and not self.has_events() and not is_mask(external, out_nan):
            return "input"
        if phase == "forward" and not self.has_events() and any(v != v for v, b in zip(in_vals, in_bad) if b):
            # A NaN that no watched op made (a NaN the code wrote, data built inside the cell,
            # another thread): never stay silent, name its first consumer.
            return "input"
        if out_nan and not any(v != v for v in in_vals):
            return "birth"  # NaN made from infinities: inf - inf, 0 * inf, a fully masked softmax row
        if phase == "forward":
            self._propagated(culprits)
        return None

    def _from_absorbed(self, tensors: list[torch.Tensor]) -> bool:
        """Is one of these the saved output of a forward birth that a where/masked_fill threw away?"""
        if not self.absorbed:
            return False
        return any(self._birth_keys.get(storage_key(t) or -1) in self.absorbed for t in tensors)

    def _propagated(self, tensors: list[torch.Tensor]) -> None:
        """A non-finite value flowed on: a forward birth it came from was not absorbed after all."""
        for t in tensors:
            idx = self._birth_keys.get(storage_key(t) or -1)
            if idx is not None:
                self.absorbed.discard(idx)

    def _absorb(self, args: tuple, kwargs: dict, outs: list[torch.Tensor]) -> None:
        """``torch.where``/``masked_fill`` dropped a born NaN/Inf and kept a finite result."""
        if any(ops.is_bad_value(ops.sum_value(t)) for t in outs):
            return
        written = {storage_key(t) for t in outs}
        for t in ops.float_inputs(args, kwargs):
            key = storage_key(t) or -1
            idx = self._birth_keys.get(key)
            # In place (``y.masked_fill_(...)``) the born values were overwritten: the output is finite.
            if idx is not None and (key in written or ops.is_bad_value(ops.sum_value(t))):
                self.absorbed.add(idx)

    def _event(self, func: Any, phase: str, node: Any, verdict: str, inputs: tuple, output: Any, kind: str) -> NanEvent:
        op = ops.op_name(func)
        if phase == "backward" and verdict == "birth":
            seq = node._sequence_nr()
            fwd = self._places.get(seq)
            place = fwd if fwd is not None else here(None, None, sys._getframe(1))
            fwd_op = ops.op_name(fwd.op) if fwd is not None and fwd.op is not None else None
            fwd_module, fwd_line = place.module, place.lineno
            mine = user_backward_frame(sys._getframe(1))
            detail = ""
            if mine is not None:  # a custom autograd.Function's backward or a tensor hook: point at it
                place = Place(place.op, place.module, mine.f_code.co_filename, mine.f_lineno, mine.f_code.co_name)
                detail = USER_BACKWARD
            return make_event("backward", node.name(), place, inputs, output, kind=kind, iteration=self.iteration,
                              aten_op=op, node_name=node.name(), sequence_nr=seq, forward_op=fwd_op,
                              forward_module=fwd_module, forward_lineno=fwd_line, detail=detail)
        place = here(self.module_path() if phase == "forward" else None, func, sys._getframe(1))
        seq = self._op_seq if phase == "forward" else None
        extra: dict[str, Any] = dict(aten_op=op, sequence_nr=seq)
        if node is not None:
            extra.update(node_name=node.name(), sequence_nr=node._sequence_nr())
        return make_event("input" if verdict == "input" else phase, op, place, inputs, output, kind=kind,
                          iteration=self.iteration, **extra)

    def add_event(self, event: NanEvent, outputs: list[torch.Tensor]) -> None:
        if event.phase == "backward" and event.sequence_nr is not None and not event.deferred:
            # (Deferred checks cannot see a torch.where throw a forward birth away, so they keep both.)
            fwd = self._birth_seqs.get(event.sequence_nr)
            if fwd is not None and fwd not in self.absorbed:
                return  # the gradient of an op whose forward output was already reported as non-finite
        if len(self.events) >= self.max_events:
            self.dropped += 1
            return
        self.events.append(event)
        if event.phase == "forward" and event.sequence_nr is not None:
            self._birth_seqs[event.sequence_nr] = len(self.events) - 1
        if event.phase == "forward":
            for t in outputs:
                key = storage_key(t)
                if key is not None:
                    self._birth_keys[key] = len(self.events) - 1
        if self.raise_on_birth:
            raise NanBirthError(birth_message(event), event=event)

    # -- deferred (CUDA) --------------------------------------------------------------------
    def flush(self, raising: bool = True) -> None:
        """Read the device-side flags queued since the last boundary (see nanwatch_deferred)."""
        self._quiet += 1
        try:
            self.layers.flush()
            deferred.flush(self, raising)
        finally:
            self._quiet -= 1

    def forward_place(self, seq: int) -> Optional[Place]:
        return self._places.get(seq)

    @property
    def op_seq(self) -> Optional[int]:
        return self._op_seq


def _confirmed(t: torch.Tensor, total: float) -> float:
    """The input's propagating sum, or 0.0 when only the sum overflowed (huge but finite values)."""
    if ops.is_bad_value(total) and total == total and not ops.any_nonfinite(t):
        return 0.0
    return total


def is_mask(external_sums: list[float], out_nan: bool) -> bool:
    """An additive attention mask made before the watch (``generate_square_subsequent_mask``): only
    -inf (its sum is -inf) and no NaN comes out. Intentional, not bad input data."""
    return not out_nan and all(v == float("-inf") for v in external_sums)


def birth_message(event: NanEvent) -> str:
    """The NanBirthError text: what, where (the user's line), and how to look further."""
    where = f"line {event.lineno} of {event.filename}" if event.lineno is not None else "an unknown line"
    text = f"{event.title()}\n  at {where}"
    if event.line:
        text += f": {event.line}"
    if event.output is not None:
        text += f"\n  output: {event.output.brief()}"
    return text + "\n  (the full report is in the error's .report and, in a notebook, in _nanwatch)"

