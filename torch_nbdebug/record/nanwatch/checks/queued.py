"""What the deferred path queues: one small record per kind of check, read in order when the flags come.

Each holds its device flags (``flags``: NaN/Inf-propagating float64 sums, see ``deferred._flags``; None when
it has none to read) and only what its own rule needs: no tensor but those flags, inputs and outputs by
:class:`Shape` (a weak reference with the version, for exact statistics while they live).
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import torch

from torch_nbdebug.record.nanwatch.core.events import Shape, Site
from torch_nbdebug.record.nanwatch.core.layers import Later


class OpCheck(NamedTuple):
    """A checked op: its outputs' sums then its inputs'."""

    flags: torch.Tensor
    outputs: tuple[Shape, ...]
    inputs: tuple[Shape, ...]
    keys: tuple[Optional[int], ...]  # the inputs' storage keys, then the outputs'
    external: tuple[bool, ...]  # which inputs came from outside the watch
    site: Site
    iteration: int
    node_key: Optional[int]  # backward: the node's id (its births wait for it to finish)
    made_by: Any  # the producer of input 0, named now: it may be gone when the flags are read
    inplace: bool


class AbsorbCheck(NamedTuple):
    """A where/masked_fill: whether a born value was thrown away. Its outputs' sums then its inputs'."""

    flags: torch.Tensor
    n_out: int
    keys: tuple[Optional[int], ...]  # the inputs' storage keys, then the outputs'
    written: tuple[bool, ...]  # which inputs it wrote (in place)


class NodeCheck(NamedTuple):
    """A backward node finished: whether a non-finite gradient left it (its held births count then)."""

    flags: Optional[torch.Tensor]  # the sums of its gradients no queued op wrote (None: all were written)
    reused: tuple[int, ...]  # storage keys of the gradients queued ops wrote: their flags are reused
    node_key: int


class ModuleCheck(NamedTuple):
    """Module mode: a module's output, flagged by the layer table's ``reading`` of it; its inputs' sums."""

    flags: Optional[torch.Tensor]  # None without float inputs
    outputs: tuple[Shape]
    inputs: tuple[Shape, ...]
    coming_in: tuple[bool, ...]  # which inputs are data coming in (see modules.rule)
    site: Site
    iteration: int
    module: torch.nn.Module
    reading: Later


class GradCheck(NamedTuple):
    """Module mode: the gradient into a module's output, flagged by the layer table's ``reading`` of it."""

    outputs: tuple[Shape]
    site: Site
    iteration: int
    reading: Later
    flags: None = None
    inputs: tuple[Shape, ...] = ()


class StepCheck(NamedTuple):
    """An optimizer step's parameter (and gradient) norms: ``judge`` gets their values, in order."""

    flags: torch.Tensor
    judge: Callable[[list[float]], None]


Queued = Union[OpCheck, AbsorbCheck, NodeCheck, ModuleCheck, GradCheck, StepCheck]
