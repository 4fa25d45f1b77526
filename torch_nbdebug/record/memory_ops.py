"""Small helpers of the memory recorder: finding tensors in op arguments, and saved-tensor packing."""
from __future__ import annotations

from typing import Any, Optional

import torch

from torch_nbdebug.record.memory_holders import storage_key


def is_input_storage(key: int, args: Any) -> bool:
    return any(storage_key(t) == key for t in tensors_in(args))


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


class Saved:
    """A saved tensor plus its version at save time.

    With saved-tensors hooks installed, autograd no longer checks that a saved tensor was not
    modified in place before backward; we redo that check on unpack so the user's program still
    fails exactly where it would without us (silently wrong gradients would be far worse).
    """

    __slots__ = ("tensor", "version", "node")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        try:
            self.version = tensor._version
        except RuntimeError:  # tensors without a version counter (inference tensors): nothing to check
            self.version = None
        self.node = type(tensor.grad_fn).__name__ if tensor.grad_fn is not None else None


def unpack(saved: Saved) -> torch.Tensor:
    tensor = saved.tensor
    if saved.version is not None and tensor._version != saved.version:
        shape = list(tensor.shape)
        origin = f", which is output {tensor.output_nr} of {saved.node}," if saved.node else ""
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{tensor.type()} {shape}]{origin} is at version {tensor._version}; expected version "
            f"{saved.version} instead. Hint: enable anomaly detection to find the operation that failed to "
            "compute its gradient, with torch.autograd.set_detect_anomaly(True).")
    return tensor
