"""``%%explain --check-indices``: validate index arguments before they reach an op.

On CUDA an out-of-range index trips a device-side assert inside the kernel: the error surfaces at a
later line and leaves the CUDA context unusable until the kernel restarts. Checking the indices on
their way in (one reduction and a synchronisation per call, so only when asked for) raises a clear
:class:`IndexCheckError` at the user's line instead, before any kernel runs. The same check runs on
the CPU, where it names the bad value and its position.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from torch_nbdebug.errors import NbdebugError


class IndexCheckError(NbdebugError, IndexError):
    """An index argument is out of range for the op it was about to reach."""


# The index argument as the user passed it (checked to be an integer tensor before use), the size it
# indexes into, and what that size counts.
_Indexed = tuple[Any, int, str]


def _embedding(args: tuple[Any, ...], kw: dict[str, Any]) -> Optional[_Indexed]:
    index, weight = kw.get("input", args[0] if args else None), kw.get("weight", args[1] if len(args) > 1 else None)
    return (index, weight.shape[0], "rows of the embedding table") if isinstance(weight, torch.Tensor) else None


def _aten_embedding(args: tuple[Any, ...], kw: dict[str, Any]) -> Optional[_Indexed]:
    return _embedding((args[1], args[0]) if len(args) > 1 else args, kw)


def _dim_index(args: tuple[Any, ...], kw: dict[str, Any]) -> Optional[_Indexed]:
    data = kw.get("input", args[0] if args else None)
    dim = kw.get("dim", args[1] if len(args) > 1 else None)
    index = kw.get("index", args[2] if len(args) > 2 else None)
    if not isinstance(data, torch.Tensor) or not isinstance(dim, int) or data.dim() == 0:
        return None
    return index, data.shape[dim], f"entries along dimension {dim}"


def _target(args: tuple[Any, ...], kw: dict[str, Any]) -> Optional[_Indexed]:
    logits = kw.get("input", args[0] if args else None)
    target = kw.get("target", args[1] if len(args) > 1 else None)
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor) or target.is_floating_point():
        return None
    classes = logits.shape[1] if logits.dim() > 1 else logits.shape[0]
    ignore = kw.get("ignore_index", -100)
    return target[target != ignore] if ignore is not None else target, classes, "classes"


def _getitem(args: tuple[Any, ...], kw: dict[str, Any]) -> Optional[_Indexed]:
    if len(args) < 2 or not isinstance(args[0], torch.Tensor) or args[0].dim() == 0:
        return None
    return args[1], args[0].shape[0], "entries along dimension 0"


_CHECKS = {"embedding": _embedding, "gather": _dim_index, "index_select": _dim_index,
           "cross_entropy": _target, "nll_loss": _target, "__getitem__": _getitem}


def check_index_arguments(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise :class:`IndexCheckError` when ``func`` is about to get an index outside ``[-size, size)``."""
    name = getattr(func, "__name__", "")
    check = _CHECKS.get(name)
    if check is None:
        return
    if name == "embedding" and getattr(func, "__module__", "") != "torch.nn.functional":
        check = _aten_embedding  # torch.embedding(weight, input)
    found = check(args, kwargs)
    if found is None:
        return
    index, size, what = found
    if not isinstance(index, torch.Tensor) or index.is_floating_point() or index.dtype == torch.bool \
            or index.numel() == 0:
        return
    _raise_if_out_of_range(name, index, size, what, allow_negative=name == "__getitem__")


def _raise_if_out_of_range(name: str, index: torch.Tensor, size: int, what: str, allow_negative: bool) -> None:
    # No ``torch.no_grad()``: an integer index never requires grad, and a grad-mode switch of ours is one
    # a Stop could cut between its two halves, leaving autograd off for the rest of the kernel.
    low = -size if allow_negative else 0
    bad = (index < low) | (index >= size)
    if not bool(bad.any()):
        return
    position = tuple(int(i) for i in bad.nonzero()[0].tolist())
    value = int(index[position].item()) if position else int(index.item())
    raise IndexCheckError(
        f"index {value} is out of range for {name} with {size} {what} (valid: {low}..{size - 1}); "
        f"first bad value at position {position} of the index tensor of shape {list(index.shape)}. "
        f"Checked before the op ran (%%explain --check-indices), so no device-side assert was triggered")
