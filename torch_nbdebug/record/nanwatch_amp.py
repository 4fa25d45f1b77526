"""Mixed precision: casts that overflow (float32 -> float16) and GradScaler's skipped steps.

A mixin of :class:`~torch_nbdebug.record.nanwatch.NanRecorder`; it uses the recorder's state.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from torch_nbdebug.record import nanwatch_deferred as deferred
from torch_nbdebug.record import nanwatch_ops as ops

if TYPE_CHECKING:  # pragma: no cover
    from torch_nbdebug.record.nanwatch import NanRecorder

SCALER_SKIPPED = "GradScaler found this non-finite gradient and skipped the optimizer step"


class AmpChecks:
    """Cast and GradScaler callbacks of the recorder (methods typed with the recorder as self)."""

    def _scaler_checked(self: "NanRecorder", args: tuple) -> None:
        """GradScaler found inf/NaN gradients and will skip this step: that is how it calibrates the
        loss scale, so this iteration's backward births move to the absorbed list, with a note."""
        found = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
        if found is None:
            return
        self.flush()
        start, self._scaler_mark = self._scaler_mark, len(self.events)
        if not float(found.sum().item()):
            return
        # The ops just before (the scaler's own) already counted as the next iteration: the
        # gradients belong to the last backward's iteration.
        self.scaler_skips.add(max(1, self.iteration - 1))
        for i in range(start, len(self.events)):
            event = self.events[i]
            if event.phase == "backward" and i not in self.absorbed:
                self.events[i] = dataclasses.replace(event, detail=SCALER_SKIPPED)
                self.absorbed.add(i)

    def _check_cast(self: "NanRecorder", func: Any, args: tuple, out: Any, phase: str, node: Any) -> None:
        """A narrowing copy (float32 -> float16) can overflow: check it like an op reading the source."""
        src = ops.cast_source(func, args)
        outs = ops.float_outputs(out)
        if src is None or not outs or len(self.events) >= self.max_events or not ops.narrows(src.dtype, outs[0].dtype):
            return
        self.ops_checked += 1
        if self.layers.deferred:
            deferred.queue_op(self, func, (src,), {}, outs, phase, node)
            return
        bad = [t for t in outs if ops.is_bad_value(ops.sum_value(t))]
        if bad:
            self._examine(func, (src,), {}, bad, phase, node)
