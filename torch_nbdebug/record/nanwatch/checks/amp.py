"""Mixed precision: casts that overflow (float32 -> float16) and GradScaler's skipped steps."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

import torch

from torch_nbdebug.record.nanwatch.core import ops
from torch_nbdebug.record.nanwatch.core.rules import OpPhase
from torch_nbdebug.record.nanwatch.context import WatchContext
from torch_nbdebug.record.tensors import storage_key

if TYPE_CHECKING:  # pragma: no cover
    from torch_nbdebug.record.nanwatch.checks.deferred import DeferredChecks
    from torch_nbdebug.record.nanwatch.checks.immediate import ImmediateChecks


class AmpChecks:
    def __init__(self, ctx: WatchContext, immediate: "ImmediateChecks", deferred: Optional["DeferredChecks"]) -> None:
        self.ctx, self.immediate, self.deferred = ctx, immediate, deferred

    def scaler_checked(self, args: tuple) -> None:
        """GradScaler found inf/NaN gradients and will skip this step: that is how it calibrates the
        loss scale, so this iteration's backward births move to the absorbed list, with a note."""
        found = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
        if found is None:
            return
        # The gradients' queued checks are replayed first (read with the flag, in one transfer).
        skipped = bool(self.ctx.flush([found.sum()])[0][0])
        # The ops just before (the scaler's own) already counted as the next iteration: the
        # gradients belong to the last backward's iteration.
        self.ctx.log.scaler_skipped(max(1, self.ctx.clock.iteration - 1) if skipped else None)

    def _to_integers(self, src: torch.Tensor, out: Any) -> None:
        """A born NaN/Inf cast to integers or booleans (``x.long()``: T5's bucket of log(0)) is thrown away,
        as ``torch.where`` throws it away: the birth is listed as absorbed (immediate path; the deferred
        one keeps it a birth)."""
        log = self.ctx.log
        key = storage_key(src)
        if self.deferred is None and log.carries_birth(key) and isinstance(out, torch.Tensor) and \
                not out.is_floating_point() and not out.is_complex():
            log.cast_away(key)

    def check_cast(self, func: Any, args: tuple, out: Any, phase: OpPhase, node: Any, seq: Optional[int]) -> None:
        """A narrowing copy (float32 -> float16) can overflow: check it like an op reading the source."""
        src = ops.cast_source(func, args)
        outs = ops.float_outputs(out)
        if src is not None and not outs and self.ctx.log.tracking_births():
            self._to_integers(src, out)
            return
        if src is None or not outs or self.ctx.log.full() or not ops.narrows(src.dtype, outs[0].dtype):
            return
        if self.deferred is not None:
            self.deferred.queue_op(func, (src,), {}, outs, phase, node, None, seq)
            return
        bad = [t for t in outs if not math.isfinite(ops.sum_value(t))]
        if bad:
            self.immediate.examine(func, (src,), {}, bad, phase, node, None, seq)
