"""``graph(...)``: the computation-graph explorer in Python (the twin of ``%graph``/``%%graph``).

- ``graph(loss)``: the autograd graph behind a tensor (or a tuple of tensors). Modules come from the
  last recorded forward when it made these nodes, else are inferred from the parameters each op touches.
- ``graph(model, x)``: runs ``model(x)`` with the recorder on, so every node knows its module; the
  view opens at module level.
- ``with record_graph() as rec: loss = model(x).sum()`` then ``rec.graph(loss)`` (what ``%%graph`` does).

The result is a :class:`GraphExplorer`: displays as text, a static SVG and the live widget; its
``.data`` is a plain, serialisable :class:`GraphData`.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn

from torch_nbdebug.data.graph import GraphData, GraphNode
from torch_nbdebug.errors import InputError
from torch_nbdebug.process.graph_infer import infer_modules, used_modules
from torch_nbdebug.process.graph_nanwatch import birth_origin
from torch_nbdebug.process.graph_nanwatch import mark_nan_birth as mark_birth_on
from torch_nbdebug.record.graph import DEFAULT_MAX_NODES, build_graph, module_types, parameter_aliases, tensor_names
from torch_nbdebug.record.graph_recorder import GraphRecorder, last_recording
from torch_nbdebug.record.modules import module_at, module_roots, parameter_names
from torch_nbdebug.record.source import UserNamespace, caller_namespace, cell_number, skipped_note
from torch_nbdebug.render.graph import GraphExplorer

__all__ = ["graph", "record_graph", "GraphRecording", "GraphData", "GraphExplorer", "GraphNode"]


def graph(target: Any, *inputs: Any, names: Optional[Mapping[str, Any]] = None, saved: bool = False,
          expand: Any = None, max_nodes: int = DEFAULT_MAX_NODES, title: Optional[str] = None) -> GraphExplorer:
    """The explorer for a tensor's autograd graph, or for ``model(*inputs)`` recorded module by module.

    ``names`` is the namespace whose variables name parameters and tensors (default: the caller's);
    ``saved=True`` lists what each node saved for backward (shapes only); ``expand`` is ``"auto"``,
    ``"modules"``, ``"all"`` or a list of module paths to open.
    """
    check_max_nodes(max_nodes)
    kind = type(target)  # type(), not isinstance: an unbound proxy raises from __class__
    if issubclass(kind, GraphRecording):
        return target.graph(*inputs, saved=saved, expand=expand, max_nodes=max_nodes, title=title)
    if inputs and not issubclass(kind, nn.Module):
        raise InputError("graph(tensor) takes no inputs: pass a model to run (graph(model, x)) or only the tensor")
    namespace = caller_namespace(names)
    try:
        if issubclass(kind, nn.Module):
            return _graph_of_model(target, inputs, namespace, saved, expand or "modules", max_nodes, title)
        outputs = _outputs(target, namespace, title)
        return _explore(outputs, namespace, {}, {}, saved, expand or "auto", max_nodes, title, recorded=False)
    finally:
        if namespace is not names:  # ours: drop the caller's frame
            namespace.release()


def check_max_nodes(max_nodes: Any) -> None:
    """The one rule for ``max_nodes`` (``graph(max_nodes=)`` and ``%graph --max-nodes``)."""
    if type(max_nodes) is not int or max_nodes < 1:
        raise InputError(f"max_nodes must be a positive number of nodes to walk (e.g. {DEFAULT_MAX_NODES}), "
                         f"not {max_nodes!r}")


class GraphRecording:
    """``with record_graph() as rec:`` records the module of every autograd node made inside."""

    def __init__(self, names: Optional[Mapping[str, Any]] = None, *, implicit: bool = False) -> None:
        self.namespace: Optional[UserNamespace] = caller_namespace(names) if names is not None else None
        self._implicit = implicit  # names came from the caller's frame: look again when graphing
        self._recorder = GraphRecorder(self.namespace)

    def __enter__(self) -> "GraphRecording":
        self._recorder.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._recorder.__exit__(*exc)
        finally:
            if self._implicit and self.namespace is not None:  # graph() looks at the caller again
                self.namespace.release()  # keep neither the caller's frame nor its locals
                self.namespace = None

    def outputs(self) -> list[torch.Tensor]:
        """Outputs of the top-level modules called while recording (those still alive)."""
        return self._recorder.outputs()

    def graph(self, *outputs: Any, saved: bool = False, expand: Any = None, max_nodes: int = DEFAULT_MAX_NODES,
              title: Optional[str] = None) -> GraphExplorer:
        """The graph behind ``outputs`` (default: the top-level modules' outputs), nested by module."""
        check_max_nodes(max_nodes)
        live = self.namespace is None
        namespace = caller_namespace() if live else self.namespace
        assert namespace is not None
        try:
            if not outputs:
                found = self.outputs()
                if not found:
                    raise InputError("nothing to graph: no module ran while recording, or its output is gone; "
                                     "end the cell with the output tensor (e.g. `loss`)")
                pairs = [(_name_of(t, namespace) or f"output{i}", t) for i, t in enumerate(found)]
            else:
                pairs = _outputs(outputs[0] if len(outputs) == 1 else tuple(outputs), namespace, title)
            rec = self._recorder
            return _explore(pairs, namespace, rec.modules, rec.types, saved, expand or "auto", max_nodes, title,
                            recorded=True)
        finally:
            if live:
                namespace.release()


def record_graph(names: Optional[Mapping[str, Any]] = None) -> GraphRecording:
    """Context manager: ``with record_graph() as rec: ...`` then ``rec.graph(loss)``."""
    if names is None:
        return GraphRecording(caller_namespace(), implicit=True)
    return GraphRecording(names)


def _skipped(namespace: Mapping[str, Any]) -> tuple[str, ...]:
    return namespace.skipped if isinstance(namespace, UserNamespace) else ()


def _describe(value: Any) -> str:
    if issubclass(type(value), torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"


def _outputs(target: Any, namespace: Mapping[str, Any], title: Optional[str]) -> list[tuple[str, torch.Tensor]]:
    """Check the target is a tensor (or tensors) with a graph; name each one."""
    kind = type(target)
    items = list(dict.values(target)) if issubclass(kind, dict) else \
        list(target) if issubclass(kind, (tuple, list)) else [target]
    tensors = [t for t in items if issubclass(type(t), torch.Tensor)]
    if not tensors:
        raise InputError(f"graph needs a tensor with a grad_fn or an nn.Module; got {_describe(target)}")
    with_graph = [t for t in tensors if t.grad_fn is not None]
    if not with_graph:
        t = tensors[0]
        why = ("it is a leaf tensor that requires grad (it starts a graph, it has none behind it)"
               if t.requires_grad else "it does not require grad (computed under no_grad, or from inputs "
               "and parameters that do not require grad)")
        raise InputError(f"graph needs a tensor with a grad_fn: {_describe(t)} has none because {why}; graph a "
                         f"result computed from it, e.g. `loss`, or pass the model and inputs: graph(model, x)")
    single = len(with_graph) == 1
    fallback = (title or "output") if single else None
    return [(_name_of(t, namespace) or fallback or f"output{i}", t) for i, t in enumerate(with_graph)]


def _name_of(tensor: torch.Tensor, namespace: Mapping[str, Any]) -> Optional[str]:
    return tensor_names(namespace).get(id(tensor))


@contextlib.contextmanager
def _untouched(model: nn.Module) -> Iterator[None]:
    """Run the user's model for a picture without changing it: buffers a training-mode forward
    updates (BatchNorm running statistics) are put back, and the random state Dropout draws from is
    restored, so the user's next numbers are the ones they would have had."""
    saved = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    cuda = sorted({t.device.index or 0 for t in model.parameters() if t.is_cuda})
    try:
        with torch.random.fork_rng(devices=cuda):
            yield
    finally:
        with torch.no_grad():
            for name, buf in model.named_buffers():
                if name in saved and buf.shape == saved[name].shape:
                    buf.copy_(saved[name])


def _graph_of_model(model: nn.Module, inputs: Sequence[Any], namespace: Mapping[str, Any], saved: bool, expand: Any,
                    max_nodes: int, title: Optional[str]) -> GraphExplorer:
    if not inputs:
        raise InputError(f"graph({type(model).__name__}) needs example inputs to run the forward: graph(model, x) "
                         f"(in the magic: %graph model --input x)")
    view = namespace
    model_name = next((k for k, v in namespace.items() if v is model and not k.startswith("_")), None)
    if model_name is None:
        model_name = type(model).__name__.lower()
        namespace = {**dict(namespace.items()), model_name: model}
    args = [_graph_input(x) for x in inputs]
    input_names = {id(a): (_name_of(x, namespace) if isinstance(x, torch.Tensor) else None) or f"input{i}"
                   for i, (a, x) in enumerate(zip(args, inputs))}
    recording = GraphRecording(namespace)
    try:
        with torch.enable_grad(), recording, _untouched(model):
            out = model(*args)
    except Exception as exc:
        raise InputError(f"{model_name}(...) raised {type(exc).__name__}: {exc} — fix the forward or the inputs "
                         f"(shapes, dtypes) and try again") from exc
    label = title or f"{model_name}(...)"
    pairs = _outputs(out, {}, label)
    names = {**dict(namespace.items()),
             **{n: a for a, n in ((a, input_names[id(a)]) for a in args if isinstance(a, torch.Tensor))}}
    rec = recording._recorder
    return _explore(pairs, names, rec.modules, rec.types, saved, expand, max_nodes, title or f"graph of {label}",
                    recorded=True, skipped=_skipped(view))


def _graph_input(x: Any) -> Any:
    """Floating tensors get a detached copy that requires grad, so the graph starts at the input.

    ``detach`` shares storage and leaves the user's tensor (and its requires_grad) untouched.
    """
    if isinstance(x, torch.Tensor) and x.is_floating_point() and not x.requires_grad:
        return x.detach().requires_grad_(True)
    return x


def _explore(outputs: list[tuple[str, torch.Tensor]], namespace: Mapping[str, Any],
             modules: Mapping[int, tuple[str, str]], types: Mapping[str, str], saved: bool, expand: Any,
             max_nodes: int, title: Optional[str], recorded: bool, skipped: tuple[str, ...] = ()) -> GraphExplorer:
    roots = module_roots(namespace)
    if not modules:  # a later `%graph loss` still knows the modules of the last recorded forward
        modules, last_types = last_recording()
        types = {**last_types, **types}
    all_types = {**module_types(roots), **types}
    data = build_graph(outputs, param_names=parameter_names(roots), input_names=tensor_names(namespace),
                       modules=modules, module_types=all_types, saved=saved, max_nodes=max_nodes,
                       title=title or f"graph of {', '.join(label for label, _ in outputs)}",
                       source="recorded" if recorded else "autograd", param_aliases=parameter_aliases(roots))
    ops = [n for n in data.nodes if n.kind == "op"]
    if not any(n.module for n in ops):
        # no recording made these nodes (``%graph loss`` records while it evaluates ``loss``, which
        # was computed in an earlier cell): infer the modules from the parameters instead
        data = infer_modules(data)
    else:
        data = GraphData(**{**_fields(data), "source": "recorded"})
    data = mark_nan_birth(used_modules(data), namespace)
    skipped = tuple(dict.fromkeys(skipped + _skipped(namespace)))
    if skipped:
        data = GraphData(**{**_fields(data), "notes": data.notes + (skipped_note(skipped),)})
    if len(data.nodes) > 20_000:
        data = GraphData(**{**_fields(data), "notes": data.notes + (
            f"{len(data.nodes):,} nodes: showing the graph collapsed; click a group to open it, or search",)})
    return GraphExplorer(data, expand=expand)


def _fields(data: GraphData) -> dict[str, Any]:
    return {k: getattr(data, k) for k in ("nodes", "edges", "modules", "title", "source", "notes", "truncated",
                                             "nan_from")}


def mark_nan_birth(data: GraphData, namespace: Optional[Mapping[str, Any]] = None) -> GraphData:
    """Mark the node where the last ``%%nanwatch`` saw the first NaN/Inf born, when this graph is of the
    run it watched (the node's autograd sequence number) or of the very model it watched (the same
    module object, run again): a graph of another or a repaired model is not marked. The marking is
    :func:`torch_nbdebug.process.graph_nanwatch.mark_nan_birth`; this finds the birth."""
    try:
        from torch_nbdebug.api.nanwatch import last_report
    except ImportError:
        return data
    try:
        report = last_report()
        first = getattr(report, "first", None) if report is not None else None
        if first is None:
            return data
        return mark_birth_on(data, first, _same_model(report, first, namespace), _origin(report))
    except Exception:  # another feature's state must never break the graph
        return data


def _same_model(report: Any, event: Any, namespace: Optional[Mapping[str, Any]]) -> bool:
    """Whether the birth's module, as this graph's namespace names it, is the module the watch saw."""
    ref, module = getattr(report, "birth_module", None), getattr(event, "module", "")
    watched = ref() if callable(ref) else None
    return watched is not None and bool(module) and module_at(module_roots(namespace), module) is watched


def _origin(report: Any) -> str:
    """``%%nanwatch, In [4]`` (or the file's name): where the marked birth was found."""
    summary = getattr(report, "summary", None)
    filename = getattr(summary, "cell_filename", None) or ""
    number = getattr(report, "cell", None)
    if not isinstance(number, int):
        number = cell_number(filename) if filename else None
    return birth_origin(filename, number)
