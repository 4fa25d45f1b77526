"""Memory now (``%cudamem``): every live tensor, bytes counted once per storage, named by its holder."""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from torch_nbdebug.data.memory import CATEGORIES, LiveTensor, MemoryState
from torch_nbdebug.record.memory.holders import (
    find_holders, persistent_keys, scan_objects, storage_key,
)
from torch_nbdebug.record.memory.ops import plain_shape, storage_bytes


def capture_state(namespace: Optional[Mapping[str, Any]] = None, *, device_type: str = "cpu",
                  top: int = 10, note: str = "") -> MemoryState:
    """Live tensor bytes on ``device_type`` by category, the ``top`` largest named; CUDA counters too.

    Tensors with no real memory here (FakeTensors ``torch.compile`` leaves behind, meta, sparse)
    are not counted; a nested tensor is counted with its dimensions shown as -1.
    """
    tensors, modules, optimizers = scan_objects(nested=True)
    kinds = persistent_keys(modules, optimizers)
    del modules, optimizers
    holders = find_holders(namespace)
    totals = dict.fromkeys(CATEGORIES, 0)
    found: dict[int, LiveTensor] = {}
    for tensor in tensors:
        try:
            live = _describe(tensor, device_type, found, kinds, holders)
        except Exception:  # noqa: BLE001 - a tensor subclass whose attributes raise is not counted
            continue
        if live is not None:
            totals[live.category] += live.nbytes
    del tensors
    largest = sorted(found.values(), key=lambda t: (-t.nbytes, t.name))[:top]
    state = MemoryState(device=device_type, live_bytes=sum(totals.values()), by_category=totals,
                        top=tuple(largest), tensor_count=len(found), note=note)
    if device_type == "cuda":
        return _with_cuda_counters(state)
    return state


def _describe(tensor: torch.Tensor, device_type: str, found: dict[int, LiveTensor], kinds: dict[int, str],
              holders: Any) -> Optional[LiveTensor]:
    """The tensor's entry (also stored in ``found``), or None: already counted, elsewhere, not real."""
    key = storage_key(tensor)
    if key is None or key in found:
        return None
    nbytes = storage_bytes(tensor, device_type)
    if nbytes is None:
        return None
    shape = plain_shape(tensor)
    if shape is None:  # nested: no sizes to show, one -1 per dimension
        shape = tuple(-1 for _ in range(_dims(tensor)))
    has_graph = tensor.grad_fn is not None
    category = kinds.get(key) or ("activations" if has_graph else "other")
    name = holders.get(key) or f"(unnamed {shape})"
    found[key] = LiveTensor(name=name, nbytes=nbytes, shape=shape, dtype=str(tensor.dtype).replace("torch.", ""),
                            device=str(tensor.device), category=category, has_graph=has_graph)
    return found[key]


def _dims(tensor: torch.Tensor) -> int:
    try:
        return int(tensor.dim())
    except Exception:  # noqa: BLE001
        return 0


def _with_cuda_counters(state: MemoryState) -> MemoryState:
    from dataclasses import replace

    return replace(state, allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved(),
                   peak=torch.cuda.max_memory_allocated())
