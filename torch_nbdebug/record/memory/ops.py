"""Small helpers of the memory recorder: finding tensors in op arguments, telling their device and dtype."""
from __future__ import annotations

from operator import attrgetter
from typing import Any, Callable, Optional

import torch

from torch_nbdebug.record.tensors import storage_key

DTYPE_NAMES: dict[torch.dtype, str] = {}
"""``float32`` for ``torch.float32``: read it first, :func:`dtype_name` fills it (recorders ask per allocation)."""


def dtype_name(dtype: torch.dtype) -> str:
    name = DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return name


def on_device_test(device_type: str) -> Callable[[torch.Tensor], bool]:
    """A cheap "is this tensor on ``device_type``" (``tensor.device`` builds a device object per call)."""
    if device_type in ("cpu", "cuda"):
        return attrgetter(f"is_{device_type}")
    return lambda tensor: tensor.device.type == device_type


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


def plain_shape(tensor: torch.Tensor) -> Optional[tuple[int, ...]]:
    """The shape as plain ints, or None: a nested tensor has no sizes (or a ragged nested int) and a
    FakeTensor left by ``torch.compile`` has symbolic ones that must not be evaluated."""
    try:
        shape = tuple(tensor.shape)
    except Exception:  # noqa: BLE001 - NestedTensorImpl "doesn't support sizes"
        return None
    return shape if all(type(s) is int for s in shape) else None


def storage_bytes(tensor: torch.Tensor, device_type: str) -> Optional[int]:
    """Bytes of the tensor's storage when it holds real memory on ``device_type``, else None.

    A FakeTensor reports a CPU or CUDA device but its storage is on ``meta`` (and may have a symbolic
    size); sparse, functional and wrapper tensors have no storage of their own."""
    try:
        storage = tensor.untyped_storage()
        if storage.device.type != device_type or tensor.device.type != device_type:
            return None
        nbytes = storage.nbytes()
    except Exception:  # noqa: BLE001 - no plain storage behind this tensor
        return None
    return nbytes if type(nbytes) is int else None


def measurable(tensor: torch.Tensor, device_type: Optional[str] = None) -> bool:
    """Whether a recorder can count this tensor: real bytes in a storage, and a shape of ints."""
    try:
        device = device_type or tensor.device.type
    except Exception:  # noqa: BLE001
        return False
    return storage_bytes(tensor, device) is not None and plain_shape(tensor) is not None
