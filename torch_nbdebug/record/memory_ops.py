"""Small helpers of the memory recorder: finding tensors in op arguments."""
from __future__ import annotations

from typing import Any, Optional

import torch

from torch_nbdebug.record.tensors import storage_key


def input_storage_keys(args: Any) -> set[Optional[int]]:
    """Storage keys of an op's inputs: an output sharing one is an in-place result or a view."""
    return {storage_key(t) for t in tensors_in(args)}


def builds_graph(args: Any) -> bool:
    """True when grad mode is on and an input requires grad: the op's outputs join the graph.

    Below the autograd key the outputs do not carry ``requires_grad`` yet, so the inputs decide.
    """
    if not torch.is_grad_enabled():
        return False
    return any(t.requires_grad for t in tensors_in(args))


def tensors_in(value: Any, depth: int = 3) -> list[torch.Tensor]:
    """The tensors in an op's outputs or ``(args, kwargs)``: tensors inside tuples, lists and dicts,
    ``depth`` levels deep (``(args, kwargs)`` -> args -> a ``Tensor[]`` argument such as ``cat``'s).

    A hand-written walk: pytree's general flatten costs more than many of the ops it would inspect.
    """
    if isinstance(value, torch.Tensor):
        return [value]
    found: list[torch.Tensor] = []
    _collect(value, depth, found)
    return found


def _collect(value: Any, depth: int, found: list[torch.Tensor]) -> None:
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    for item in items:
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif depth > 1 and isinstance(item, (tuple, list, dict)):
            _collect(item, depth - 1, found)
