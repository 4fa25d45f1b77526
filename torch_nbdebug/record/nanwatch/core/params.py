"""Name the parameter or buffer that carried a NaN/Inf into an op (``model.1.running_var``).

Ops see views (``weight.t()``) and buffers updated in place, so tensors are matched by storage, not
identity. The index is built only when an input event needs it (rare), from the namespace's models.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, NamedTuple, Optional

import torch

from torch_nbdebug.data.nanwatch import Cause, ParamKind
from torch_nbdebug.record.nanwatch.core import ops
from torch_nbdebug.record.modules import compiled_original, module_roots
from torch_nbdebug.record.tensors import storage_key


class Carrier(NamedTuple):
    """The parameters/buffers among an op's non-finite inputs (empty names: plain input data)."""

    names: tuple[str, ...]
    kind: Optional[ParamKind]

    @property
    def cause(self) -> Cause:
        if not self.names:
            return "input_data"
        return "nonfinite_buffer" if self.kind == "buffer" else "nonfinite_parameter"

    @property
    def detail(self) -> str:
        if not self.names:
            return "non-finite input data (not a parameter)"
        return f"non-finite {self.kind} " + ", ".join(self.names)

    def fields(self) -> dict[str, Any]:
        """The event fields: ``param``, ``param_kind``, ``cause`` and the human ``detail``."""
        found: dict[str, Any] = dict(cause=self.cause, detail=self.detail)
        if self.names:
            found.update(param=self.names[0], param_kind=self.kind)
        return found


def storage_index(namespace: Optional[Mapping[str, Any]]) -> dict[int, tuple[str, ParamKind]]:
    """Storage key -> (qualified name, parameter or buffer) for every model in the namespace."""
    index: dict[int, tuple[str, ParamKind]] = {}
    for root_name, root in module_roots(namespace):
        walked = compiled_original(root) or root  # a torch.compile wrapper: the names the user writes
        for name, p in walked.named_parameters():
            key = storage_key(p)
            if key is not None:
                index.setdefault(key, (f"{root_name}.{name}", "parameter"))
        for name, b in walked.named_buffers():
            key = storage_key(b)
            if key is not None:
                index.setdefault(key, (f"{root_name}.{name}", "buffer"))
    return index


# Autograd nodes of ops that only copy or select values (the unchecked ops of core.ops._SAFE that make
# a graph): a non-finite value after one of them was already in what it read.
_COPIES = frozenset("""
EmbeddingBackward0 EmbeddingDenseBackward0 IndexSelectBackward0 GatherBackward0 IndexBackward0 CloneBackward0
ViewBackward0 UnsafeViewBackward0 ReshapeAliasBackward0 TBackward0 TransposeBackward0 PermuteBackward0
ExpandBackward0 SliceBackward0 SelectBackward0 SqueezeBackward0 SqueezeBackward1 SqueezeBackward2
UnsqueezeBackward0 CatBackward0 StackBackward0 SplitBackward0 SplitWithSizesBackward0 UnbindBackward0
NarrowBackward0 ToCopyBackward0 AliasBackward0 AsStridedBackward0 RepeatBackward0 FlipBackward0 RollBackward0
""".split())
_MAX_WALK = 64


def copied_from(tensors: Iterable[Any]) -> list[Optional[int]]:
    """Storage keys of the non-finite leaf tensors (parameters) that ``tensors`` were copied or selected
    from by ops no check watches (``embedding``, ``index_select``, views, ``cat``): the autograd graph
    walked back through such ops only. Asked only for an input event (rare)."""
    stack = [t.grad_fn for t in tensors if getattr(t, "grad_fn", None) is not None]
    keys: list[Optional[int]] = []
    seen: set[int] = set()
    while stack and len(seen) < _MAX_WALK:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None:
            if variable.is_floating_point() and not ops.finite(variable):
                keys.append(storage_key(variable))  # (a finite leaf cat with the bad input carried nothing)
        elif node.name() in _COPIES:
            stack += [f for f, _ in node.next_functions]
    return keys


def bad_parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    """Weights an earlier step (or the code before the watch) made non-finite: inputs too."""
    return [p for p in module.parameters() if ops.checkable(p) and ops.any_nonfinite(p)]


def carriers(namespace: Optional[Mapping[str, Any]], keys: Iterable[Optional[int]]) -> Carrier:
    """Which of these storages are a model's parameters or buffers (parameters named first)."""
    index = storage_index(namespace)
    found = list(dict.fromkeys(index[k] for k in keys if k is not None and k in index))  # each once
    found.sort(key=lambda item: item[1] != "parameter")
    if not found:
        return Carrier((), None)
    return Carrier(tuple(name for name, _ in found), found[0][1])
