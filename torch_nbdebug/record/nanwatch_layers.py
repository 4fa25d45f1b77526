"""Per-module forward activation and backward gradient statistics for the nanwatch table.

At each module exit: one ``aminmax`` and one sum of the output (NaN propagates through both),
kept as a 3-element tensor. On CPU it is read at once (no device sync exists there); on CUDA the
small tensors wait in a list and are read at the recorder's next flush, together with everything
else waiting on the device (one transfer), so the stream never stalls.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from torch_nbdebug.data.nanwatch import LayerStats
from torch_nbdebug.record.nanwatch_ops import HALF, checkable, read_together

Reading = tuple["_Side", torch.Tensor]  # a deferred reading and the row side it belongs to


def first_float_tensor(value: Any) -> Optional[torch.Tensor]:
    """The tensor a module "returns" for statistics: itself, or the first float tensor of a tuple/dict."""
    if isinstance(value, torch.Tensor):
        return value if checkable(value) and value.numel() > 0 else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    for item in items:
        if isinstance(item, torch.Tensor) and checkable(item) and item.numel() > 0:
            return item
    return None


def stat_vector(t: torch.Tensor) -> torch.Tensor:
    """``[min, max, mean]`` in float32 (still on t's device); NaN/Inf propagate into it."""
    x = t.detach()
    lo, hi = torch.aminmax(x)
    total = x.sum(dtype=torch.float32) if x.dtype in HALF else x.sum()
    return torch.stack([lo.float(), hi.float(), total.float() / x.numel()])


def stat_values(t: torch.Tensor) -> list[float]:
    """``[min, max, mean]`` read at once (CPU: reading a scalar is no device synchronisation)."""
    x = t.detach()
    lo, hi = torch.aminmax(x)
    total = x.sum(dtype=torch.float32) if x.dtype in HALF else x.sum()
    return [lo.item(), hi.item(), total.item() / x.numel()]


@dataclass
class _Side:
    last: Optional[list[float]] = None
    bad: Optional[list[float]] = None
    pending: list[torch.Tensor] = field(default_factory=list)

    def take(self, values: list[float]) -> bool:
        """Store one reading; True when it is the first non-finite one."""
        self.last = values
        finite = all(math.isfinite(v) for v in values)
        if not finite and self.bad is None:
            self.bad = values
            return True
        return False

    def shown(self) -> Optional[list[float]]:
        return self.bad if self.bad is not None else self.last


@dataclass
class _Row:
    calls: int = 0
    fwd: _Side = field(default_factory=_Side)
    grad: _Side = field(default_factory=_Side)


class LayerRecorder:
    """Collects the per-module rows; ``deferred`` keeps readings on the device until :meth:`flush`."""

    def __init__(self, deferred: bool = False) -> None:
        self.deferred = deferred
        self._rows: dict[str, _Row] = {}
        self.backlog = 0  # deferred readings waiting on the device

    def seen(self) -> bool:
        """Whether any module ran."""
        return bool(self._rows)

    def enter(self, path: str) -> None:
        row = self._rows.get(path)
        if row is None:
            row = self._rows[path] = _Row()
        row.calls += 1

    def forward(self, path: str, t: torch.Tensor) -> Optional[list[float]]:
        """Record an output; returns ``[min, max, mean]`` now when not deferred (else None)."""
        return self._record(self._row(path).fwd, t)

    def gradient(self, path: str, t: torch.Tensor) -> Optional[list[float]]:
        return self._record(self._row(path).grad, t)

    def take_forward(self, path: str, values: list[float]) -> None:
        """Record readings already computed for the same tensor (a container's output)."""
        self._row(path).fwd.take(values)

    def take_gradient(self, path: str, values: list[float]) -> None:
        self._row(path).grad.take(values)

    def _row(self, path: str) -> _Row:
        row = self._rows.get(path)
        if row is None:
            row = self._rows[path] = _Row(calls=1)
        return row

    def _record(self, side: _Side, t: torch.Tensor) -> Optional[list[float]]:
        if self.deferred:
            side.pending.append(stat_vector(t))
            self.backlog += 1
            return None
        values = stat_values(t)
        side.take(values)
        return values

    def take_pending(self) -> list[Reading]:
        """Hand over the deferred readings in the order they were made (the caller reads them)."""
        taken: list[Reading] = []
        if self.backlog:
            for row in self._rows.values():
                for side in (row.fwd, row.grad):
                    taken += [(side, t) for t in side.pending]
                    side.pending.clear()
            self.backlog = 0
        return taken

    def apply(self, taken: list[Reading], values: list[list[float]]) -> None:
        """Store the values read for :meth:`take_pending`'s readings."""
        for (side, _), reading in zip(taken, values):
            side.take(reading)

    def flush(self) -> None:
        """Read every pending reading at once (one transfer per device)."""
        taken = self.take_pending()
        if taken:
            self.apply(taken, read_together([t for _, t in taken]))

    def rows(self, birth_modules: set[str]) -> tuple[LayerStats, ...]:
        self.flush()
        return tuple(_to_stats(path, row, path in birth_modules) for path, row in self._rows.items())

    def clear(self) -> None:
        self._rows.clear()


def _to_stats(path: str, row: _Row, birth: bool) -> LayerStats:
    fwd, grad = row.fwd.shown(), row.grad.shown()
    return LayerStats(
        module=path, calls=row.calls,
        fwd_min=_num(fwd, 0), fwd_max=_num(fwd, 1), fwd_mean=_num(fwd, 2),
        fwd_finite=None if fwd is None else row.fwd.bad is None,
        grad_min=_num(grad, 0), grad_max=_num(grad, 1), grad_mean=_num(grad, 2),
        grad_finite=None if grad is None else row.grad.bad is None,
        birth=birth,
    )


def _num(values: Optional[list[float]], i: int) -> Optional[float]:
    if values is None:
        return None
    v = values[i]
    # JSON (the widget's sync) has no NaN/Inf: keep them as strings-free floats via None + flags.
    return v if math.isfinite(v) else None
