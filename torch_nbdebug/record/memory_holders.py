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
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from torch import nn

from torch_nbdebug.data.memory import SAVED_BY_GRAPH
from torch_nbdebug.record.tensors import storage_key

MAX_DEPTH = 4
MAX_VISITS = 200_000
# IPython's own bookkeeping names; ``Out`` is walked last because its entries are the user's outputs.
_SKIP_NAMES = {"In", "exit", "quit", "get_ipython"}
_ATOMS = (str, bytes, int, float, complex, bool, type(None), types.ModuleType, type, types.FunctionType,
          types.BuiltinFunctionType, types.MethodType)


MAX_GRAPH_NODES = 20_000


class Holders:
    """Storage key -> (name, has_graph) of the first (shortest) reference found in the namespace."""

    def __init__(self, on_new: Optional[Callable[[int, torch.Tensor], None]] = None) -> None:
        self.names: dict[int, str] = {}
        self.graphs: dict[int, bool] = {}
        self._on_new = on_new
        self._graph_roots: list[tuple[str, Any]] = []  # (holder name, grad_fn); dropped by name_saved

    def add(self, key: Optional[int], name: str, tensor: torch.Tensor) -> None:
        if key is None or key in self.names:
            return
        self.names[key] = name
        self.graphs[key] = tensor.grad_fn is not None
        if tensor.grad_fn is not None:
            self._graph_roots.append((name, tensor.grad_fn))
        if self._on_new is not None:
            self._on_new(key, tensor)

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
    for attr in dir(node):
        if not attr.startswith("_saved_"):
            continue
        try:
            value = getattr(node, attr)
        except RuntimeError:  # freed by a backward, or saved for a second order only
            continue
        values = value if isinstance(value, (tuple, list)) else (value,)
        found.extend(v for v in values if isinstance(v, torch.Tensor))
    return found


def find_holders(namespace: Optional[Mapping[str, Any]], *, max_depth: int = MAX_DEPTH,
                 on_new: Optional[Callable[[int, torch.Tensor], None]] = None) -> Holders:
    """Name the holder of every tensor reachable from ``namespace`` (public names, then ``Out``).

    ``on_new(key, tensor)`` is called once per storage found (recorders adopt tensors they never saw).
    """
    holders = Holders(on_new)
    if not namespace:
        return holders
    items = [(k, v) for k, v in list(namespace.items()) if not k.startswith("_") and k not in _SKIP_NAMES]
    items.sort(key=lambda kv: kv[0] == "Out")
    param_names = _parameter_names(items)
    queue: deque[tuple[str, Any, int]] = deque((k, v, 0) for k, v in items)
    seen: set[int] = {id(namespace)}  # ``ns = globals()`` must not name everything ``ns[...]``
    while queue and len(seen) < MAX_VISITS:
        name, obj, depth = queue.popleft()
        if id(obj) in seen or isinstance(obj, _ATOMS):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            _add_tensor(holders, name, obj)
            continue
        if depth >= max_depth:
            continue
        for child_name, child in _children(name, obj, param_names):
            if isinstance(child, torch.Tensor):
                _add_tensor(holders, child_name, child)
            else:
                queue.append((child_name, child, depth + 1))
    return holders


def _add_tensor(holders: Holders, name: str, tensor: torch.Tensor) -> None:
    holders.add(storage_key(tensor), name, tensor)
    grad = tensor.grad if tensor.is_leaf else None  # .grad of a non-leaf warns and is always None
    if grad is not None:
        holders.add(storage_key(grad), f"{name}.grad", grad)


def _parameter_names(items: list[tuple[str, Any]]) -> dict[int, str]:
    names: dict[int, str] = {}
    for root, value in items:
        if isinstance(value, nn.Module):
            for pname, param in value.named_parameters(remove_duplicate=False):
                names.setdefault(id(param), f"{root}.{pname}")
    return names


def _children(name: str, obj: Any, param_names: dict[int, str]) -> Iterator[tuple[str, Any]]:
    """The named references inside one object, as the user would spell them."""
    if isinstance(obj, nn.Module):
        yield from ((f"{name}.{k}", v) for k, v in obj.named_parameters(remove_duplicate=False))
        yield from ((f"{name}.{k}", v) for k, v in obj.named_buffers(remove_duplicate=False))
        for sub_name, sub in obj.named_modules(remove_duplicate=False):
            prefix = f"{name}.{sub_name}" if sub_name else name
            yield from ((f"{prefix}.{k}", v) for k, v in vars(sub).items()
                        if not k.startswith("_") and k != "training")
    elif isinstance(obj, torch.optim.Optimizer):
        for index, (param, state) in enumerate(list(obj.state.items())):
            pname = param_names.get(id(param), f"param{index}")
            for key, value in state.items():
                yield f"{name}.state[{pname}][{key!r}]", value
    elif isinstance(obj, (list, tuple)):
        yield from ((f"{name}[{i}]", v) for i, v in enumerate(obj))
    elif isinstance(obj, dict):
        for key, value in list(obj.items()):
            label = repr(key) if isinstance(key, (str, int, float, bool)) else "..."
            yield f"{name}[{label}]", value
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        try:
            attrs = vars(obj)
        except TypeError:
            return
        yield from ((f"{name}.{k}", v) for k, v in list(attrs.items()) if not k.startswith("__"))


def scan_objects(want_tensors: bool = True) -> tuple[list[torch.Tensor], list[nn.Module], list[torch.optim.Optimizer]]:
    """Every live tensor, module and optimizer the garbage collector tracks, in one pass.

    Models created in a cell need not be in the namespace, so the collector is the only complete
    list. The kind of each type is cached: one dict lookup per object keeps a pass over a few hundred
    thousand objects at tens of milliseconds. ``type()`` rather than isinstance also avoids objects
    whose ``__class__`` lookup warns (deprecated torch.distributed aliases). The caller must drop
    the lists promptly.
    """
    tensors: list[torch.Tensor] = []
    modules: list[nn.Module] = []
    optimizers: list[torch.optim.Optimizer] = []
    sinks = (None, tensors if want_tensors else None, modules, optimizers)
    kinds: dict[type, int] = {}
    for obj in gc.get_objects():
        cls = type(obj)
        kind = kinds.get(cls)
        if kind is None:
            kind = kinds[cls] = _kind(cls)
        if kind:
            sink = sinks[kind]
            if sink is not None:
                sink.append(obj)
    return tensors, modules, optimizers


def _kind(cls: type) -> int:
    if issubclass(cls, torch.Tensor):
        return 1
    if issubclass(cls, nn.Module):
        return 2
    return 3 if issubclass(cls, torch.optim.Optimizer) else 0


def persistent_keys(modules: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> dict[int, str]:
    """Storage key -> 'parameters' / 'gradients' / 'optimizer_state' for the training state."""
    kinds: dict[int, str] = {}
    for opt in optimizers:
        for state in list(opt.state.values()):
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    _mark(kinds, storage_key(value), "optimizer_state")
        for group in opt.param_groups:
            for param in group["params"]:
                _mark_param(kinds, param)
    for module in modules:
        for param in module._parameters.values():
            if param is not None:
                _mark_param(kinds, param)
    return kinds


def _mark_param(kinds: dict[int, str], param: torch.Tensor) -> None:
    _mark(kinds, storage_key(param), "parameters")
    if param.grad is not None:
        _mark(kinds, storage_key(param.grad), "gradients")


def _mark(kinds: dict[int, str], key: Optional[int], kind: str) -> None:
    if key is not None:
        kinds.setdefault(key, kind)
