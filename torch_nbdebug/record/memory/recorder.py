"""Record every tensor storage a block of code allocates and frees, with its category and origin.

A :class:`TorchDispatchMode` sees the outputs of every op; each storage not seen before is an
allocation (bytes counted once per storage, however many views share it). A weak reference with a
callback on the storage's Python object tells us when it is freed: PyTorch keeps that object alive
exactly as long as the storage, so the callback fires at the real free and keeps nothing alive. The
callback only queues the reference (no Python code of ours may run where Python swallows exceptions,
or Jupyter's Stop is lost: see record/interrupts.py); the free is recorded when the queue is drained,
before the next op, module, optimizer step or the end of recording, so events keep their order.

Categories come from what PyTorch tells us along the way: the ``AccumulateGrad`` node marks
gradients, optimizer step hooks mark parameters, gradients and optimizer state; anything else
allocated inside forward, backward or the optimizer step is a temporary, and the rest is "other".
Activations saved for backward are the allocations made in forward with grad mode on that are
still alive when the backward starts (or when recording stops): everything else made in forward
was freed as a temporary. We deliberately do not install saved-tensors hooks to see them: such
hooks switch off autograd's "modified by an inplace operation" check, which would change the
user's program. Tensors alive before recording are
found with the garbage collector and counted from the start.

Cost (issue 11): on CPU nothing but a dispatch mode reports every allocation with its op and shape
(no allocator history or hooks; the profiler's own memory feed costs more than the mode), so the
mode is the floor, and the Python per op is kept to a dictionary lookup when the op allocates
nothing new (views and in-place ops of known storages). ``bench/bench_memory.py --floors`` measures both,
and (issue 27) the profiler's op events with its memory feed, each allocation read with the op around it:
on the small model that costs more than this recorder, and the allocator's allocations (kernels' own
buffers included, the op around them mostly a factory such as ``empty_strided``) are not the storages
the timeline counts, so its bytes, peak and op would differ.
"""
from __future__ import annotations

import sys
import time
import weakref
from typing import AbstractSet, Any, Callable, Iterable, Mapping, Optional

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from torch_nbdebug.data.memory import CATEGORIES, PHASES, Allocation, MemoryRecording
from torch_nbdebug.data.source import SourceLine
from torch_nbdebug.record.compat import (own_parameters, 
    EagerDispatchMode, current_autograd_node, op_output_aliases_input, storage_id_of,
)
from torch_nbdebug.record.interrupts import CallbackQueue, WeakIdMap
from torch_nbdebug.record.lifecycle import HookScope
from torch_nbdebug.record.memory.holders import (
    find_holders, persistent_keys, scan_objects, storage_key,
)
from torch_nbdebug.record.memory.ops import (
    DTYPE_NAMES, builds_graph, dtype_name, input_storage_keys, on_device_test, tensors_in,
)
from torch_nbdebug.record.modules import ModuleTracker
from torch_nbdebug.record.source import line_of, user_position

PARAM, GRAD, OPT, ACT, TEMP, OTHER = range(len(CATEGORIES))
IDLE, FORWARD, BACKWARD, OPTIMIZER = range(len(PHASES))
_CATEGORY_INDEX = {name: i for i, name in enumerate(CATEGORIES)}
_NO_KEYS: frozenset[Optional[int]] = frozenset()
_now = time.perf_counter_ns  # event times are kept raw and made relative to the start once, at the end
# id(op) -> (op, may an output share an input's storage): read from the op's schema once per process
# (an op's schema never changes; the op is kept with its answer, so the id stays its own).
_ALIASING: dict[int, tuple[Any, bool]] = {}


class _StorageRef(weakref.ref):
    """A weak reference to a storage that remembers which allocation it stands for."""

    __slots__ = ("alloc_id",)
    alloc_id: int


class _Record:
    """Mutable bookkeeping for one allocation while recording (frozen into an Allocation at stop)."""

    __slots__ = ("nbytes", "shape", "dtype", "category", "phase", "module", "line", "op", "device",
                 "start", "end", "key", "address", "in_graph", "ref")

    def __init__(self, nbytes: int, shape: tuple[int, ...], dtype: str, category: int, phase: int,
                 module: Optional[str], line: Optional[SourceLine], op: str, device: str, start: int,
                 key: int, address: int) -> None:
        self.nbytes, self.shape, self.dtype, self.category, self.phase = nbytes, shape, dtype, category, phase
        self.module, self.line, self.op, self.device, self.start = module, line, op, device, start
        self.end: Optional[int] = None
        self.key, self.address = key, address
        self.in_graph = False  # made in forward with grad mode on: may be saved for backward
        self.ref: Optional[_StorageRef] = None  # kept here while the storage lives: its callback must fire


class _AllocationMode(EagerDispatchMode):
    """Forwards every op's outputs to the recorder; changes nothing about the op itself.

    Without dynamo's per-op wrapper (see ``EagerDispatchMode``): the recorder compiles nothing, and
    the block runs compiled code eagerly (api.memory's CompiledCode)."""

    def __init__(self, recorder: "MemoryRecorder") -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        __tracebackhide__ = True  # noqa: F841 - IPython hides this frame in the user's tracebacks
        recorder = self.recorder
        if recorder._freed:
            recorder._frees.drain()  # storages freed since the last op come before this op's
        out = func(*args, **(kwargs or {}))
        recorder._on_outputs(func, out, args, kwargs)
        return out


class MemoryRecorder:
    """Context manager recording the allocations of tensors on ``device_type`` ("cpu" or "cuda")."""

    def __init__(self, namespace: Optional[Mapping[str, Any]] = None, *, device_type: str = "cpu",
                 record_lines: bool = True, scan_gc: bool = False) -> None:
        self.namespace = namespace
        self.scan_gc = scan_gc
        self.device_type = device_type
        self.record_lines = record_lines
        self.recording: Optional[MemoryRecording] = None
        self._records: list[_Record] = []
        self._live: dict[int, int] = {}  # storage key -> allocation id
        self._log: list[int] = []  # (event code, time ns, phase) flattened, one extend per event (a Stop
        # cannot leave an event without its time or phase): written by _track and _on_free
        self._iterations: list[int] = []
        self._iteration_modules: set[int] = set()  # top-level modules called in the current iteration
        self._trained = False  # a backward or optimizer step ran: they, not repeated calls, mark iterations
        self.forward_calls = 0  # top-level module calls so far (read by a live view)
        self.on_forward: Optional[Callable[[], None]] = None  # called at each of them (a live view's update)
        self._in_optimizer = 0
        self._forward_pending = False  # graph-building forward allocations not yet classified
        self._last_phase = IDLE
        self._line_cache: dict[tuple[str, int, str], SourceLine] = {}
        self._device_names: dict[int, str] = {}  # tensor.get_device() -> "cpu", "cuda:0"...
        self._on_device = on_device_test(device_type)
        self._scope = HookScope()
        self._t0 = 0
        self._tracker = ModuleTracker(namespace, on_enter=self._on_module)
        self._frees: CallbackQueue[_StorageRef] = CallbackQueue(self._on_free)
        self._free_callback = self._frees.callback
        # The deque the callbacks append to (``callback`` is its bound ``append``): per op, testing it
        # is cheaper than calling ``drain`` on an empty queue.
        self._freed: Any = getattr(self._frees.callback, "__self__", self._frees)
        # Remembered weakly, without the Python callbacks of a WeakSet (see record/interrupts.py).
        self._modules: WeakIdMap[torch.nn.Module, None] = WeakIdMap()
        self._optimizers: WeakIdMap[torch.optim.Optimizer, None] = WeakIdMap()

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "MemoryRecorder":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        self._t0 = _now()
        self._adopt_existing()
        self._scope.open(self._install)

    def _install(self, scope: HookScope) -> None:
        scope.enter(self._tracker)
        scope.hook(register_optimizer_step_pre_hook(self._on_step_pre))
        scope.hook(register_optimizer_step_post_hook(self._on_step_post))
        scope.enter(_AllocationMode(self))

    def stop(self) -> MemoryRecording:
        try:
            self._scope.close()
        finally:
            try:
                self.recording = self._finish()
            finally:
                self._records.clear()  # with their weak references: no callbacks after this point,
                self._frees.clear()  # and nothing of the user's is kept
                self._live.clear()
                self._modules.clear()
                self._optimizers.clear()
        return self.recording

    # -- allocations ---------------------------------------------------------------------------
    def _adopt_existing(self) -> None:
        """Count tensors alive before recording (parameters, data...) as allocations at step -1.

        ``scan_gc`` finds every tensor through the garbage collector (exact, but a pass over every
        object: 0.1-0.5 s in a notebook with large libraries imported). By default the namespace
        walk finds what the user can reach in a few milliseconds, and tensors it misses are adopted
        as pre-existing the first time an op writes to or views them (see ``_on_outputs``).
        """
        if self.scan_gc:
            found = self._scan_gc()
        else:
            found = []
            find_holders(self.namespace, on_new=lambda key, tensor: found.append((key, tensor)), named=False)
        kinds = persistent_keys(*self._state_owners())
        live, on_device = self._live, self._on_device
        for key, tensor in found:
            if key is not None and key not in live and on_device(tensor):
                self._track(tensor, key, _CATEGORY_INDEX[kinds.get(key, "other")], IDLE, "", -1, None, None)

    def _scan_gc(self) -> list[tuple[Optional[int], torch.Tensor]]:
        """Every tensor the garbage collector tracks, with its storage key; the modules and optimizers
        found are remembered weakly, so the end of recording needs no second pass over every object."""
        tensors, modules, optimizers = scan_objects()
        for module in modules:
            self._modules[module] = None
        for optimizer in optimizers:
            self._optimizers[optimizer] = None
        return [(storage_key(tensor), tensor) for tensor in tensors]

    def _on_outputs(self, func: Any, out: Any, args: Any, kwargs: Any) -> None:
        """Record the storages an op's outputs hold that were not alive before it.

        Most ops return one tensor, and most outputs of views and in-place ops share a storage we
        know: those cost a dictionary lookup. For a new storage, what the op shares (its phase, its
        source line, its inputs' storages) is worked out once, and only when needed: inputs are read
        only for ops whose schema says an output may alias one (a tensor that existed before
        recording, written in place or viewed) and, outside modules, to tell a graph-building op."""
        if self._freed:
            self._frees.drain()  # storages the op itself freed (an out= or resize_ op) come first
        node = current_autograd_node()
        if node is not None and self._forward_pending:
            self._promote_saved()  # the backward has started: what forward made and is alive was saved
        live, on_device = self._live, self._on_device
        accumulates = node is not None and type(node).__name__ == "AccumulateGrad"
        phase = -1  # computed once per op, only when a new storage needs it
        line: Optional[SourceLine] = None
        input_keys: Optional[AbstractSet[Optional[int]]] = None
        for tensor in ((out,) if isinstance(out, torch.Tensor) else tensors_in(out)):
            if not on_device(tensor):
                continue
            try:
                storage = tensor.untyped_storage()
            except (RuntimeError, NotImplementedError, TypeError, AttributeError):
                continue  # sparse, nested, functional or wrapper subclasses: no plain storage
            key = storage_id_of(storage)
            alloc_id = live.get(key)
            if alloc_id is None:
                if input_keys is None:
                    input_keys = self._input_keys(func, args, kwargs)
                if key in input_keys and not func.__name__.startswith("lift_fresh"):
                    # An in-place op or a view of a tensor we never saw: it existed before recording.
                    # (``lift_fresh``: ``torch.tensor([...])`` made it from Python data just now.)
                    alloc_id = self._track(tensor, key, OTHER, IDLE, "", -1, None, None, storage)
                else:
                    if phase < 0:
                        phase = self._phase(node, args, kwargs)
                        line = self._user_line() if self.record_lines else None
                    stack = self._tracker.stack  # the innermost running module
                    alloc_id = self._track(tensor, key, TEMP if phase != IDLE else OTHER, phase, func.__name__,
                                           None, stack[-1] if stack else None, line, storage)
                    if phase == FORWARD and torch.is_grad_enabled():
                        # May be saved for backward by this op or a later one (a Linear saves its
                        # input even when that input was made without grad): decided when backward starts.
                        self._records[alloc_id].in_graph = True
                        self._forward_pending = True
            if accumulates:
                self._classify(alloc_id, GRAD)

    def _input_keys(self, func: Any, args: Any, kwargs: Any) -> AbstractSet[Optional[int]]:
        """The storages of the op's inputs when an output may share one (per its schema), else none."""
        # Keyed by id (an OpOverload hashes in Python); shared by every recorder (see _ALIASING).
        entry = _ALIASING.get(id(func))
        if entry is None:
            entry = _ALIASING[id(func)] = (func, op_output_aliases_input(func))
        return input_storage_keys((args, kwargs)) if entry[1] else _NO_KEYS

    def _track(self, tensor: torch.Tensor, key: int, category: int, phase: int, op: str,
               start: Optional[int], module: Optional[str], line: Optional[SourceLine],
               storage: Any = None) -> int:
        if storage is None:
            storage = tensor.untyped_storage()
        records = self._records
        alloc_id = len(records)
        dtype = DTYPE_NAMES.get(tensor.dtype) or dtype_name(tensor.dtype)
        index = tensor.get_device()
        device = self._device_names.get(index) or self._device_names.setdefault(index, str(tensor.device))
        record = _Record(storage.nbytes(), tuple(tensor.shape), dtype, category, phase, module, line, op, device,
                         -1 if start is None else start, key, storage.data_ptr())
        # One change at a time, in an order that a Stop landing between any two leaves consistent:
        # no event names a missing record, no free callback a record without its allocation.
        records.append(record)
        if start is None:
            log = self._log
            log.extend((alloc_id, _now(), phase))
            self._last_phase = phase
            record.start = len(log) // 3 - 1
        ref = _StorageRef(storage, self._free_callback)
        ref.alloc_id = alloc_id
        record.ref = ref
        self._live[key] = alloc_id
        return alloc_id

    def _on_free(self, ref: _StorageRef) -> None:
        """Record a queued free. It happened after the last event and before the op (or hook) draining
        the queue: it takes the last event's phase, like the frees of the CUDA allocator's history."""
        record = self._records[ref.alloc_id]
        if self._live.get(record.key) != ref.alloc_id:
            return
        log = self._log  # the phase stays the last event's
        log.extend((-(ref.alloc_id + 1), _now(), self._last_phase))
        record.end = len(log) // 3 - 1
        del self._live[record.key]
        record.ref = None

    def _phase(self, node: Any, args: Any, kwargs: Any) -> int:
        """Optimizer step, backward (an autograd node is running), forward (inside a module, or an op
        that extends the graph, like a loss computed outside the model), else idle."""
        if self._in_optimizer:
            self._trained = True
            return OPTIMIZER
        if node is not None:
            self._trained = True
            if self._forward_pending:
                self._promote_saved()
            return BACKWARD
        if self._tracker.stack or builds_graph((args, kwargs)):
            return FORWARD
        return IDLE

    def _promote_saved(self) -> None:
        """Forward allocations of the graph still alive now (backward starts, or recording stops)
        are what autograd saved for backward (or graph outputs): activations, not temporaries."""
        self._forward_pending = False
        for alloc_id in self._live.values():
            record = self._records[alloc_id]
            if record.in_graph and record.category == TEMP:
                record.category = ACT

    def _classify(self, alloc_id: int, category: int) -> None:
        record = self._records[alloc_id]
        record.category = min(record.category, category)  # parameters > gradients > ... > other

    def _classify_tensors(self, tensors: Iterable[Any], category: int) -> None:
        """Classify the allocations of these tensors (anything else, like a missing grad, is skipped):
        one call per hook, not per tensor, as the hooks pass hundreds of them."""
        live = self._live
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor):
                continue
            try:  # storage_key without a Python call per tensor, as in _on_outputs
                alloc_id = live.get(storage_id_of(tensor.untyped_storage()))
            except (RuntimeError, NotImplementedError, TypeError, AttributeError):
                continue  # no plain storage
            if alloc_id is not None:
                self._classify(alloc_id, category)

    def _user_line(self) -> Optional[SourceLine]:
        # What line_of reads, as the key: strings hash from a cache (a code object hashes its contents).
        key = user_position(sys._getframe(1))
        if key is None:
            return None
        line = self._line_cache.get(key)
        if line is None:
            line = self._line_cache[key] = line_of(*key)
        return line

    # -- hooks ---------------------------------------------------------------------------------
    def _on_module(self, path: str, module: torch.nn.Module) -> None:
        self._frees.drain()
        if len(self._tracker.stack) == 1:
            self._modules[module] = None
            # A new iteration: after a backward/optimizer phase, or (a forward-only loop, evaluation)
            # when a top-level module is called again. A forward run again by the backward (gradient
            # checkpointing's) is no new iteration.
            again = not self._trained and id(module) in self._iteration_modules
            if (self._last_phase != FORWARD or not self._iterations or again) and current_autograd_node() is None:
                self._iterations.append(len(self._log) // 3)
                self._iteration_modules.clear()
            self._iteration_modules.add(id(module))
            self.forward_calls += 1
            if self.on_forward is not None:
                try:
                    self.on_forward()
                except Exception:  # noqa: BLE001 - a live view must never break the user's code
                    self.on_forward = None
        self._classify_tensors(own_parameters(module), PARAM)

    def _on_step_pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._frees.drain()
        self._in_optimizer += 1
        self._optimizers[optimizer] = None
        params = [param for group in optimizer.param_groups for param in group["params"]]
        self._classify_tensors(params, PARAM)
        self._classify_tensors((param.grad for param in params), GRAD)

    def _on_step_post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._frees.drain()
        self._in_optimizer = max(0, self._in_optimizer - 1)
        self._classify_tensors((value for state in list(optimizer.state.values()) for value in list(state.values())),
                               OPT)

    # -- result --------------------------------------------------------------------------------
    def _finish(self) -> MemoryRecording:
        """Classify what survived by the model/optimizer state, name holders, freeze the data."""
        self._frees.drain()
        duration = (_now() - self._t0) / 1e9
        if self._forward_pending:
            self._promote_saved()
        kinds = persistent_keys(*self._state_owners())
        holders = find_holders(self.namespace, on_new=self._adopt_unseen, known=self._live)
        for key in holders.name_saved():
            alloc_id = self._live.get(key)
            if alloc_id is not None:
                self._classify(alloc_id, ACT)  # saved for backward by a held graph, wherever it was made
        allocations = self._freeze(kinds, holders)
        log = np.asarray(self._log, dtype=np.int64).reshape(-1, 3)
        return MemoryRecording(
            device=self.device_type, allocations=allocations,
            events=np.ascontiguousarray(log[:, 0]),
            event_time_ns=log[:, 1] - self._t0,
            event_phase=log[:, 2].astype(np.int8),
            iteration_starts=tuple(self._iterations), duration_s=duration)

    def _adopt_unseen(self, key: int, tensor: torch.Tensor) -> None:
        """A tensor the namespace holds that no op produced (``torch.from_numpy``, made by C++ code we
        cannot see): it appeared during the block, so it is counted from the last event on."""
        if key not in self._live and self._on_device(tensor):
            self._track(tensor, key, OTHER, IDLE, "(made outside torch ops)", None, None, None)

    def _state_owners(self) -> tuple[list[torch.nn.Module], list[torch.optim.Optimizer]]:
        """Modules and optimizers alive at the start, run or stepped during recording, or in the namespace."""
        # Keyed by id: the model that ran is usually in the namespace too, and is read once.
        modules = {id(sub): sub for m in list(self._modules.keys()) for sub in m.modules()}
        optimizers = {id(opt): opt for opt in list(self._optimizers.keys())}
        for value in list((self.namespace or {}).values()):
            if isinstance(value, torch.nn.Module):
                modules.update((id(sub), sub) for sub in value.modules())
            elif isinstance(value, torch.optim.Optimizer):
                optimizers.setdefault(id(value), value)
        return list(modules.values()), list(optimizers.values())

    def _freeze(self, kinds: dict[int, str], holders: Any) -> tuple[Allocation, ...]:
        """Every record as an Allocation; one alive at the end takes the training state it belongs to
        and its holder. One loop without a call per row but the row's own: recorders freeze thousands."""
        build, names, graphs = Allocation.from_values, holders.names, holders.graphs
        rows = []
        for alloc_id, r in enumerate(self._records):
            category, holder, has_graph = r.category, None, False
            if r.end is None:
                kind = kinds.get(r.key)
                if kind is not None:
                    category = min(category, _CATEGORY_INDEX[kind])
                holder, has_graph = names.get(r.key), bool(graphs.get(r.key, False))
            # Field order: id, nbytes, shape, dtype, category, phase, start, end, module, line, op, device,
            # holder, has_graph, address.
            rows.append(build(alloc_id, r.nbytes, r.shape, r.dtype, CATEGORIES[category], PHASES[r.phase],
                              r.start, r.end, r.module, r.line, r.op, r.device, holder, has_graph, r.address))
        return tuple(rows)

    # -- live progress (read-only) -----------------------------------------------------------
    def progress(self) -> tuple[float, tuple[int, ...]]:
        """For a live view while recording: seconds since the start and the bytes alive now by
        category (``CATEGORIES`` order). Host bookkeeping only: no device access, no sync. Forward
        allocations of the graph still alive count as activations (what they become at backward)."""
        totals = [0] * len(CATEGORIES)
        records = self._records
        for alloc_id in list(self._live.values()):
            r = records[alloc_id]
            category = ACT if r.in_graph and r.category == TEMP else r.category
            totals[category] += r.nbytes
        return (time.perf_counter_ns() - self._t0) / 1e9, tuple(totals)
