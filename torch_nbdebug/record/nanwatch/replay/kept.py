"""The module layer of ``replay=True``: module outputs are kept while a model's forward runs and
checked together when it returns, not one by one as each module exits.

A CPU output is read as its module returns (its min, max and sum; reading a CPU scalar is no
synchronisation). A finite one keeps only what the layer table needs when the forward returns: its
module path(s), its reading and its ``_version`` (see below). A non-finite one keeps what an event or a
replay needs too (:class:`CallSite`: the module, its float inputs, the user's line, the iteration, the
call's arguments and RNG state). An output on another device keeps all of it, with its min, max and
sum computed as the module returns (0-d tensors, NaN/Inf propagate through them), while the output is
still in the cache, and read with one transfer by :meth:`KeptReadings.take`.
When the outermost module returns (or an in-place module is about to run, or the watch ends) every
entry is taken: an output written in place since its module returned (``h = self.fc(x); h.mul_(3)``
in the parent) is dropped, its numbers now being the parent's; the others give the table its rows and
a non-finite one goes to the replayer, innermost call first, the weights as the forward saw them.
The entries are then dropped, before the backward: the outputs are kept no longer than the forward that
made them (autograd keeps most of them that long anyway); an output that does not require grad
(``no_grad``, inference) is kept by weak reference, and every kept entry is dropped when the
outermost call raises. Modules that declare ``inplace=True`` trigger the check before they run, so
the common case (``nn.ReLU(inplace=True)`` after a layer) still sees the layer's own output. Gradients
into module outputs are not kept: they are read as they come (the backward layer, replay.backward,
keeps only the gradients into the outermost call's outputs, until that backward ends).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from torch_nbdebug.record.nanwatch.core import ops
from torch_nbdebug.record.nanwatch.core.events import Place, here
from torch_nbdebug.record.nanwatch.core.layers import stat_parts
from torch_nbdebug.record.nanwatch.core.live import LiveRef
from torch_nbdebug.record.nanwatch.core.ops import read_together
from torch_nbdebug.record.nanwatch.replay.forward import Call, Start, capture

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
    call: Any = None  # the call's arguments and RNG state (replay.forward.Call)
    # the output held weakly with its ``_version`` when the module returned; a weak output is held only so
    # (``tensor`` is None)
    live: Optional[LiveRef] = None
    parts: tuple[torch.Tensor, ...] = ()  # min, max and sum of the output (0-d), computed as it was kept
    input_refs: Optional[tuple[Any, ...]] = None  # a weak output's float inputs, by weakref
    # shape, dtype, device, numel of the output, as torch objects (named as text only for an event)
    meta: tuple[tuple[int, ...], Any, Any, int] = ((), None, None, 0)
    table: bool = True  # the module's output for the layer table (False: another output, births only)
    # a finite float16/bfloat16 output: whether its inputs reached sqrt(finfo.max), read at exit on a CPU or
    # for a no-grad call (whose inputs are gone by the check); None: read at the check
    squares_risk: Optional[bool] = None

    def value(self) -> Optional[torch.Tensor]:
        """The output, or None when it was weakly kept and has been freed since."""
        return self.tensor if self.tensor is not None or self.live is None else self.live.alive()

    def live_inputs(self) -> Optional[tuple[torch.Tensor, ...]]:
        """The float inputs, or None when one was weakly kept and has been freed."""
        if self.input_refs is None:
            return self.inputs
        inputs = tuple(r() for r in self.input_refs)
        return None if any(x is None for x in inputs) else inputs


class KeptReadings:
    """The entries of the running forward, in the order the modules exited (innermost first)."""

    def __init__(self) -> None:
        self.entries: list[Kept] = []

    def __len__(self) -> int:
        return len(self.entries)

    def output(self, t: torch.Tensor, path: str, module: torch.nn.Module, inputs: tuple[torch.Tensor, ...],
               place: Optional[Place], iteration: int, weak: bool = False, table: bool = True,
               values: Optional[list[float]] = None) -> Kept:
        """Keep an output with what a replay needs; ``values``: its reading when taken already (a CPU
        output), else its statistics are computed now and read by :meth:`take`."""
        meta, parts = (t.shape, t.dtype, t.device, t.numel()), () if values is not None else stat_parts(t)
        if weak:
            entry = Kept(None, [path], iteration, module, (), place, live=LiveRef(t), parts=parts,
                         input_refs=tuple(weakref.ref(x) for x in inputs), meta=meta, table=table)
        else:
            entry = Kept(t, [path], iteration, module, inputs, place, live=LiveRef(t), meta=meta, table=table,
                         parts=parts)
        if values is not None:
            entry.values = values
        self.entries.append(entry)
        return entry

    def read(self, t: torch.Tensor, path: str, module: torch.nn.Module, iteration: int, values: list[float],
             weak: bool) -> Kept:
        """Keep a finite output already read (a CPU output): only what the table needs when the forward
        returns (its paths, and its version, to drop it if it is written in place before then)."""
        entry = Kept(None if weak else t, [path], iteration, module, values=values, live=LiveRef(t))
        self.entries.append(entry)
        return entry

    def full(self) -> bool:
        return len(self.entries) > _MAX_ENTRIES

    def take(self) -> list[Kept]:
        """Every entry with its ``values`` filled, those not read yet read in one transfer per device; the
        list is emptied."""
        # (an entry written in place after its module returned, ``h = self.fc(x); h.log_()`` in the parent,
        # is left out: its numbers now are the parent's doing, not this module's)
        entries, self.entries = [e for e in self.entries if e.live is None or not e.live.changed()], []
        unread = [e for e in entries if e.parts]
        if not unread:
            return entries
        parts: list[torch.Tensor] = []
        for entry in unread:
            parts += entry.parts
        # An entry's three parts share its output's device; ``stack`` promotes mixed dtypes as ``cat`` does.
        device = unread[0].meta[2]
        if all(e.meta[2] == device for e in unread):
            flat = torch.stack(parts).tolist()  # one copy
        else:  # several devices: one transfer per device
            flat = [v for values in read_together(parts) for v in values]
        for i, entry in enumerate(unread):
            entry.values = [flat[3 * i], flat[3 * i + 1], flat[3 * i + 2] / entry.meta[3]]
        return entries

    def clear(self) -> None:
        self.entries = []


class CallSite:
    """What a replay needs of the exiting call (its arguments and RNG state, the user's line, its float
    inputs), built on first use: most outputs are finite and need none of it."""

    __slots__ = ("start", "args", "kwargs", "path", "_call", "_place")

    def __init__(self, start: Optional[Start], args: Any, kwargs: dict, path: str) -> None:
        self.start, self.args, self.kwargs, self.path = start, args, kwargs, path
        self._call: Optional[Call] = None
        self._place: Optional[Place] = None

    def call(self) -> Call:
        if self._call is None:
            self._call = capture(self.args, self.kwargs, self.start)
        return self._call

    def place(self) -> Place:
        if self._place is None:
            self._place = here(self.path, None)  # (one walk up the stack)
        return self._place

    def inputs(self) -> tuple[torch.Tensor, ...]:
        return float_args(self.args)


def float_args(args: Any) -> tuple[torch.Tensor, ...]:
    """``ops.float_inputs`` of a module's positional arguments, without a tree walk for plain tensors."""
    if type(args) is tuple and len(args) == 1 and isinstance(args[0], torch.Tensor):  # the common call
        return args if ops.checkable(args[0]) else ()
    if isinstance(args, tuple) and all(isinstance(a, torch.Tensor) or not isinstance(a, (list, tuple, dict))
                                       for a in args):
        return tuple(a for a in args if isinstance(a, torch.Tensor) and ops.checkable(a))[:32]
    return tuple(ops.float_inputs(args, {}))
