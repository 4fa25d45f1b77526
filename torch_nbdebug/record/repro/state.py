"""The state a cell starts from, snapshotted once and restored once (before the second run).

Tensors are saved copy-on-write: cloned just before the first op of run 1 that writes them
(``before_write``), so a large dataset tensor the cell only reads costs nothing, and restored under
``no_grad`` with the user's tensors keeping their identity (sparse and jagged tensors, which have no
plain storage, are known by the tensor object the writing op is handed). A parameter that alone owns its memory
is not copied back: run 1 writes the clone and the parameter gets its own memory back; when run 1's
first write of it is an optimizer's elementwise update, that write is computed out of place into new
memory instead of cloning first (``movable``/``move``, see repro/write.py). A tensor only an
optimizer's state holds (Adam's moments) is restored by value, as ``load_state_dict`` would: its clone
takes its place in the restored state. Other tensors are copied back with ``copy_``. Optimizers' other
state, LR schedulers and gradient scalers are restored through copies of their state. Random generators
(torch CPU and CUDA, NumPy, Python ``random`` and ``torch.Generator`` objects) are snapshotted too.
Name bindings of a namespace are restored, so ``x = x + 1`` in the cell runs once from the same ``x``,
and so is grad mode.
"""
from __future__ import annotations

import copy
import random
import sys
import weakref
from typing import Any, Iterable, Iterator, MutableMapping, Optional

import torch
from torch import nn

from torch_nbdebug.record.compat import is_fake, storage_key, storage_use_count
from torch_nbdebug.record.interrupts import deferred_interrupts, no_grad_held
from torch_nbdebug.record.source import inspectable

_MISSING = object()


def _is_scheduler(value: Any) -> bool:
    return isinstance(value, torch.optim.lr_scheduler.LRScheduler) or \
        type(value).__name__ == "ReduceLROnPlateau"


def _is_scaler(value: Any) -> bool:
    return isinstance(value, torch.amp.GradScaler)


def _take_memory(tensor: torch.Tensor, source: torch.Tensor) -> None:
    """``tensor.set_(source)``: ``tensor`` now uses ``source``'s memory, offset, shape and strides."""
    tensor.set_(source.untyped_storage(), source.storage_offset(), source.size(), source.stride())


def is_state(value: Any) -> bool:
    """Whether ``value`` is something a run can change that the snapshot knows how to restore."""
    return isinstance(value, (nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Generator)) or \
        _is_scheduler(value) or _is_scaler(value) or is_loader(value)


def is_loader(value: Any) -> bool:
    return isinstance(value, torch.utils.data.DataLoader)


def state_in(namespace: MutableMapping[str, Any], skipped: Optional[list[str]] = None) -> list[tuple[str, Any]]:
    """The restorable values of a namespace (and one level inside its lists, tuples and dicts).

    A value that cannot be inspected (its type, length or items raise: an unbound proxy, a dead weak
    proxy, a container of the user's that misbehaves) is left out and its name added to ``skipped``.
    """
    found: list[tuple[str, Any]] = []
    for name, value in list(namespace.items()):
        if not issubclass(type(name), str) or name.startswith("_"):
            continue
        try:
            if not inspectable(value):
                raise TypeError("uninspectable")
            found.extend(_state_at(name, value))
        except Exception:  # noqa: BLE001 - whatever the user's object raises, it is only skipped
            if skipped is not None:
                skipped.append(name)
    return found


def _state_at(name: str, value: Any) -> list[tuple[str, Any]]:
    if _restorable(value):
        return [(name, value)]
    if isinstance(value, (list, tuple)) and len(value) <= 256:
        return [(f"{name}[{i}]", v) for i, v in enumerate(value) if _restorable(v)]
    if isinstance(value, dict) and len(value) <= 256:
        return [(f"{name}[{k!r}]", v) for k, v in list(value.items()) if _restorable(v)]
    return []


def _restorable(value: Any) -> bool:
    """State found in the namespace that a snapshot can copy: tensors with data (strided, sparse or
    nested; subclasses too, unless they dispatch on their own like FakeTensor or DTensor: a jagged
    nested tensor does, and is copied as one). A tensor subclass whose ``__torch_function__`` raises
    on the attributes read here makes ``state_in`` skip it."""
    if not inspectable(value) or not is_state(value):
        return False
    if isinstance(value, torch.Tensor):
        own_dispatch = type(value).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__
        return not (own_dispatch and not value.is_nested) and value.device.type != "meta" and \
            not value.is_quantized and not is_fake(value)
    return True


def _order(item: tuple[str, Any]) -> int:
    """Modules first (their parameters get their names), then tensors, then optimizers and the rest."""
    value = item[1]
    return 0 if isinstance(value, nn.Module) else 1 if isinstance(value, torch.Tensor) else 2


class RngSnapshot:
    """Every global random generator plus the given ``torch.Generator`` objects."""

    def __init__(self, generators: Iterable[torch.Generator] = ()) -> None:
        self.torch = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        numpy = sys.modules.get("numpy")
        self.numpy = numpy.random.get_state() if numpy is not None else None
        self.python = random.getstate()
        self.seed = torch.initial_seed()  # CUDA seeds lazily from it when it starts later
        self.generators = [(g, g.get_state()) for g in generators]

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        elif torch.cuda.is_initialized():  # the first run started CUDA: its generators began from the seed
            torch.cuda.manual_seed_all(self.seed)
        numpy = sys.modules.get("numpy")
        if self.numpy is not None and numpy is not None:
            numpy.random.set_state(self.numpy)
        random.setstate(self.python)
        for generator, state in self.generators:
            generator.set_state(state)


class StateSnapshot:
    """Snapshot of named state; :meth:`restore` puts it back once.

    Tensors are copy-on-write: the snapshot keeps a reference and clones a tensor only when an op of
    the first run is about to write it (``before_write``), so the cost is one copy of what the cell
    changes (the parameters and optimizer state a training step updates), nothing for what it reads.
    """

    def __init__(self, named: Iterable[tuple[str, Any]],
                 namespace: Optional[MutableMapping[str, Any]] = None, restore_rng: bool = True) -> None:
        self.names: list[str] = []
        self.labels: dict[int, str] = {}          # id(tensor) -> a name for reports
        self.watched: list[tuple[str, Any]] = []   # (name, weakref) of every state tensor, for end_state
        self._grads: list[tuple[torch.Tensor, Optional[torch.Tensor]]] = []
        self._training: list[tuple[nn.Module, bool]] = []
        self._structures: list[tuple[Any, Any]] = []  # (optimizer, (state, param_groups)) without tensor copies
        self._dicts: list[tuple[Any, Any]] = []       # LR schedulers: their state_dict
        self._objects: list[tuple[Any, Any]] = []     # GradScalers: their attributes
        self._cow: dict[Any, list[torch.Tensor]] = {}  # _cow_key -> tensors not yet saved
        self._saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Parameters run 1 wrote on a copy of their storage: (tensor, an alias of its own storage).
        self._moved: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Tensors only an optimizer's state holds: their saved copy takes their place in the restored
        # state (as ``load_state_dict`` would) instead of being copied back. id -> (tensor, copy).
        self._optimizer_only: set[int] = set()
        self._replaced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._bindings = dict(namespace) if namespace is not None else None
        self._namespace = namespace
        self._grad_enabled = torch.is_grad_enabled()  # a cell that turns autograd off runs twice with it on
        generators: list[torch.Generator] = []
        for name, value in sorted(named, key=_order):
            self._add(name, value, generators)
        self.rng = RngSnapshot(generators) if restore_rng else None

    # -- taking --------------------------------------------------------------------------------
    def _add(self, name: str, value: Any, generators: list[torch.Generator]) -> None:
        if isinstance(value, nn.Module):
            self._add_module(name, value)
        elif isinstance(value, torch.Tensor):
            self._add_tensor(name, value)
        elif isinstance(value, torch.Generator):
            generators.append(value)
        elif is_loader(value):
            if value.generator is not None:
                generators.append(value.generator)
            return
        elif isinstance(value, torch.optim.Optimizer):
            self._add_optimizer(name, value)
        elif _is_scaler(value):
            self._add_scaler(name, value)
        elif _is_scheduler(value):
            self._dicts.append((value, copy.deepcopy(value.state_dict())))
        self.names.append(name)

    def _add_module(self, name: str, module: nn.Module) -> None:
        for pname, p in module.named_parameters(remove_duplicate=True):
            self._add_tensor(f"{name}.{pname}", p)
        for bname, b in module.named_buffers(remove_duplicate=True):
            self._add_tensor(f"{name}.{bname}", b)
        self._training.extend((m, m.training) for m in module.modules())

    def _add_tensor(self, name: str, tensor: torch.Tensor) -> None:
        if id(tensor) in self.labels or tensor.is_meta:
            return
        self.labels[id(tensor)] = name
        self.watched.append((name, weakref.ref(tensor)))
        self._watch(tensor)
        if tensor.is_leaf and (tensor.requires_grad or tensor.grad is not None):
            self._grads.append((tensor, tensor.grad))
            if tensor.grad is not None:
                self._watch(tensor.grad)

    def _add_optimizer(self, name: str, opt: torch.optim.Optimizer) -> None:
        for g, group in enumerate(opt.param_groups):
            for i, p in enumerate(group["params"]):
                self._add_tensor(f"{name}.param_groups[{g}]['params'][{i}]", p)
        tensors = [t for t in _tensors_in(opt.state) if isinstance(t, torch.Tensor)]
        for t in tensors:
            self._watch(t)
            if id(t) in self.labels:  # also a parameter, a named tensor or another optimizer's state
                self._optimizer_only.discard(id(t))
            else:
                self._optimizer_only.add(id(t))
                self.labels[id(t)] = f"{name}.state"
        # Containers copied, tensors shared (the memo maps each to itself): their contents are
        # saved copy-on-write like every other tensor.
        memo: dict[int, Any] = {id(t): t for t in tensors + [p for g in opt.param_groups for p in g["params"]]}
        self._structures.append((opt, copy.deepcopy((dict(opt.state), opt.param_groups), memo)))

    def _add_scaler(self, name: str, scaler: Any) -> None:
        """A GradScaler's attributes as they are (its scale tensor may not exist yet: the first
        ``scale()`` makes it), tensors shared and saved copy-on-write."""
        tensors = {attr: t for attr, t in vars(scaler).items() if isinstance(t, torch.Tensor)}
        for attr, t in tensors.items():
            self._watch(t)
            self._optimizer_only.discard(id(t))
            self.labels.setdefault(id(t), f"{name}.{attr}")
        saved = copy.deepcopy(vars(scaler), {id(t): t for t in tensors.values()})
        self._objects.append((scaler, saved))

    def _watch(self, tensor: torch.Tensor) -> None:
        self._cow.setdefault(_cow_key(tensor), []).append(tensor)

    # -- copy-on-write -------------------------------------------------------------------------
    @property
    def watches_writes(self) -> bool:
        return bool(self._cow)

    def before_write(self, tensor: torch.Tensor) -> None:
        """Called by the recorder before an op writes ``tensor``: save the tensors sharing its storage."""
        tensors = self._cow.pop(_cow_key(tensor), None)
        if tensors:
            with no_grad_held():
                if len(tensors) == 1 and id(tensors[0]) in self._optimizer_only:
                    self._replaced[id(tensors[0])] = (tensors[0], tensors[0].detach().clone())
                elif len(tensors) == 1 and _movable(tensors[0]):
                    # Run 1 writes a copy; the tensor gets its own memory back in ``restore`` (no copy).
                    live = tensors[0]
                    self._moved.append((live, live.detach()))
                    _take_memory(live, live.clone())
                else:
                    self._saved.extend((t, t.detach().clone()) for t in tensors)

    def movable(self, tensor: torch.Tensor) -> bool:
        """Whether run 1's first write of ``tensor`` may go to new memory the tensor then takes (see
        :meth:`move`): a parameter alone on its memory (``_movable``), not saved yet."""
        tensors = self._cow.get(_cow_key(tensor))
        return tensors is not None and len(tensors) == 1 and tensors[0] is tensor and \
            id(tensor) not in self._optimizer_only and _movable(tensor)

    def move(self, tensor: torch.Tensor, new: torch.Tensor) -> None:
        """Save a :meth:`movable` parameter by giving it ``new`` (its first write, computed out of
        place): its own memory, left as it was, is the snapshot, given back in ``restore``; no copy.

        Optimizer moments are copied instead: moving them would leave the state in the memory it had
        and free run 1's, which glibc then returns to the system (the next run faults it in again);
        their copies take their place in the restored state and the old memory is reused."""
        self._cow.pop(_cow_key(tensor), None)
        self._moved.append((tensor, tensor.detach()))
        _take_memory(tensor, new)

    def pristine(self, tensor: torch.Tensor) -> bool:
        """Whether no op has written ``tensor`` yet (its copy-on-write copy is still to be taken)."""
        return _cow_key(tensor) in self._cow

    def unwritten(self) -> list[tuple[str, Any]]:
        """State tensors no op of the first run wrote: a change to them came from outside torch's ops
        (``.data =``, a NumPy view), which only comparing them after each run can see."""
        saved = {id(t) for t, _ in self._saved + self._moved} | set(self._replaced)
        return [(name, ref) for name, ref in self.watched if id(ref()) not in saved]

    # -- restoring -----------------------------------------------------------------------------
    def restore(self) -> None:
        """Put everything back as it was when the snapshot was taken (call once). A Stop meanwhile is
        raised once all of it is back (not with the parameters restored and the optimizer not)."""
        with deferred_interrupts():
            self._restore()

    def _restore(self) -> None:
        torch.set_grad_enabled(self._grad_enabled)
        with no_grad_held():
            for live, saved in self._saved:
                live.copy_(saved)
            for live, own in self._moved:
                if storage_use_count(live) == 2:  # nothing else holds run 1's copy: give the memory back
                    _take_memory(live, own)
                else:  # a view of the copy outlives run 1 (kept by the cell): keep the copy, as copy_ does
                    live.copy_(own)
        for param, grad in self._grads:
            param.grad = grad
        for module, training in self._training:
            module.training = training
        self._replace_optimizer_state()
        for opt, (state, groups) in self._structures:
            opt.state.clear()
            opt.state.update(state)
            opt.param_groups[:] = groups
        for obj, saved_state in self._dicts:
            obj.load_state_dict(saved_state)
        for obj, attributes in self._objects:
            vars(obj).clear()
            vars(obj).update(attributes)
        self._restore_bindings()
        if self.rng is not None:
            self.rng.restore()
        self.release()

    def _replace_optimizer_state(self) -> None:
        """Put each saved copy of an optimizer-only tensor in its place in the state to restore; one
        held deeper than a per-parameter dict is copied back instead."""
        left = dict(self._replaced)
        for _, (state, _) in self._structures:
            for entries in state.values():
                if not isinstance(entries, dict):
                    continue
                for key, value in list(entries.items()):
                    found = left.pop(id(value), None) if isinstance(value, torch.Tensor) else None
                    if found is not None and found[0] is value:
                        entries[key] = found[1]
                        self.labels[id(found[1])] = self.labels.get(id(value), "optimizer state")
        with no_grad_held():
            for live, saved in left.values():
                live.copy_(saved)

    def _restore_bindings(self) -> None:
        if self._bindings is None or self._namespace is None:
            return
        ns = self._namespace
        for name in [n for n in ns if n not in self._bindings and not n.startswith("_")]:
            del ns[name]
        for name, value in self._bindings.items():
            if ns.get(name, _MISSING) is not value:
                ns[name] = value

    def release(self) -> None:
        """Drop every saved copy and reference (no tensor outlives the report)."""
        self._grads, self._training, self._structures, self._dicts, self._objects = [], [], [], [], []
        self._cow, self._saved, self._moved, self._bindings, self._namespace = {}, [], [], None, None
        self._optimizer_only, self._replaced = set(), {}
        self.rng = None


def _cow_key(t: torch.Tensor) -> Any:
    """What an op writing ``t`` is known by: its storage (shared by its views), or for a tensor with no
    plain storage (sparse, a jagged nested tensor) the tensor object itself, which the recorder's
    dispatch mode is handed as it is."""
    key = storage_key(t)
    return key if key is not None else ("tensor", id(t))


def _movable(t: torch.Tensor) -> bool:
    """Whether run 1 can write ``t`` on a copy of its storage, the tensor getting its own storage back
    when restored (no copy back): a parameter (``requires_grad`` leaf: ``.numpy()`` and DLPack refuse it,
    so any other holder of its memory is a TensorImpl the storage's use count shows) that is the only
    tensor on its storage, covers all of it, and is dense (its clone has the same strides)."""
    if not (t.requires_grad and t.is_leaf) or t.storage_offset() != 0 or t.layout != torch.strided:
        return False
    try:
        if t.untyped_storage().nbytes() != t.numel() * t.element_size() or not _dense(t):
            return False
    except (RuntimeError, NotImplementedError):
        return False
    return storage_use_count(t) == 2  # the tensor itself and the storage object read here


def _dense(t: torch.Tensor) -> bool:
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride()), key=lambda p: p[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _tensors_in(value: Any) -> Iterator[Any]:
    """Every tensor inside nested dicts, lists and tuples (an optimizer's state)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors_in(item)
