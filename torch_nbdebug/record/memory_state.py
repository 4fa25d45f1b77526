"""Memory now (``%cudamem``): every live tensor, bytes counted once per storage, named by its holder."""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from torch_nbdebug.data.memory import CATEGORIES, LiveTensor, MemoryState
from torch_nbdebug.record.memory_holders import (
    find_holders, persistent_keys, scan_objects, storage_key,
)


def capture_state(namespace: Optional[Mapping[str, Any]] = None, *, device_type: str = "cpu",
                  top: int = 10, note: str = "") -> MemoryState:
    """Live tensor bytes on ``device_type`` by category, the ``top`` largest named; CUDA counters too."""
    tensors, modules, optimizers = scan_objects()
    kinds = persistent_keys(modules, optimizers)
    del modules, optimizers
    holders = find_holders(namespace)
    totals = dict.fromkeys(CATEGORIES, 0)
    found: dict[int, LiveTensor] = {}
    for tensor in tensors:
        key = storage_key(tensor)
        if key is None or key in found or tensor.device.type != device_type:
            continue
        found[key] = _describe(tensor, key, kinds, holders)
        totals[found[key].category] += found[key].nbytes
    largest = sorted(found.values(), key=lambda t: (-t.nbytes, t.name))[:top]
    state = MemoryState(device=device_type, live_bytes=sum(totals.values()), by_category=totals,
                        top=tuple(largest), tensor_count=len(found), note=note)
    if device_type == "cuda":
        return _with_cuda_counters(state)
    return state


def _describe(tensor: torch.Tensor, key: int, kinds: dict[int, str], holders: Any) -> LiveTensor:
    category = kinds.get(key) or ("activations" if tensor.grad_fn is not None else "other")
    name = holders.get(key) or f"(unnamed {tuple(tensor.shape)})"
    return LiveTensor(name=name, nbytes=tensor.untyped_storage().nbytes(), shape=tuple(tensor.shape),
                      dtype=str(tensor.dtype).replace("torch.", ""), device=str(tensor.device),
                      category=category, has_graph=tensor.grad_fn is not None)


def _with_cuda_counters(state: MemoryState) -> MemoryState:
    from dataclasses import replace

    return replace(state, allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved(),
                   peak=torch.cuda.max_memory_allocated())
