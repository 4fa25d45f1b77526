"""Tensor identity shared by the recorders."""
from __future__ import annotations

from typing import Optional

import torch


def storage_key(tensor: torch.Tensor) -> Optional[int]:
    """Identity of a tensor's storage (shared by all its views), or None for storage-less tensors."""
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None  # sparse, nested, functional or wrapper subclasses: no plain storage
