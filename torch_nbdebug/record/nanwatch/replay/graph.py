"""The autograd graph of a replayed model call: its outputs' roots and leaves, the gradients to check, and
the replayed backward itself."""
from __future__ import annotations

from typing import Any, Optional

import torch

from torch_nbdebug.record import compat
from torch_nbdebug.record.nanwatch.core import ops

_STRIDED = torch.strided


def backward_of(outs: list[torch.Tensor], grads: list[Any], inputs: list[torch.Tensor],
              start: int) -> list[Optional[torch.Tensor]]:
    """The replayed call's backward, accumulating into no ``.grad`` of the user's: ``autograd.grad``; a
    reentrant checkpoint refuses it, so there ``backward()`` runs with every leaf's ``.grad`` it can
    reach (and the call's parameters') set aside and put back afterwards (the same tensors). Returns the
    gradients it computed for ``inputs`` (None where unused; the caller drops them once read)."""
    leaves, reentrant = graph_leaves(outs, start)
    if not reentrant:
        return list(torch.autograd.grad(outs, inputs, grad_outputs=grads, allow_unused=True))
    held = list({id(t): t for t in [*inputs, *leaves]}.values())
    saved = [t.grad for t in held]
    try:
        for t in held:
            t.grad = None
        torch.autograd.backward(outs, grads)
        made = {id(t): t.grad for t in held}
        return [made[id(t)] for t in inputs]
    finally:
        for t, g in zip(held, saved):
            t.grad = g


def graph_leaves(outs: list[torch.Tensor], start: int) -> tuple[list[torch.Tensor], bool]:
    """The leaf tensors a replayed graph accumulates into, and whether it holds a reentrant checkpoint."""
    leaves: list[torch.Tensor] = []
    reentrant, seen = False, {}  # (nodes held while walking: ids of freed objects are reused)
    stack = [t.grad_fn for t in outs]
    while stack:
        fn = stack.pop()
        if fn is None or id(fn) in seen:
            continue
        seen[id(fn)] = fn
        variable = getattr(fn, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
            continue
        if compat.node_sequence_nr(fn) < start:
            continue
        reentrant = reentrant or "CheckpointFunction" in fn.name()
        stack += [f for f, _ in fn.next_functions]
    return leaves, reentrant


def roots(pairs: list[tuple[torch.Tensor, Any]], start: int) -> list[tuple[torch.Tensor, Any]]:
    """The replayed outputs that no other output was computed from (a model returning ``(loss, logits)``:
    the loss; the gradient into the logits came through it), with their gradients."""
    if len(pairs) < 2:
        return pairs
    reached: dict[int, Any] = {}  # (held while walking: ids of freed objects are reused)
    for t, _ in pairs:
        stack = [f for f, _ in t.grad_fn.next_functions] if t.grad_fn is not None else []
        while stack:
            fn = stack.pop()
            if fn is None or id(fn) in reached:
                continue
            seq = compat.node_sequence_nr(fn)
            if seq == compat.NO_SEQUENCE or seq < start:
                continue
            reached[id(fn)] = fn
            stack += [f for f, _ in fn.next_functions]
    return [(t, g) for t, g in pairs if t.grad_fn is None or id(t.grad_fn) not in reached]


def dense_grads(params: "tuple[torch.Tensor, ...] | list[torch.Tensor]") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(parameter, its ``.grad``) where the ``.grad`` is a plain strided tensor (each ``.grad`` read once)."""
    pairs = []
    for p in params:
        g = p.grad
        if g is not None and type(g) is torch.Tensor and g.layout == _STRIDED:
            pairs.append((p, g))
    return pairs


def float_grads(params: "tuple[torch.Tensor, ...] | list[torch.Tensor]") -> list[torch.Tensor]:
    """The floating-point ones of :func:`_dense_grads`' gradients."""
    return [g for _, g in dense_grads(params) if g.is_floating_point()]


def detached(value: Any) -> Any:
    """The call's arguments, each float tensor that requires grad detached (a leaf of the replay's own
    graph: its backward never runs into the user's graph, whose buffers may be freed)."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_() if value.requires_grad and ops.checkable(value) else value
    if type(value) in (list, tuple):
        return type(value)(detached(v) for v in value)
    if type(value) is dict:
        return {k: detached(v) for k, v in value.items()}
    return value


def tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if type(value) in (list, tuple):
        return [t for v in value for t in tensors(v)]
    if type(value) is dict:
        return [t for v in value.values() for t in tensors(v)]
    return []


def _engine_run_backward(checks: Any, grad: torch.Tensor, new: torch.Tensor, node: Any) -> None:
    """A parameter's accumulation ``grad += new`` (already done: ``grad`` holds the non-finite sum; the
    old value was finite) judged as the always-on watch judges the ``add_`` the autograd engine ran in
    the parameter's ``AccumulateGrad``. Named as torch's engine entry on purpose: the walk for the
    user's own backward code (``core.events.user_backward_frame``) stops at this frame, as it stops
    for every op the engine runs; the line is then the one that called ``backward()``."""
    checks.examine(torch.ops.aten.add_.Tensor, (grad, new), {}, [grad], "backward", node,
                   torch.zeros((), dtype=grad.dtype), None)
