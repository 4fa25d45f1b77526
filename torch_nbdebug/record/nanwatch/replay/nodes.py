"""The hooks replay's backward (:mod:`replay.backward`) puts on autograd nodes and tensors while a backward
runs without the per-op mode, and the kinds of node it knows: those that only move a gradient (nothing to
check) and those that mask it (a non-finite gradient can end there unseen)."""
from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, Protocol

import torch

from torch_nbdebug.errors import NanBirthError
from torch_nbdebug.record import compat
from torch_nbdebug.record.nanwatch.core import ops
from torch_nbdebug.record.nanwatch.replay.calls import OWN_TENSOR_HOOKS


class _Errors(Protocol):
    def internal_error(self, where: str, exc: Exception) -> None: ...


class NodeWatch(Protocol):
    """What the hooks use of the backward layer (``BackwardWatch``)."""

    unwatched: bool

    @property
    def host(self) -> _Errors: ...

    def node_finished(self, grad_inputs: Any, grad_outputs: Any) -> None: ...

    def rerun(self, run: Callable[[], Any], bad: list[bool]) -> None: ...

    def watched_hook(self, hook: Callable[..., Any], args: tuple) -> Any: ...


# Nodes whose backward only moves or reshapes the gradient: they cannot make a value non-finite.
MOVES_ONLY = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "TBackward0",
                         "TransposeBackward0", "TransposeBackward1", "PermuteBackward0", "SqueezeBackward0",
                         "SqueezeBackward1", "SqueezeBackward2", "UnsqueezeBackward0", "CloneBackward0",
                         "AliasBackward0", "DetachBackward0"})
# Nodes whose backward selects or masks (zeroes where the forward dropped its input): a non-finite gradient
# made inside a model can end there, every gradient the module checks see then finite (``torch.sqrt(
# torch.relu(h))``: SqrtBackward0's Inf where relu gave 0, zeroed by ReluBackward0). Inside the model calls
# a pre hook on them marks the call for its replay when a non-finite gradient reaches one.
ABSORBS = frozenset({"ReluBackward0", "ThresholdBackward0", "ThresholdBackward1", "WhereBackward0",
                      "MaskedFillBackward0", "MaskedFillBackward1", "ClampBackward0", "ClampBackward1",
                      "ClampMinBackward0", "ClampMinBackward1", "ClampMaxBackward0", "ClampMaxBackward1",
                      "HardtanhBackward0", "NanToNumBackward0", "HardsigmoidBackward0", "HardswishBackward0",
                      "HardshrinkBackward0", "SoftshrinkBackward0", "MaximumBackward0", "MinimumBackward0",
                      "FmaxBackward0", "FminBackward0", "SignBackward0", "FloorBackward0", "RoundBackward0",
                      "RoundBackward1", "CeilBackward0", "TruncBackward0", "FracBackward0", "IndexPutBackward0",
                      "torch::autograd::CopySlices", "MaskedScatterBackward0", "IndexFillBackward0",
                      "IndexFillBackward1", "ScatterBackward0", "ScatterBackward1", "IndexCopyBackward0",
                      "FillBackward0", "FillBackward1", "ZeroBackward0", "EmbeddingBackward0",
                      "SliceScatterBackward0", "SelectScatterBackward0", "DiagonalScatterBackward0",
                      "AsStridedScatterBackward0"})

EMBEDDING = 2  # an EmbeddingBackward0 node: it masks only with a padding_idx
# torch's node classes (one per kind of node) -> 0, 1 (masks) or EMBEDDING: ``name()`` read once per class
KINDS: dict[type, int] = {}


def absorbs(node: Any) -> bool:
    """Whether ``node`` masks its gradient (``ABSORBS``). The walk reads ``KINDS`` first: every node
    of a built-in class (one class per kind, named as the node) is judged by its class."""
    kind = KINDS.get(type(node))
    if kind is None:
        name = node.name()
        kind = EMBEDDING if name == "EmbeddingBackward0" else int(name in ABSORBS)
        cls = type(node)
        if cls.__module__ == "builtins" and name.rpartition("::")[2] == cls.__name__:
            KINDS[cls] = kind
    return kind == 1 or (kind == EMBEDDING and compat.embedding_pads(node))


class NodeRerun:
    """Post hook on an autograd node outside the model calls, for one backward (see ``_plan``)."""

    __slots__ = ("watch",)

    def __init__(self, watch: "NodeWatch") -> None:
        self.watch = watch

    def __call__(self, grad_inputs: Any, grad_outputs: Any) -> None:
        try:
            self.watch.node_finished(grad_inputs, grad_outputs)
        except NanBirthError:
            raise
        except Exception as exc:  # noqa: BLE001 - a debugging aid must not change the program
            self.watch.host.internal_error("a backward node's gradients", exc)


class Accumulation:
    """Pre and post hook on a leaf's ``AccumulateGrad`` outside the model calls: ``.grad += grad`` that
    overflows (no ``zero_grad``) is run again, on a copy of the old ``.grad``, under the per-op watch."""

    __slots__ = ("watch", "node", "before")

    def __init__(self, watch: "NodeWatch", node: Any) -> None:
        self.watch, self.node = watch, node
        self.before: Optional[torch.Tensor] = None

    def pre(self, grad_outputs: Any) -> None:
        try:
            old = getattr(self.node.variable, "grad", None)
            self.before = None
            if isinstance(old, torch.Tensor) and old.layout == torch.strided and ops.finite(old) \
                    and all(ops.finite(g) for g in grad_outputs):
                with torch.no_grad():
                    self.before = old.clone()
        except Exception as exc:  # noqa: BLE001 - a debugging aid must not change the program
            self.watch.host.internal_error("a gradient accumulation", exc)

    def post(self, grad_inputs: Any, grad_outputs: Any) -> None:
        before, self.before = self.before, None
        try:
            if before is not None and not ops.finite(getattr(self.node.variable, "grad", None)):
                self.watch.rerun(lambda: before.add_(grad_outputs[0]), [])
        except NanBirthError:
            raise
        except Exception as exc:  # noqa: BLE001 - a debugging aid must not change the program
            self.watch.host.internal_error("a gradient accumulation", exc)


class Absorber:
    """Pre hook on a masking node inside a model call (``ABSORBS``), for one backward: a non-finite
    gradient reaching it marks the call for its replay (the node may zero it: nothing after sees it)."""

    __slots__ = ("watch", "region")

    def __init__(self, watch: "NodeWatch", region: Any) -> None:
        self.watch, self.region = watch, region

    def __call__(self, grad_outputs: Any) -> None:
        region = self.region
        if region.absorbed or not self.watch.unwatched:
            return
        try:
            if not all(ops.finite(g) for g in grad_outputs):
                region.absorbed = region.active = True
        except Exception as exc:  # noqa: BLE001 - a debugging aid must not change the program
            self.watch.host.internal_error("a gradient inside a model", exc)


class WatchedHook:
    """A tensor hook the user registered during the watch, outside a model: while a backward runs
    without the per-op mode, the hook runs under it (its ops are the user's backward code, watched
    as by the always-on watch). After the watch it only calls the hook."""

    __slots__ = ("hook", "watch", "__weakref__")

    def __init__(self, hook: Callable[..., Any], watch: "NodeWatch") -> None:
        self.hook, self.watch = hook, weakref.ref(watch)

    def __call__(self, *args: Any) -> Any:
        watch = self.watch()
        if watch is None or not watch.unwatched:
            return self.hook(*args)
        return watch.watched_hook(self.hook, args)


OWN_HOOKS = (WatchedHook, *OWN_TENSOR_HOOKS)  # tensor hooks of ours: they keep a backward unwatched
