"""Who holds a tensor: walk the notebook namespace a few levels deep and name what we find.

Names are written as the user would type them: ``losses[17]``, ``model.fc.weight.grad``,
``opt.state[model.fc.weight]["exp_avg"]``, ``cache["k"]``. The walk is breadth-first so the
shortest name wins, bounded in depth and in objects visited so a huge namespace stays fast.
Results are keyed by storage identity (views share their storage) and keep no tensors.
"""
from __future__ import annotations

import gc
import types
from collections import deque
from itertools import islice
from typing import Any, Callable, Container, Iterator, Mapping, Optional

import torch
from torch import nn

from torch_nbdebug.data.memory import SAVED_BY_GRAPH
from torch_nbdebug.record.modules import module_roots, parameter_names, user_named_modules, user_named_parameters
from torch_nbdebug.record.source import UserNamespace, caller_namespace
from torch_nbdebug.record.compat import buffer_registry, is_fake, node_saved_attributes
from torch_nbdebug.record.memory.ops import measurable
from torch_nbdebug.record.tensors import storage_key

MAX_DEPTH = 4
MAX_VISITS = 200_000
MAX_CHILDREN = 100_000  # entries read per container: bounds a list of millions of numbers
# IPython's own bookkeeping names; ``Out`` is walked last because its entries are the user's outputs.
_SKIP_NAMES = {"In", "exit", "quit", "get_ipython"}
_ATOMS = (str, bytes, int, float, complex, bool, type(None), types.ModuleType, type, types.FunctionType,
          types.BuiltinFunctionType, types.MethodType)
_ATOM_TYPES = frozenset(_ATOMS)  # exact types: one set lookup skips most entries of a big container


MAX_GRAPH_NODES = 20_000


class Holders:
    """Storage key -> (name, has_graph) of the first (shortest) reference found in the namespace."""

    def __init__(self, on_new: Optional[Callable[[int, torch.Tensor], None]] = None,
                 known: Container[int] = ()) -> None:
        self.names: dict[int, str] = {}
        self.graphs: dict[int, bool] = {}
        self._on_new = on_new
        self._known = known
        self._graph_roots: list[tuple[str, Any]] = []  # (holder name, grad_fn); dropped by name_saved

    def add(self, key: Optional[int], name: str, tensor: torch.Tensor) -> None:
        if key is None:
            return
        old = self.names.get(key)
        if old is not None:
            if old.isidentifier() and "[" in name:  # ``loss`` is also ``losses[9]``: the list holds it, one leak
                self.names[key] = name
                self._graph_roots = [(name if held == old else held, fn) for held, fn in self._graph_roots]
            return
        self.names[key] = name
        grad_fn = tensor.grad_fn
        self.graphs[key] = grad_fn is not None
        if grad_fn is not None:
            self._graph_roots.append((name, grad_fn))
        if self._on_new is not None and key not in self._known and _countable(tensor):
            self._on_new(key, tensor)

    def rename(self, old: str, new: str) -> None:
        """Names under the variable ``old`` (``batch[3]``) move under ``new`` (``epochs[0][3]``): the
        variable is an element of another holder's container, which holds the tensors: one leak."""
        def moved(name: str) -> str:
            return new + name[len(old):] if name == old or name.startswith((old + "[", old + ".")) else name
        self.names = {key: moved(name) for key, name in self.names.items()}
        self._graph_roots = [(moved(name), fn) for name, fn in self._graph_roots]

    def get(self, key: int) -> Optional[str]:
        return self.names.get(key)

    def name_saved(self, max_nodes: int = MAX_GRAPH_NODES) -> set[int]:
        """Name the tensors that held graphs saved for backward (``val_losses[2].grad_fn``): a leaked
        loss keeps its graph's saved inputs alive, and they belong to its leak. Returns their keys."""
        roots, self._graph_roots = self._graph_roots, []
        saved: set[int] = set()
        for name, node in _walk_graphs(roots, max_nodes):
            for tensor in _saved_tensors(node):
                key = storage_key(tensor)
                if key is not None and key not in self.names:
                    self.names[key] = name + SAVED_BY_GRAPH
                    self.graphs[key] = False
                    saved.add(key)
        return saved


_PLAIN_TYPES = (torch.Tensor, nn.Parameter)


def _countable(tensor: torch.Tensor) -> bool:
    """``measurable`` with a fast answer for plain tensors (most of a namespace): a plain, non-nested
    tensor with a storage key has real bytes and a shape of ints (meta, fake and symbolic shapes only
    come with other devices or tensor subclasses, and the recorders check the device)."""
    if type(tensor) in _PLAIN_TYPES and not tensor.is_nested and not tensor.is_meta:
        return True
    return measurable(tensor)


def _walk_graphs(roots: list[tuple[str, Any]], max_nodes: int) -> Any:
    """Each autograd node reachable from the roots once, with the name of the first root reaching it.

    Bounded: the walk creates a Python object per node, and it only names leaks."""
    seen: set[int] = set()
    stack = list(reversed(roots))
    while stack and len(seen) < max_nodes:
        name, node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        yield name, node
        stack.extend((name, child) for child, _ in node.next_functions)


def _saved_tensors(node: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    for attr in node_saved_attributes(node):
        try:
            value = getattr(node, attr)
        except Exception:  # noqa: BLE001 - freed by a backward, saved for a second order only, or symbolic
            continue
        values = value if isinstance(value, (tuple, list)) else (value,)
        found.extend(v for v in values if isinstance(v, torch.Tensor))
    return found


def find_holders(namespace: Optional[Mapping[str, Any]], *, max_depth: int = MAX_DEPTH,
                 on_new: Optional[Callable[[int, torch.Tensor], None]] = None, named: bool = True,
                 known: Container[int] = ()) -> Holders:
    """Name the holder of every tensor reachable from ``namespace`` (public names, then ``Out``).

    ``on_new(key, tensor)`` is called once per storage found whose bytes can be counted (recorders
    adopt tensors they never saw), except for keys in ``known`` (what a recorder already tracks:
    most of the namespace at its end). An object that raises when we look inside it is skipped, and
    named to the namespace when it is a :class:`UserNamespace` (the tools say what they skipped).
    Every container is read up to ``MAX_CHILDREN`` entries, so a list of millions of numbers costs
    no more than a short one. ``named=False`` when only the tensors matter (a recorder's start): the
    optimizer state is then named by parameter index, without mapping every parameter to its name.
    """
    holders = Holders(on_new, known)
    if namespace is None:
        return holders
    view = caller_namespace(namespace)
    items = [(k, v) for k, v in view.items() if not k.startswith("_") and k not in _SKIP_NAMES]
    items.sort(key=lambda kv: kv[0] == "Out")
    param_names = _parameter_names(items) if named else {}
    queue: deque[tuple[str, Any, int]] = deque((k, v, 0) for k, v in items)
    seen: set[int] = {id(namespace)} | view.mapping_ids()  # ``ns = globals()`` must not name all ``ns[...]``
    variables: dict[int, str] = {}  # id of a container bound to a variable -> the variable's name
    while queue and len(seen) < MAX_VISITS:
        name, obj, depth = queue.popleft()
        cls = type(obj)
        if id(obj) in seen:
            old = variables.get(id(obj))
            # the variable is an element of another container (not of itself: ``l.append(l)``)
            if old and name.endswith("]") and not name.startswith((old + "[", old + ".")):
                holders.rename(variables.pop(id(obj)), name)
            continue
        if cls in _ATOM_TYPES or issubclass(cls, _ATOMS):
            continue
        if depth == 0 and issubclass(cls, (list, tuple, dict)):
            variables[id(obj)] = name
        seen.add(id(obj))
        if issubclass(cls, torch.Tensor):
            _add_tensor(holders, name, obj, view)
            continue
        if depth >= max_depth:
            continue
        try:
            children = list(islice(_children(name, obj, param_names), MAX_CHILDREN))
        except Exception:  # noqa: BLE001 - the user's object raised when we looked inside it
            view.skip(name)
            continue
        for child_name, child in children:
            if issubclass(type(child), torch.Tensor):
                _add_tensor(holders, child_name, child, view)
            elif type(child) not in _ATOM_TYPES:
                queue.append((child_name, child, depth + 1))
    return holders


def _add_tensor(holders: Holders, name: str, tensor: torch.Tensor, view: UserNamespace) -> None:
    try:
        holders.add(storage_key(tensor), name, tensor)
        grad = tensor.grad if tensor.is_leaf else None  # .grad of a non-leaf warns and is always None
        if grad is not None:
            holders.add(storage_key(grad), f"{name}.grad", grad)
    except Exception:  # noqa: BLE001 - a tensor subclass whose attributes raise
        view.skip(name)


def _parameter_names(items: list[tuple[str, Any]]) -> dict[int, str]:
    return parameter_names(module_roots(dict(items)))


def _children(name: str, obj: Any, param_names: dict[int, str]) -> Iterator[tuple[str, Any]]:
    """The named references inside one object, as the user would spell them.

    ``type()`` decides the kind (``isinstance`` would ask a proxy's ``__class__``)."""
    cls = type(obj)
    if issubclass(cls, nn.Module):
        yield from _module_children(name, obj)
    elif issubclass(cls, torch.optim.Optimizer):
        for index, (param, state) in enumerate(list(obj.state.items())):
            pname = param_names.get(id(param), f"param{index}")
            for key, value in state.items():
                yield f"{name}.state[{pname}][{key!r}]", value
    elif issubclass(cls, (list, tuple)):
        for i, value in enumerate(islice(obj, MAX_CHILDREN)):
            if type(value) not in _ATOM_TYPES:
                yield f"{name}[{i}]", value
    elif issubclass(cls, dict):
        for key, value in islice(dict.items(obj), MAX_CHILDREN):
            if type(value) not in _ATOM_TYPES:
                yield f"{name}[{_key_label(key)}]", value
    elif not issubclass(cls, type):
        attrs = _instance_dict(obj, cls)
        if attrs is not None:
            yield from ((f"{name}.{k}", v) for k, v in islice(attrs.items(), MAX_CHILDREN)
                        if type(k) is str and not k.startswith("__") and type(v) not in _ATOM_TYPES)


def _module_children(name: str, module: nn.Module) -> Iterator[tuple[str, Any]]:
    yield from ((f"{name}.{k}", v) for k, v in user_named_parameters(module))
    for sub_name, sub in user_named_modules(module):
        prefix = f"{name}.{sub_name}" if sub_name else name
        yield from ((f"{prefix}.{k}", v) for k, v in buffer_registry(sub).items() if v is not None)
        # Atoms (a Linear's ``in_features``, most of a module's attributes) hold no tensor: skipped here,
        # before a name is built for each, as lists and dicts skip theirs in ``_children``.
        yield from ((f"{prefix}.{k}", v) for k, v in vars(sub).items()
                    if type(v) not in _ATOM_TYPES and type(k) is str and not k.startswith("_") and k != "training")


def _instance_dict(obj: Any, cls: type) -> Optional[dict[str, Any]]:
    """``vars(obj)`` read through the type's own slot, so a proxy's ``__dict__`` property (which may
    build the object it stands for) is never run; None when the object has no plain ``__dict__``."""
    for klass in cls.__mro__:
        slot = vars(klass).get("__dict__")
        if slot is not None:
            if type(slot) is not types.GetSetDescriptorType:
                return None
            attrs = slot.__get__(obj, cls)
            return attrs if type(attrs) is dict else None
    return None


def _key_label(key: Any) -> str:
    """``repr`` of plain keys only: a key of the user's type may raise from its ``__repr__``."""
    return repr(key) if type(key) in (str, int, float, bool) else "..."


def scan_objects(want_tensors: bool = True, *, nested: bool = False
                 ) -> tuple[list[torch.Tensor], list[nn.Module], list[torch.optim.Optimizer]]:
    """Every live tensor, module and optimizer the garbage collector tracks, in one pass.

    Models created in a cell need not be in the namespace, so the collector is the only complete
    list. The kind of each type is cached: one dict lookup per object keeps a pass over a few hundred
    thousand objects at tens of milliseconds. ``type()`` rather than isinstance also avoids objects
    whose ``__class__`` lookup warns (deprecated torch.distributed aliases). The caller must drop
    the lists promptly.

    Only tensors a recorder can measure are listed: real bytes in a storage and a shape of ints.
    FakeTensors, jagged nested tensors and subclasses whose attributes raise are left out; strided
    nested tensors (real memory, but no sizes) only with ``nested=True``.
    """
    tensors: list[torch.Tensor] = []
    modules: list[nn.Module] = []
    optimizers: list[torch.optim.Optimizer] = []
    sinks = (None, None, modules, optimizers)
    kinds: dict[type, int] = {}
    for obj in gc.get_objects():
        cls = type(obj)
        kind = kinds.get(cls)
        if kind is None:
            kind = kinds[cls] = _kind(cls, obj)
        if kind == _PLAIN_TENSOR:
            if want_tensors and (nested or not obj.is_nested):
                tensors.append(obj)
        elif kind == _TENSOR_SUBCLASS:
            if want_tensors and measurable(obj):
                tensors.append(obj)
        elif kind:
            sinks[kind].append(obj)  # type: ignore[union-attr]
    return tensors, modules, optimizers


_PLAIN_TENSOR, _TENSOR_SUBCLASS = 1, 4
_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)


def _kind(cls: type, obj: Any) -> int:
    """1 tensor, 2 module, 3 optimizer, 4 a tensor subclass to check one by one, else 0.

    FakeTensors (``torch.compile``'s shape-only tensors, possibly with symbolic sizes) hold no
    memory and are not tensors here."""
    if issubclass(cls, torch.Tensor):
        if is_fake(obj):
            return 0
        return 1 if cls in _PLAIN_TENSORS else _TENSOR_SUBCLASS
    if issubclass(cls, nn.Module):
        return 2
    return 3 if issubclass(cls, torch.optim.Optimizer) else 0


def persistent_keys(modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict[int, str]:
    """Storage key -> 'parameters' / 'gradients' / 'optimizer_state' for the training state.

    The first kind found for a storage wins: optimizer state, then each optimizer's parameters and
    their gradients, then the modules' parameters. A parameter an optimizer already marked is not read
    again through its module (the same tensor: its keys are already in); a model with its optimizer,
    read at the start and the end of every recording, costs one pass over its parameters."""
    kinds: dict[int, str] = {}
    seen: set[int] = set()  # ids of the parameters marked through an optimizer
    for opt in optimizers:
        try:
            _mark_optimizer(kinds, opt, seen)
        except Exception:  # noqa: BLE001 - a user's optimizer subclass we cannot read
            continue
    for module in modules:
        try:
            for param in list(vars(module).get("_parameters", {}).values()):
                if id(param) not in seen and issubclass(type(param), torch.Tensor):
                    _mark_param(kinds, param)
        except Exception:  # noqa: BLE001 - a user's module subclass we cannot read
            continue
    return kinds


def _mark_optimizer(kinds: dict[int, str], opt: torch.optim.Optimizer, seen: set[int]) -> None:
    for state in list(opt.state.values()):
        for value in list(state.values()):
            if issubclass(type(value), torch.Tensor):
                _mark(kinds, storage_key(value), "optimizer_state")
    for group in opt.param_groups:
        for param in group["params"]:
            _mark_param(kinds, param)
            seen.add(id(param))


def _mark_param(kinds: dict[int, str], param: torch.Tensor) -> None:
    _mark(kinds, storage_key(param), "parameters")
    grad = param.grad
    if grad is not None:
        _mark(kinds, storage_key(grad), "gradients")


def _mark(kinds: dict[int, str], key: Optional[int], kind: str) -> None:
    if key is not None and key not in kinds:
        kinds[key] = kind
