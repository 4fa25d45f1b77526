"""Walk the autograd graph behind some tensors and turn it into plain :class:`GraphData`.

The walk is iterative (a 5,000-layer chain would overflow Python's recursion limit, which is what
makes torchviz fail) and visits every node reachable through ``next_functions`` exactly once, keyed
by identity: the same node set as torchviz's ``make_dot``. It keeps the Python wrappers of the nodes
alive only while walking (so ``id`` stays unique), reads shapes and dtypes from each node's
``_input_metadata`` (the metadata of the forward outputs it receives gradients for) and never keeps
a tensor.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch

from torch_nbdebug.data.graph import GradInfo, GraphData, GraphEdge, GraphNode, ModuleInfo, SavedInfo
from torch_nbdebug.record import compat
from torch_nbdebug.record.modules import user_named_parameters

# AccumulateGrad and other nodes made outside a forward have no sequence number: UINT64_MAX.
NO_SEQUENCE = compat.NO_SEQUENCE
DEFAULT_MAX_NODES = 250_000
COMPILED_NODE = "CompiledFunctionBackward"  # the backward of a torch.compile'd region, as one node

_SAVED_ATTRS: dict[type, list[str]] = {}  # per node class: its ``_saved_*`` attributes (``dir`` is slow)
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_DIMS = re.compile(r"(\d)D(?=[A-Z]|$)")  # MaxPool2DWithIndices -> MaxPool2dWithIndices (max_pool2d_with_indices)


_LABELS: dict[type, str] = {}


def op_label(node: Any) -> str:
    """``AddmmBackward0`` -> ``addmm``; a custom ``autograd.Function`` keeps its class name."""
    label = _LABELS.get(type(node))
    if label is None:
        label = _LABELS[type(node)] = _make_label(node)
    return label


def _make_label(node: Any) -> str:
    name = node_name(node)
    if name == "AccumulateGrad":
        return name
    base = re.sub(r"Backward\d*$", "", name) or name
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        return base
    return _CAMEL.sub("_", _DIMS.sub(r"\1d", base)).lower()


_NAMES: dict[type, str] = {}


def node_name(node: Any) -> str:
    """``AddmmBackward0``; ``torch::autograd::AccumulateGrad`` -> ``AccumulateGrad`` (cached per class)."""
    name = _NAMES.get(type(node))
    if name is None:
        name = _NAMES[type(node)] = node.name().rsplit("::", 1)[-1]
    return name


def children_of(node: Any) -> list[Any]:
    """The nodes this one sends gradients to (its forward inputs), skipping Nones."""
    return [child for child, _ in getattr(node, "next_functions", ()) if child is not None]


def walk(roots: Sequence[Any], max_nodes: int = DEFAULT_MAX_NODES) -> tuple[list[Any], dict[int, list[Any]], bool]:
    """Every node reachable from ``roots`` once, in forward topological order (inputs first).

    Returns the nodes, each node's children (by ``id``) and whether ``max_nodes`` cut the walk short.
    Iterative post-order DFS: no recursion, so depth is limited only by memory.
    """
    order: list[Any] = []
    kids: dict[int, list[Any]] = {}
    truncated = False
    for root in roots:
        if id(root) in kids:
            continue
        kids[id(root)] = children_of(root)
        stack: list[Any] = [root]
        positions: list[int] = [0]  # next child to look at, per stack entry
        while stack:
            children = kids[id(stack[-1])]
            pos = positions[-1]
            while pos < len(children):
                child = children[pos]
                pos += 1
                if id(child) in kids:
                    continue
                if len(kids) >= max_nodes:
                    truncated = True
                    continue
                kids[id(child)] = [c for c, _ in child.next_functions if c is not None]
                positions[-1] = pos
                stack.append(child)
                positions.append(0)
                break
            else:  # every child finished: this node comes after all its inputs
                order.append(stack.pop())
                positions.pop()
    return order, kids, truncated


def tensor_names(namespace: Optional[Mapping[str, Any]]) -> dict[int, str]:
    """``id(tensor) -> variable name`` for the tensors of a namespace (inputs, outputs)."""
    if not namespace:
        return {}
    return {id(v): k for k, v in list(namespace.items()) if isinstance(v, torch.Tensor) and not k.startswith("_")}


def build_graph(outputs: Sequence[tuple[str, torch.Tensor]], *, param_names: Mapping[int, str],
                input_names: Mapping[int, str], modules: Optional[Mapping[int, tuple[str, str]]] = None,
                module_types: Optional[Mapping[str, str]] = None, saved: bool = False,
                max_nodes: int = DEFAULT_MAX_NODES, title: str = "graph", source: str = "autograd",
                param_aliases: Optional[Mapping[int, tuple[str, ...]]] = None) -> GraphData:
    """The graph behind ``outputs`` (``(label, tensor)`` pairs whose ``grad_fn`` is set).

    ``modules`` maps a node's sequence number to ``(module path, node name)`` as recorded during
    the forward; a node whose name differs (the sequence number was reused) is left unassigned.
    ``param_aliases`` gives every name of a tied parameter (see :func:`parameter_aliases`).
    """
    roots = [t.grad_fn for _, t in outputs if t.grad_fn is not None]
    order, kids, truncated = walk(roots, max_nodes)
    ids = {id(node): f"n{i}" for i, node in enumerate(order)}
    nodes = [_node(node, ids[id(node)], i, param_names, input_names, modules or {}, saved, param_aliases or {})
             for i, node in enumerate(order)]
    edges = [GraphEdge(ids[id(child)], ids[id(node)]) for node in order for child in kids[id(node)]
             if id(child) in ids]
    for k, (label, tensor) in enumerate(outputs):
        out_id = f"out{k}"
        # An output's own gradient exists only if the user asked to keep it (``retain_grad``);
        # reading ``.grad`` of other non-leaf tensors would only warn.
        grad = grad_info(tensor.grad) if tensor.retains_grad else None
        nodes.append(GraphNode(id=out_id, kind="output", label=label, shape=tuple(tensor.shape),
                               dtype=_dtype(tensor.dtype), topo=len(order) + k, grad=grad))
        if tensor.grad_fn is not None and id(tensor.grad_fn) in ids:
            edges.append(GraphEdge(ids[id(tensor.grad_fn)], out_id))
    notes: tuple[str, ...] = ()
    if truncated:
        notes = (f"the graph has more than {max_nodes:,} autograd nodes: only the first {max_nodes:,} were "
                 f"walked (pass max_nodes=... to walk more)",)
    if any(node.op == COMPILED_NODE for node in nodes):
        notes += (f"each {COMPILED_NODE} node is a whole torch.compile'd region (its ops are fused): graph the "
                  "output of the original, uncompiled module to see them",)
    infos = tuple(ModuleInfo(path, type_name, path.rpartition(".")[0] or None)
                  for path, type_name in sorted((module_types or {}).items()))
    return GraphData(nodes=tuple(nodes), edges=tuple(edges), modules=infos, title=title, source=source,
                     notes=notes, truncated=truncated)


def _node(node: Any, node_id: str, topo: int, param_names: Mapping[int, str], input_names: Mapping[int, str],
          modules: Mapping[int, tuple[str, str]], saved: bool, aliases: Mapping[int, tuple[str, ...]]) -> GraphNode:
    name = node_name(node)
    outs = _outputs(node)
    shape, dtype = outs[0] if outs else (None, None)
    seq = compat.node_sequence_nr(node)
    seq_value = None if seq == NO_SEQUENCE else seq
    module = None
    found = modules.get(seq) if seq_value is not None else None
    if found is not None and found[1] == name:
        module = found[0] or None  # "" = made outside any module
    if name == "AccumulateGrad":
        variable = node.variable
        label = param_names.get(id(variable)) or input_names.get(id(variable))
        kind = "param" if id(variable) in param_names else "input"
        shape, dtype = tuple(variable.shape), _dtype(variable.dtype)
        return GraphNode(id=node_id, kind=kind, label=label or f"leaf {list(shape)}", op=name, shape=shape,
                         dtype=dtype, module=_owner(label) if kind == "param" else None, seq=None,
                         outputs=((shape, dtype),), grad=grad_info(variable.grad), topo=topo,
                         aliases=aliases.get(id(variable), ()) if kind == "param" else ())
    return GraphNode(id=node_id, kind="op", label=op_label(node), op=name, shape=shape, dtype=dtype,
                     module=module, seq=seq_value, outputs=tuple(outs),
                     saved=saved_info(node) if saved else (), topo=topo)


def _owner(param_label: Optional[str]) -> Optional[str]:
    """``model.fc.weight`` belongs to module ``model.fc``."""
    if not param_label or "." not in param_label:
        return None
    return param_label.rpartition(".")[0]


def _outputs(node: Any) -> list[tuple[tuple[int, ...], str]]:
    outs = []
    try:
        for meta in compat.node_output_metadata(node):
            try:
                outs.append((tuple(meta.shape), _dtype(meta.dtype)))
            except (RuntimeError, TypeError, ValueError):  # nested or symbolic shapes
                outs.append(((), _dtype(meta.dtype)))
    except (AttributeError, RuntimeError):
        pass
    return outs


_DTYPES: dict[Any, str] = {}


def _dtype(dtype: Any) -> str:
    text = _DTYPES.get(dtype)
    if text is None:
        text = _DTYPES[dtype] = str(dtype).replace("torch.", "")
    return text


def saved_info(node: Any) -> tuple[SavedInfo, ...]:
    """Shapes/dtypes of what ``node`` saved for backward (read and dropped at once, never kept)."""
    attrs = _SAVED_ATTRS.get(type(node))
    if attrs is None:
        attrs = compat.node_saved_attributes(node)
        _SAVED_ATTRS[type(node)] = attrs
    out: list[SavedInfo] = []
    for attr in attrs:
        try:
            value = getattr(node, attr)
        except RuntimeError:  # freed by a backward without retain_graph
            out.append(SavedInfo(attr[7:], value="(freed by backward)"))
            continue
        out.extend(_saved_values(attr[7:], value))
    if isinstance(node, torch.autograd.function.BackwardCFunction):
        try:
            out.extend(_saved_values("saved_tensors", tuple(node.saved_tensors)))
        except RuntimeError:
            out.append(SavedInfo("saved_tensors", value="(freed by backward)"))
    return tuple(out)


def _saved_values(name: str, value: Any) -> list[SavedInfo]:
    if isinstance(value, torch.Tensor):
        return [SavedInfo(name, tuple(value.shape), _dtype(value.dtype))]
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        return [SavedInfo(f"{name}[{i}]", tuple(v.shape), _dtype(v.dtype)) for i, v in enumerate(value)
                if isinstance(v, torch.Tensor)]
    text = str(value)
    return [SavedInfo(name, value=text if len(text) <= 60 else text[:57] + "...")]


def grad_info(grad: Optional[torch.Tensor]) -> Optional[GradInfo]:
    """Norm and range of a gradient, computed without autograd and without keeping the tensor."""
    if grad is None or grad.is_meta or grad.is_sparse or grad.numel() == 0:
        return None
    with torch.no_grad():
        g = grad.detach()
        if g.is_complex():
            g = g.abs()
        g = g.float()
        finite = torch.isfinite(g)
        nonfinite = int(g.numel() - int(finite.sum()))
        vals = g[finite] if nonfinite else g
        if vals.numel() == 0:
            return GradInfo(norm=float("nan"), nonfinite=nonfinite)
        lo, hi = torch.aminmax(vals)
        return GradInfo(norm=float(vals.norm()), min=float(lo), max=float(hi), mean=float(vals.mean()),
                        nonfinite=nonfinite)


def parameter_aliases(roots: Iterable[tuple[str, torch.nn.Module]]) -> dict[int, tuple[str, ...]]:
    """``id(parameter) -> ("model.wte.weight", "model.lm_head.weight")`` for tied parameters only: every
    name the parameter has under the root that names it first (as ``parameter_names`` does)."""
    names: dict[int, list[str]] = {}
    owner: dict[int, str] = {}
    for root_name, root in roots:
        try:
            found = list(user_named_parameters(root))
        except Exception:  # noqa: BLE001 - a broken user module must not break the graph
            continue
        for name, param in found:
            if owner.setdefault(id(param), root_name) == root_name:
                names.setdefault(id(param), []).append(f"{root_name}.{name}")
    return {key: tuple(dict.fromkeys(v)) for key, v in names.items() if len(set(v)) > 1}


def module_types(roots: Iterable[tuple[str, torch.nn.Module]]) -> dict[str, str]:
    """``{"model.blocks.3": "Block"}`` for every module under the given roots."""
    types: dict[str, str] = {}
    for root_name, root in roots:
        for sub, module in root.named_modules(remove_duplicate=False):
            types.setdefault(f"{root_name}.{sub}" if sub else root_name, type(module).__name__)
    return types
