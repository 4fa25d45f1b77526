"""The module layer of ``replay=True``: module outputs are kept by reference while a model's forward
runs and checked together when it returns, not one by one as each module exits.

A module exit only appends a :class:`Kept` entry: the output, the module path(s) and what an event or
a replay needs (the module, its float inputs, the user's line, the iteration, the call). When the
outermost module returns (or an in-place module is about to run, or the watch ends)
:meth:`KeptReadings.take` computes every entry's ``[min, max, mean]`` (NaN/Inf propagate through them)
and reads them with one transfer. The entries are then dropped, before the backward: the outputs are
kept no longer than the forward that made them (autograd keeps most of them that long anyway).
Modules that declare ``inplace=True`` trigger the check before they run, so the common case
(``nn.ReLU(inplace=True)`` after a layer) still sees the layer's own output. Gradients into module
outputs are not kept: they are read as they come (the backward runs under the per-op watch).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from torch_nbdebug.record.nanwatch_events import Place
from torch_nbdebug.record.nanwatch_ops import HALF, read_together

_MAX_ENTRIES = 4096  # checked early when this many entries wait (a forward with very many module calls)


@dataclass
class Kept:
    """One kept module output."""

    tensor: torch.Tensor
    paths: list[str]
    iteration: int
    module: torch.nn.Module
    inputs: tuple[torch.Tensor, ...] = ()
    place: Optional[Place] = None
    values: list[float] = field(default_factory=list)
    call: Any = None  # the call's arguments and RNG state (nanwatch_replay.Call)


class KeptReadings:
    """The entries of the running forward, in the order the modules exited (innermost first)."""

    def __init__(self) -> None:
        self.entries: list[Kept] = []

    def __len__(self) -> int:
        return len(self.entries)

    def output(self, t: torch.Tensor, path: str, module: torch.nn.Module, inputs: tuple[torch.Tensor, ...],
               place: Optional[Place], iteration: int) -> Kept:
        entry = Kept(t, [path], iteration, module, inputs, place)
        self.entries.append(entry)
        return entry

    def full(self) -> bool:
        return len(self.entries) > _MAX_ENTRIES

    def take(self) -> list[Kept]:
        """Every entry with its ``values`` filled, read in one transfer per device; the list is emptied."""
        entries, self.entries = self.entries, []
        if not entries:
            return entries
        parts: list[torch.Tensor] = []
        with torch.no_grad():
            for entry in entries:
                parts += _stat_parts(entry.tensor)
        first = parts[0]
        if all(p.dtype == first.dtype and p.device == first.device for p in parts):
            flat = torch.stack(parts).tolist()  # one copy
        else:  # mixed dtypes or devices: cat promotes, one transfer per device
            flat = [v for values in read_together(parts) for v in values]
        for i, entry in enumerate(entries):
            lo, hi, total = flat[3 * i], flat[3 * i + 1], flat[3 * i + 2]
            entry.values = [lo, hi, total / entry.tensor.numel()]
        return entries

    def clear(self) -> None:
        self.entries = []


def _stat_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """min, max and sum as 0-d tensors (full reductions: ``aminmax(dim=0)`` is 4x slower on CPU)."""
    x = t.detach()
    lo, hi = torch.aminmax(x)
    total = x.sum(dtype=torch.float32) if x.dtype in HALF else x.sum()
    if total.dtype != lo.dtype:
        lo, hi = lo.to(total.dtype), hi.to(total.dtype)
    return [lo, hi, total]
