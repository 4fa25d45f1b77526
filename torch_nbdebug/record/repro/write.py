"""Run 1's first write of a parameter, computed out of place.

Copy-on-write copies a tensor just before run 1 first writes it, then the write runs in place: two
passes over every parameter of a training step. When that write is an elementwise in-place
op with an out-of-place twin (``mul_`` -> ``mul``, ``_foreach_mul_`` -> ``_foreach_mul``: what
optimizers run) and the snapshot can move the tensor (``StateSnapshot.movable``), the twin writes new
memory and the tensor takes it (``StateSnapshot.move``); its old memory, unchanged, is the snapshot.
One pass instead of two, the same bytes written. The twin runs the same kernel on the same values,
so run 1 computes what the in-place op would have.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from torch_nbdebug.record.interrupts import deferred_interrupts
from torch_nbdebug.record.repro.ops import OpInfo


def write_out_of_place(info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any],
                       named: list[tuple[str, torch.Tensor]], movable: Callable[[torch.Tensor], bool],
                       move: Callable[[torch.Tensor, torch.Tensor], None]) -> bool:
    """Run ``info``'s twin and give each tensor it writes (``self``) its result; False (nothing moved)
    when the op has no twin, a tensor cannot be moved, a list op reads a tensor it writes elsewhere
    in the list (in place, a later element would read the new value), or a result differs in dtype
    or layout (type promotion): then the in-place op runs as usual."""
    __tracebackhide__ = True  # noqa: F841 - IPython hides this frame in the user's tracebacks
    written = [t for n, t in named if n.split("[")[0] == "self"]
    if info.twin is None or not written or len({id(t) for t in written}) != len(written):
        return False
    if len(written) > 1 or named[0][0] != "self":  # a list: no written tensor may be read by another slot
        ids = {id(t) for t in written}
        if any(id(t) in ids for n, t in named if n.split("[")[0] != "self"):
            return False
    if not all(movable(t) for t in written):
        return False
    out = info.twin(*args, **kwargs)
    new = [out] if isinstance(out, torch.Tensor) else list(out)
    if len(new) != len(written) or not all(_fits(n, w) for n, w in zip(new, written)):
        return False
    with deferred_interrupts():  # a Stop waits until every tensor the op wrote holds its result
        for w, n in zip(written, new):
            move(w, n)
    return True


def _fits(new: Any, old: torch.Tensor) -> bool:
    """Whether ``new`` can be ``old``'s memory: same dtype, device, shape and strides."""
    return bool(isinstance(new, torch.Tensor) and new.dtype == old.dtype and new.device == old.device and
                new.shape == old.shape and new.stride() == old.stride() and new.storage_offset() == 0)
