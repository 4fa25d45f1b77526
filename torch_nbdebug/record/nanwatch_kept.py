"""The module layer of ``replay=True``: module outputs are kept by reference while a model's forward
runs and checked together when it returns, not one by one as each module exits.

A module exit only appends a :class:`Kept` entry: the output, the module path(s), what an event or a
replay needs (the module, its float inputs, the user's line, the iteration, the call) and the output's
min, max and sum as 0-d tensors (NaN/Inf propagate through them), computed as the module returns, while
the output is still in the cache (computed when the outermost call returns, every output had to come
back from memory). When the outermost module returns (or an in-place module is about to run, or the
watch ends) :meth:`KeptReadings.take` reads every entry's ``[min, max, mean]`` with one transfer. The entries are then dropped, before the backward: the outputs are
kept no longer than the forward that made them (autograd keeps most of them that long anyway); an
output that does not require grad (``no_grad``, inference) is kept by weak reference with its statistics
computed as it is kept, and every kept entry is dropped when the outermost call raises.
Modules that declare ``inplace=True`` trigger the check before they run, so the common case
(``nn.ReLU(inplace=True)`` after a layer) still sees the layer's own output. Gradients into module
outputs are not kept: they are read as they come (the backward layer, nanwatch_backward, keeps only the
gradients into the outermost call's outputs, until that backward ends).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from torch_nbdebug.record.nanwatch_events import Place
from torch_nbdebug.record.nanwatch_layers import stat_parts
from torch_nbdebug.record.nanwatch_ops import read_together, version_of

_MAX_ENTRIES = 4096  # checked early when this many entries wait (a forward with very many module calls)


@dataclass(slots=True)
class Kept:
    """One kept module output, with its statistics computed at once (no host sync). An output that does
    not require grad (``no_grad``, inference) is kept by weak reference: autograd does not keep it, and
    neither do we (peak memory of generation stays the user's)."""

    tensor: Optional[torch.Tensor]
    paths: list[str]
    iteration: int
    module: torch.nn.Module
    inputs: tuple[torch.Tensor, ...] = ()
    place: Optional[Place] = None
    values: list[float] = field(default_factory=list)
    call: Any = None  # the call's arguments and RNG state (nanwatch_replay.Call)
    version: int = -1  # the output's ``_version`` when the module returned
    ref: Any = None  # a weak output: weakref.ref of it (``tensor`` is None)
    parts: tuple[torch.Tensor, ...] = ()  # min, max and sum of the output (0-d), computed as it was kept
    input_refs: Optional[tuple[Any, ...]] = None  # a weak output's float inputs, by weakref
    # shape, dtype, device, numel of the output, as torch objects (named as text only for an event)
    meta: tuple[tuple[int, ...], Any, Any, int] = ((), None, None, 0)
    table: bool = True  # the module's output for the layer table (False: another output, births only)

    def value(self) -> Optional[torch.Tensor]:
        """The output, or None when it was weakly kept and has been freed since."""
        return self.tensor if self.ref is None else self.ref()

    def live_inputs(self) -> Optional[tuple[torch.Tensor, ...]]:
        """The float inputs, or None when one was weakly kept and has been freed."""
        if self.input_refs is None:
            return self.inputs
        inputs = tuple(r() for r in self.input_refs)
        return None if any(x is None for x in inputs) else inputs

    def written_since(self) -> bool:
        """Written in place after the module returned (``h = self.fc(x); h.log_()`` in the parent): its
        numbers now are the parent's doing, not this module's."""
        t = self.tensor if self.ref is None else self.ref()
        return t is not None and version_of(t) != self.version


class KeptReadings:
    """The entries of the running forward, in the order the modules exited (innermost first)."""

    def __init__(self) -> None:
        self.entries: list[Kept] = []

    def __len__(self) -> int:
        return len(self.entries)

    def output(self, t: torch.Tensor, path: str, module: torch.nn.Module, inputs: tuple[torch.Tensor, ...],
               place: Optional[Place], iteration: int, weak: bool = False, table: bool = True) -> Kept:
        meta, parts = (t.shape, t.dtype, t.device, t.numel()), stat_parts(t)
        if weak:
            entry = Kept(None, [path], iteration, module, (), place, version=version_of(t), ref=weakref.ref(t),
                         parts=parts, input_refs=tuple(weakref.ref(x) for x in inputs), meta=meta, table=table)
        else:
            entry = Kept(t, [path], iteration, module, inputs, place, version=version_of(t), meta=meta, table=table,
                         parts=parts)
        self.entries.append(entry)
        return entry

    def full(self) -> bool:
        return len(self.entries) > _MAX_ENTRIES

    def take(self) -> list[Kept]:
        """Every entry with its ``values`` filled, read in one transfer per device; the list is emptied."""
        entries, self.entries = [e for e in self.entries if not e.written_since()], []
        if not entries:
            return entries
        parts: list[torch.Tensor] = []
        for entry in entries:
            parts += entry.parts
        # An entry's three parts share its output's device; ``stack`` promotes mixed dtypes as ``cat`` does.
        device = entries[0].meta[2]
        if all(e.meta[2] == device for e in entries):
            flat = torch.stack(parts).tolist()  # one copy
        else:  # several devices: one transfer per device
            flat = [v for values in read_together(parts) for v in values]
        for i, entry in enumerate(entries):
            entry.values = [flat[3 * i], flat[3 * i + 1], flat[3 * i + 2] / entry.meta[3]]
        return entries

    def clear(self) -> None:
        self.entries = []

