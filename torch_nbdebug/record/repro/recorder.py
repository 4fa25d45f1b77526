"""One run of a cell under ``%%repro``: every op with the fingerprints of what it read and made.

A ``TorchDispatchMode`` sees each ATen op (forward, backward and optimizer). Outputs are fingerprinted
(``ops.fingerprint_tensor``: a few reductions, no copies); an input made by an earlier op of the
same run, unchanged since, is recorded as a reference to that op's output instead of being read
again. Views read no data and make none, so their outputs are references too (kept under the
version counter they share with their base, and by what they alias for the copy autograd passes on).
Memory from ``torch.empty``-like ops is tracked until fully written: an op that reads it first is marked.
Copies (``clone``, ``cat``, ``_to_copy``) are not read: equal inputs make equal copies. Ops inside an
optimizer step take a short path (``_optimizer_op``): compared by name, scalars and output count, not
read, except random ops and those PyTorch lists as nondeterministic.

The second run also records where each op ran (module, user line; for backward ops the forward op
that made the node) and, through ``check``, stops recording at the first difference it explains.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from torch_nbdebug.data.repro import Fingerprint, OpPlace, OpTrace, Phase, nondeterministic_on
from torch_nbdebug.record.compat import (tensor_version, StorageWeakRef, current_autograd_node,
                                         next_sequence_nr, node_sequence_nr, storage_key, tensor_key)
from torch_nbdebug.record.lifecycle import CallDispatchMode, HookScope
from torch_nbdebug.record.modules import ModuleTracker
from torch_nbdebug.record.repro.ops import (FingerprintValue, OpInfo, fingerprint_now, fingerprint_tensor,
                                            fingerprintable, named_tensors, op_info, read_fingerprints,
                                            scalars_key)
from torch_nbdebug.record.repro.write import write_out_of_place
from torch_nbdebug.record.source import user_frame

Slot = Any  # ("fp" | "fpd", index, shape, dtype) | ("ref", op, k) | ("mark", text) | None
_FLUSH_EVERY = 64
_COPY: Slot = ("mark", "a copy of its input")


class ReproRecorder:
    """Records one run. ``labels`` names state tensors by id; ``before_write`` is called with each
    tensor an op is about to write (copy-on-write snapshots), unless ``movable`` says the op's
    out-of-place twin may write it and ``move`` gives it the result (see write.py);
    ``check(traces)`` returns True to stop."""

    read_at_once: tuple[str, ...] = ("cpu",)  # devices whose fingerprints are read per op (no sync to wait)

    def __init__(self, namespace: Optional[Mapping[str, Any]] = None, *, labels: Optional[dict[int, str]] = None,
                 before_write: Optional[Callable[[torch.Tensor], None]] = None, places: bool = False,
                 check: Optional[Callable[[Sequence[OpTrace]], bool]] = None,
                 pristine: Optional[Callable[[torch.Tensor], bool]] = None,
                 restored: Optional[set[str]] = None,
                 movable: Optional[Callable[[torch.Tensor], bool]] = None,
                 move: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None) -> None:
        self.labels = labels or {}
        # The first read of a state tensor no op has written yet (``pristine``) sees the snapshot's
        # value, and so does the same read in run 2 (``restored``: what run 1 read so): both runs
        # record a mark for it instead of reading every parameter. A change made outside torch's ops
        # between the runs is caught by comparing the unwritten state after each run (api/repro.py).
        self.pristine_reads: set[str] = set()
        self._pristine, self._restored = pristine, set(restored or ())
        self.traces: list[OpTrace] = []
        self.places: list[Optional[OpPlace]] = []
        self.nondeterministic: dict[tuple[str, str], list[Any]] = {}  # (op, device) -> [count, place]
        self.alloc_places: dict[int, OpPlace] = {}                   # op index -> place of torch.empty
        self.stopped = False
        self.cuda_used = False
        self.errors: list[str] = []
        self._before_write, self._want_places, self._check = before_write, places, check
        self._movable, self._move = movable, move
        self._raw: list[tuple[Any, ...]] = []
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._values: list[FingerprintValue] = []         # CPU fingerprints, read at once
        self._device_values: list[FingerprintValue] = []  # device fingerprints, read in flush
        self._known: dict[int, tuple[int, int, Slot]] = {}  # TensorImpl -> (version, address, slot)
        # View outputs by what they alias: autograd hands the next op a new TensorImpl for a view
        # (same storage, geometry and version counter), which ``_known`` cannot recognise.
        self._views: dict[tuple[Any, ...], tuple[int, int, int, Slot]] = {}  # -> (version, address, writes, slot)
        self._writes: dict[Optional[int], int] = {}  # storage -> ops that wrote or made it, once views are kept
        # storage of an ``empty`` op's output not written yet -> (the op's index, a weak reference to it): its
        # address stays its own while held, and a freed one is forgotten (whether the allocator reused an
        # address decided which optimizer ops were compared in full: flaky)
        self._uninit: dict[int, tuple[int, StorageWeakRef]] = {}
        self._forward_places: dict[int, OpPlace] = {}
        self._optimizer_depth = 0
        self._last_seq = -1
        self._tracker = ModuleTracker(namespace)
        self._mode = CallDispatchMode(self.on_op)
        self._scope = HookScope()

    # -- scope ---------------------------------------------------------------------------------
    def __enter__(self) -> "ReproRecorder":
        self._scope.open(self._install)
        return self

    def _install(self, scope: HookScope) -> None:
        scope.enter(self._tracker)
        scope.callback(self._end_steps)
        scope.hook(register_optimizer_step_pre_hook(self._step_pre))
        scope.hook(register_optimizer_step_post_hook(self._step_post))
        scope.enter(self._mode)

    def __exit__(self, *exc: Any) -> None:
        try:
            self._scope.close()
        finally:
            self.flush()
            self._known.clear()
            self._views.clear()
            self._writes.clear()
            self._uninit.clear()
            self._forward_places.clear()

    def _end_steps(self) -> None:
        self._optimizer_depth = 0

    def _step_pre(self, *args: Any) -> None:
        self._optimizer_depth += 1

    def _step_post(self, *args: Any) -> None:
        self._optimizer_depth = max(0, self._optimizer_depth - 1)

    # -- one op --------------------------------------------------------------------------------
    def on_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        __tracebackhide__ = True  # noqa: F841 - IPython hides this frame in the user's tracebacks
        info = op_info(func)
        if self.stopped or info.skip:
            return func(*args, **kwargs)
        if self._optimizer_depth and info.light and not (self._uninit and self._uninit_alive()):
            return self._optimizer_op(info, func, args, kwargs)
        index = len(self.traces) + len(self._raw)
        phase = self._phase()
        # Optimizer steps are elementwise: deterministic given their inputs (the gradients, compared in
        # backward; the restored state) and their scalars, which are still compared. Their outputs are
        # not fingerprinted (a pass over every parameter and moment), except for the ops PyTorch lists
        # as nondeterministic and random ops. A parameter a step wrote is fingerprinted when it is next read.
        light = phase == "optimizer" and info.light
        named = named_tensors(info, args, kwargs)
        reads = [(n, t) for n, t in named if n.split("[")[0] not in info.overwrites] if info.overwrites else named
        inputs, origins = self._inputs(info, reads, light)
        uninit = self._uninit_read(info, reads)
        seq = next_sequence_nr() if self._want_places and phase == "forward" else None
        if info.writes:
            out = self._write(info, func, args, kwargs, named)
        else:
            out = func(*args, **kwargs)
        outputs = self._outputs(info, index, out, named, light)
        device = self._device(named, out)
        self._raw.append((info, phase, scalars_key(args, kwargs), inputs, outputs, tuple([n for n, _ in reads]),
                          origins, uninit, device))
        self._where(info, index, phase, seq, device)
        if len(self._raw) >= _FLUSH_EVERY:
            self.flush()
        return out

    def _optimizer_op(self, info: OpInfo, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An op of an optimizer step, on the short path (a step runs ~10 ops per parameter): its name,
        scalars and output count are compared; its inputs are the gradients (compared as backward's
        outputs) and the restored state, its outputs are not read (see ``light`` in :meth:`on_op`).
        What the step writes is still saved first (copy-on-write) and forgotten afterwards."""
        __tracebackhide__ = True  # noqa: F841 - IPython hides this frame in the user's tracebacks
        written: list[torch.Tensor] = []
        if info.writes:
            named = named_tensors(info, args, kwargs)
            written = [t for n, t in named if n.split("[")[0] in info.writes]
            out = self._write(info, func, args, kwargs, named)
        else:
            out = func(*args, **kwargs)
        made = [out] if isinstance(out, torch.Tensor) else \
            [t for t in (out if isinstance(out, (list, tuple)) else ()) if isinstance(t, torch.Tensor)]
        made += [w for w in written if not any(w is t for t in made)]
        known, views, writes = self._known, self._views, self._writes
        for t in made:
            known.pop(tensor_key(t), None)  # a tensor made or written here is read afresh by later ops
            if views:  # views of memory written here are stale
                key = storage_key(t)
                writes[key] = writes.get(key, 0) + 1
        device = self._device((), made[0] if made else None)
        self._raw.append((info, "optimizer", scalars_key(args, kwargs), (), (("mark", "optimizer"),) * len(made),
                          (), (), None, device))
        if self._want_places:
            self.places.append(self._place("optimizer"))
        if len(self._raw) >= _FLUSH_EVERY:
            self.flush()
        return out

    def _write(self, info: OpInfo, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
               named: list[tuple[str, torch.Tensor]]) -> Any:
        """Run an op that writes some of its arguments in place, state it writes saved first: moved
        when its first write can be computed out of place (write.py), else copied (copy-on-write)."""
        __tracebackhide__ = True  # noqa: F841 - IPython hides this frame in the user's tracebacks
        if self._move is not None and self._movable is not None and info.twin is not None and \
                write_out_of_place(info, args, kwargs, named, self._movable, self._move):
            return args[0] if info.returns_self else None
        if self._before_write is not None:
            for name, t in named:
                if name.split("[")[0] in info.writes:
                    self._before_write(t)
        return func(*args, **kwargs)

    def _phase(self) -> Phase:
        if self._optimizer_depth:
            return "optimizer"
        return "backward" if current_autograd_node() is not None else "forward"

    def _inputs(self, info: OpInfo, reads: list[tuple[str, torch.Tensor]],
                light: bool) -> tuple[list[Slot], list[Optional[str]]]:
        slots: list[Slot] = []
        origins: list[Optional[str]] = []
        for _, t in reads:
            known = self._known.get(tensor_key(t))
            garbage = bool(self._uninit) and not info.is_view and storage_key(t) in self._uninit
            if known is not None and known[0] == tensor_version(t) and known[1] == _address(t) and not garbage:
                slots.append(known[2])
                origins.append(None)
                continue
            if known is None and self._views and not garbage:
                view = self._view_of(t)
                if view is not None:
                    slots.append(view)
                    origins.append(None)
                    self._remember(t, view)
                    continue
            origins.append(self._origin(info, t))
            if light:  # inside an optimizer step: its state is compared through the parameters it writes
                slots.append(("mark", "optimizer state"))
                continue
            slot = self._state_read(t, origins[-1])
            slots.append(slot)
            self._remember(t, slot)
        return slots, origins

    def _state_read(self, t: torch.Tensor, origin: Optional[str]) -> Slot:
        label = origin[6:] if origin is not None and origin.startswith("state:") else None
        if label is not None and label in self._restored:
            self._restored.discard(label)
            return ("mark", f"snapshot of {label}")
        if label is not None and self._pristine is not None and label not in self.pristine_reads and self._pristine(t):
            self.pristine_reads.add(label)
            return ("mark", f"snapshot of {label}")
        return self._fingerprint(t)

    def _origin(self, info: OpInfo, t: torch.Tensor) -> str:
        if info.lift:
            return "python_data"
        if storage_key(t) in self._uninit:
            return "uninitialized"
        label = self.labels.get(id(t))
        return f"state:{label}" if label else "not_in_snapshot"

    def _uninit_alive(self) -> bool:
        """Whether an ``empty`` op's unwritten output is still alive (freed ones are forgotten here)."""
        for key in [k for k, (_, ref) in self._uninit.items() if ref.expired()]:
            del self._uninit[key]
        return bool(self._uninit)

    def _uninit_read(self, info: OpInfo, reads: list[tuple[str, torch.Tensor]]) -> Optional[int]:
        if not self._uninit or info.is_view:
            return None
        for _, t in reads:
            alloc = self._uninit.get(storage_key(t))  # type: ignore[arg-type]
            if alloc is not None:
                return alloc[0]
        return None

    def _outputs(self, info: OpInfo, index: int, out: Any, named: list[tuple[str, torch.Tensor]],
                 light: bool = False) -> list[Slot]:
        slots: list[Slot] = []
        tensors = [out] if isinstance(out, torch.Tensor) else \
            [t for t in (out if isinstance(out, (list, tuple)) else ()) if isinstance(t, torch.Tensor)]
        written = [t for n, t in named if n.split("[")[0] in info.writes] if info.writes else []
        # Arguments written in place but not returned (``_foreach_add_``) are outputs too.
        tensors += [w for w in written if not any(w is t for t in tensors)]
        for k, t in enumerate(tensors):
            key = storage_key(t)
            if self._views and not info.is_view:  # new or written memory: views of it seen before are stale
                self._writes[key] = self._writes.get(key, 0) + 1
            if info.empty:
                slot: Slot = ("mark", f"uninitialized@{index}")
                if key is not None:
                    self._uninit[key] = (index, StorageWeakRef(t.untyped_storage()))
            elif info.is_view:
                slot = ("ref", index, k)
                if key is not None:
                    # After this mode returns, the view shares its base's version counter (ADInplaceOrView).
                    version = _base_version(named, key)
                    if version is not None:
                        self._views[_geometry(t, key)] = (version, _address(t), self._writes.get(key, 0), slot)
                    self._remember(t, slot, version=version)
                    slots.append(slot)
                    continue
            elif light:
                slots.append(("mark", "optimizer"))
                self._known.pop(tensor_key(t), None)
                continue
            elif info.copies and fingerprintable(t):  # its inputs were compared: equal inputs, equal copies
                slot = _COPY
            else:
                slot = self._fingerprint(t)
            slots.append(slot)
            # The version of a tensor written in place is bumped after this mode returns (by the
            # ADInplaceOrView kernel above us): remember the version the next op will see.
            bump = 1 if written and any(t is w for w in written) else 0
            made = slot is _COPY or (slot is not None and slot[0] in ("fp", "fpd"))
            self._remember(t, ("ref", index, k) if made else slot, bump)
        self._mark_written(info, named, tensors)
        return slots

    def _mark_written(self, info: OpInfo, named: list[tuple[str, torch.Tensor]], outs: list[torch.Tensor]) -> None:
        """Memory an op made (not in place) or overwrote whole is initialized from now on."""
        if not self._uninit:
            return
        if not info.writes and not info.is_view and not info.empty:
            for t in outs:
                self._uninit.pop(storage_key(t), None)  # type: ignore[arg-type]
        for name, t in named:
            if name.split("[")[0] in info.overwrites and _covers_storage(t):
                self._uninit.pop(storage_key(t), None)  # type: ignore[arg-type]

    def _fingerprint(self, t: torch.Tensor) -> Slot:
        if not fingerprintable(t):
            return None
        try:
            if t.device.type in self.read_at_once:  # the CPU: nothing to wait for
                self._values.append(fingerprint_now(t))
                where, index = "fp", len(self._values) - 1
            else:  # read in flush, with many others (one transfer)
                self._pending.append(fingerprint_tensor(t))
                where, index = "fpd", len(self._device_values) + len(self._pending) - 1
        except (RuntimeError, TypeError, KeyError) as exc:
            if len(self.errors) < 3:
                self.errors.append(f"could not fingerprint a {t.dtype} tensor: {exc}")
            return None
        return (where, index, tuple(t.shape), str(t.dtype).replace("torch.", ""))

    def _view_of(self, t: torch.Tensor) -> Slot:
        """The slot of a view output ``t`` aliases exactly (same storage, offset, shape, strides and dtype),
        when neither it nor anything on its storage was written since; else None."""
        key = storage_key(t)
        entry = self._views.get(_geometry(t, key)) if key is not None else None
        if entry is None or entry[0] != tensor_version(t) or entry[1] != _address(t) or entry[2] != self._writes.get(key, 0):
            return None
        return entry[3]

    def _remember(self, t: torch.Tensor, slot: Slot, bump: int = 0, version: Optional[int] = None) -> None:
        if slot is None:
            return
        try:
            self._known[tensor_key(t)] = (tensor_version(t) + bump if version is None else version, _address(t), slot)
        except (TypeError, RuntimeError):  # tensors without a version counter (inference tensors)
            pass

    def _device(self, named: Sequence[tuple[str, torch.Tensor]], out: Any) -> str:
        t = named[0][1] if named else (out if isinstance(out, torch.Tensor) else None)
        if t is None and isinstance(out, (list, tuple)) and out and isinstance(out[0], torch.Tensor):
            t = out[0]
        device = "cpu" if t is None or t.is_cpu else t.device.type
        if device == "cuda":
            self.cuda_used = True
        return device

    # -- where (second run, and the few ops the report lists) --------------------------------------
    def _where(self, info: OpInfo, index: int, phase: Phase, seq: Optional[int], device: str) -> None:
        listed = info.maybe_nondeterministic and nondeterministic_on(info.name, device)
        if not (self._want_places or listed or info.empty):
            return
        place = self._place(phase)
        if self._want_places:
            self.places.append(place)
            if seq is not None and seq != self._last_seq:
                # The autograd kernel made a node for this op just before calling us: remember where.
                self._last_seq = seq
                self._forward_places[seq - 1] = place
        if listed:
            entry = self.nondeterministic.setdefault((info.name, device), [0, place])
            entry[0] += 1
        if info.empty:
            self.alloc_places[index] = place

    def _place(self, phase: Phase) -> OpPlace:
        if phase == "backward":
            node = current_autograd_node()
            forward = self._forward_places.get(node_sequence_nr(node)) if node is not None else None
            if forward is not None:
                return forward
        frame = user_frame()
        module = self._tracker.current if phase == "forward" else None
        if frame is None:
            return OpPlace(module=module)
        return OpPlace(module=module, filename=frame.f_code.co_filename, lineno=frame.f_lineno)

    # -- host side ------------------------------------------------------------------------------
    def flush(self) -> None:
        """Read pending fingerprints and turn raw records into traces; ask ``check`` whether to stop."""
        try:
            self._device_values.extend(read_fingerprints(self._pending))
        finally:
            self._pending = []
        raw, self._raw = self._raw, []
        resolve = self._resolve
        for info, phase, scalars, inputs, outputs, names, origins, uninit, device in raw:
            self.traces.append(OpTrace(op=info.name, phase=phase, scalars=scalars,
                                       inputs=tuple([resolve(s) for s in inputs]),
                                       outputs=tuple([resolve(s) for s in outputs]),
                                       input_names=names,
                                       input_origins=tuple(origins), random=info.random,
                                       reads_uninitialized=uninit, device=device))
        if raw and self._check is not None and not self.stopped and self._check(self.traces):
            self.stopped = True

    def _resolve(self, slot: Slot) -> Any:
        if slot is None:
            return None
        if slot[0] in ("fp", "fpd"):
            bits, sample = (self._values if slot[0] == "fp" else self._device_values)[slot[1]]
            return Fingerprint(shape=slot[2], dtype=slot[3], bits=bits, sample=sample)
        if slot[0] == "ref":
            return (slot[1], slot[2])
        return slot[1]  # "mark": a text


def _address(t: torch.Tensor) -> int:
    """Where the data lives: with the TensorImpl key and the version, tells a reused address apart."""
    try:
        return t.data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


def _base_version(named: list[tuple[str, torch.Tensor]], key: int) -> Optional[int]:
    """The version of the input a view aliases (its storage is ``key``), or None."""
    for _, base in named:
        if storage_key(base) == key:
            try:
                return tensor_version(base)
            except (TypeError, RuntimeError):  # inference tensors have no version counter
                return None
    return None


def _geometry(t: torch.Tensor, key: int) -> tuple[Any, ...]:
    return key, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype


def _covers_storage(t: torch.Tensor) -> bool:
    try:
        return t.numel() * t.element_size() >= t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return False
