"""Tensor identity shared by the recorders, and the tensors of an op's arguments or outputs.

``storage_key`` reads a private attribute, so it lives in :mod:`torch_nbdebug.record.compat`; the
recorders keep importing it from here.
"""
from __future__ import annotations

from typing import Any

import torch

from torch_nbdebug.record.compat import storage_key

__all__ = ["storage_key", "tensors_in"]


def tensors_in(value: Any, depth: int = 1) -> list[torch.Tensor]:
    """``value`` if it is a tensor, else the tensors in its lists and tuples, ``depth`` levels deep (an op's
    outputs: 1; a collective's arguments, lists of lists of tensors among them: 3)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 0 and isinstance(value, (list, tuple)):
        return [t for v in value for t in tensors_in(v, depth - 1)]
    return []
