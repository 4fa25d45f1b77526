"""Backward births wait for their autograd node to finish before they count.

Some gradient formulas make 0/0 inside and mask it away before returning (the norm's gradient at
the zero vector does ``masked_fill_(norm == 0, 0)``): a birth inside a node is kept only when a
non-finite gradient leaves the node. A post hook on the node (handle-based, removed at stop)
decides; births of a node that never finished (the backward raised) are kept.

A mixin of :class:`~torch_nbdebug.record.nanwatch.NanRecorder`; it uses the recorder's state.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from torch_nbdebug.data.nanwatch import NanEvent
from torch_nbdebug.errors import NanBirthError
from torch_nbdebug.record import nanwatch_ops as ops

if TYPE_CHECKING:  # pragma: no cover
    from torch_nbdebug.record.nanwatch import NanRecorder


class HeldBackward:
    """Hold / confirm / commit backward births (methods typed with the recorder as self)."""

    def _hold(self: "NanRecorder", node: Any, event: NanEvent) -> None:
        """A backward birth counts only if it leaves its node: formulas such as the norm's gradient
        make 0/0 inside and mask it away (``masked_fill_``). A post hook on the node decides."""
        key = id(node)
        held = self._held.get(key)
        if held is None:
            self._held[key] = [event]
            self._grad_handles.append(node.register_hook(_NodeDone(self, key)))
        else:
            held.append(event)

    def node_done(self: "NanRecorder", key: int, grad_inputs: Any) -> None:
        """The node finished: keep its held births if a non-finite gradient left it."""
        held = self._held.pop(key, [])
        if not held:
            return
        with self.quiet():
            grads = [g for g in grad_inputs if isinstance(g, torch.Tensor) and ops.checkable(g)]
            leaves = not grads or any(ops.is_bad_value(ops.sum_value(g)) for g in grads)
        if leaves:
            for event in held:
                self.add_event(event, [])

    def commit_held(self: "NanRecorder") -> None:
        """Births of nodes that never finished (the backward raised): keep them, without raising."""
        held, self._held = self._held, {}
        raising, self.raise_on_birth = self.raise_on_birth, False
        try:
            for events in held.values():
                for event in events:
                    self.add_event(event, [])
        finally:
            self.raise_on_birth = raising


class _NodeDone:
    """Autograd node post hook: reads the gradients the node produced (returns None: unchanged)."""

    __slots__ = ("recorder", "key")

    def __init__(self, recorder: "NanRecorder", key: int) -> None:
        self.recorder, self.key = recorder, key

    def __call__(self, grad_inputs: Any, grad_outputs: Any) -> None:
        try:
            self.recorder.node_done(self.key, grad_inputs)
        except NanBirthError:
            raise
        except Exception as exc:  # noqa: BLE001 - see OpWatchMode
            self.recorder.internal_error("a backward node's gradients", exc)
