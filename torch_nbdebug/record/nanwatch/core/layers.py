"""Per-module forward activation and backward gradient statistics for the nanwatch table.

A reading of a module output (or of the gradient into it) is its min, max and sum: one ``aminmax``
and one ``sum`` (NaN/Inf propagate through both), the mean divided on the host, so every path shows
the same numbers. On CPU a reading is taken at once (reading a CPU scalar is no device
synchronisation). On CUDA (``deferred``) the three 0-d results wait on the device, with no further
kernel (no casts, no stacking per reading), and are stacked and read at the recorder's next flush,
together with everything else waiting there (one transfer), so the stream never stalls.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from torch_nbdebug.data.nanwatch import LayerStats
from torch_nbdebug.record.nanwatch.core.ops import HALF, checkable, read_together

_isfinite = math.isfinite


def first_float_tensor(value: Any) -> Optional[torch.Tensor]:
    """The tensor a module "returns" for statistics: itself, or the first float tensor of a tuple/dict."""
    if isinstance(value, torch.Tensor):
        return value if checkable(value) and value.numel() > 0 else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
    for item in items:
        if isinstance(item, torch.Tensor) and checkable(item) and item.numel() > 0:
            return item
    return None


def stat_parts(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """min, max and sum of ``t`` as 0-d tensors of one dtype, on t's device, not read: two full
    reductions (``aminmax(dim=0)`` is 4x slower on CPU; amin/amax allocate no extra device memory).
    Half types are summed in float32 (a sum of finite values must not overflow), their min/max cast to it."""
    x = t.detach()
    lo, hi = torch.aminmax(x)
    if x.dtype in HALF:
        total = x.sum(dtype=torch.float32)
        return lo.float(), hi.float(), total
    total = x.sum()
    if total.dtype != lo.dtype:  # float8 and other narrow types
        return lo.to(total.dtype), hi.to(total.dtype), total
    return lo, hi, total


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

    def take(self, values: list[float]) -> bool:
        """Store one reading; True when it is the first non-finite one."""
        self.last = values
        if self.bad is None and nonfinite_reading(values):
            self.bad = values
            return True
        return False


class _Row:
    __slots__ = ("calls", "fwd", "grad")

    def __init__(self, calls: int = 0) -> None:
        self.calls = calls
        self.fwd = _Side()
        self.grad = _Side()


class Later:
    """One deferred reading handed back: its ``[min, max, mean]`` once the flush has read it (None
    until then). The deferred module-mode check of the same output or gradient judges it from these
    (checks.deferred); other paths ask for none."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: Optional[list[float]] = None


_Waiting = tuple[_Side, int, Optional[Later]]  # a deferred reading: its side, numel, and the Later asked for


class _Batch:
    """Deferred readings stacked into one device tensor: the side, the element count and the
    :class:`Later` (if one was asked for) of each reading."""

    __slots__ = ("readings",)

    def __init__(self, readings: list[_Waiting]) -> None:
        self.readings = readings

    def apply(self, flat: list[float]) -> None:
        for i, (side, numel, later) in enumerate(self.readings):
            values = [flat[3 * i], flat[3 * i + 1], flat[3 * i + 2] / numel]
            side.take(values)
            if later is not None:
                later.values = values


Reading = tuple[_Batch, torch.Tensor]  # deferred readings and their parts stacked into one tensor (3 per reading)


class LayerRecorder:
    """Collects the per-module rows; ``deferred`` keeps readings on the device until :meth:`flush`."""

    def __init__(self, deferred: bool = False) -> None:
        self.deferred = deferred
        self._rows: dict[str, _Row] = {}
        # deferred: each reading's side, numel and Later, and its three 0-d parts (see stat_parts), in order made
        self._waiting: list[_Waiting] = []
        self._parts: list[torch.Tensor] = []

    @property
    def backlog(self) -> int:
        """Deferred readings waiting on the device."""
        return len(self._waiting)

    def seen(self) -> bool:
        """Whether any module ran."""
        return bool(self._rows)

    def enter(self, path: str) -> None:
        row = self._rows.get(path)
        if row is None:
            row = self._rows[path] = _Row()
        row.calls += 1

    def forward(self, path: str, t: torch.Tensor, later: Optional[Later] = None) -> Optional[list[float]]:
        """Record an output; returns ``[min, max, mean]`` now when not deferred (else None: the flush
        reads it, and hands the values to ``later`` too)."""
        return self._record(self._row(path).fwd, t, later)

    def gradient(self, path: str, t: torch.Tensor, later: Optional[Later] = None) -> Optional[list[float]]:
        return self._record(self._row(path).grad, t, later)

    def take_forward(self, path: str, values: list[float]) -> None:
        """Record readings already computed for the same tensor (a container's output)."""
        self._row(path).fwd.take(values)

    def take_finite_forward(self, path: str, values: list[float]) -> None:
        """:meth:`take_forward` of a reading known finite (the module layer's common exit): one frame."""
        row = self._rows.get(path)
        if row is None:
            row = self._rows[path] = _Row(calls=1)
        row.fwd.last = values

    def take_gradient(self, path: str, values: list[float]) -> None:
        self._row(path).grad.take(values)

    def _row(self, path: str) -> _Row:
        row = self._rows.get(path)
        if row is None:
            row = self._rows[path] = _Row(calls=1)
        return row

    def _record(self, side: _Side, t: torch.Tensor, later: Optional[Later]) -> Optional[list[float]]:
        if self.deferred:
            self._parts += stat_parts(t)
            self._waiting.append((side, t.numel(), later))
            return None
        values = stat_values(t)
        side.take(values)
        return values

    def take_pending(self) -> list[Reading]:
        """Hand over the deferred readings, stacked (one tensor per dtype and device; the caller reads
        them with whatever else waits on the device)."""
        if not self._waiting:
            return []
        parts, waiting = self._parts, self._waiting
        self._parts, self._waiting = [], []
        first = parts[0]
        if all(p.dtype == first.dtype and p.device == first.device for p in parts):
            return [(_Batch(waiting), torch.stack(parts))]
        groups: dict[tuple[torch.dtype, torch.device], tuple[list[_Waiting], list[torch.Tensor]]] = {}
        for i, reading in enumerate(waiting):
            p = parts[3 * i: 3 * i + 3]
            readings, tensors = groups.setdefault((p[0].dtype, p[0].device), ([], []))
            readings.append(reading)
            tensors += p
        return [(_Batch(readings), torch.stack(tensors)) for readings, tensors in groups.values()]

    def apply(self, taken: list[Reading], values: list[list[float]]) -> None:
        """Store the values read for :meth:`take_pending`'s readings (in the order they were made)."""
        for (batch, _), flat in zip(taken, values):
            batch.apply(flat)

    def flush(self) -> None:
        """Read every pending reading at once (one transfer per device)."""
        taken = self.take_pending()
        if taken:
            self.apply(taken, read_together([t for _, t in taken]))

    def rows(self, birth_modules: set[str]) -> tuple[LayerStats, ...]:
        self.flush()
        return tuple([_to_stats(path, row, path in birth_modules) for path, row in self._rows.items()])


def _to_stats(path: str, row: _Row, birth: bool) -> LayerStats:
    # (positional, no helper per side: this runs for every row at every watch's end)
    fwd, grad = row.fwd, row.grad
    fwd_shown = fwd.last if fwd.bad is None else fwd.bad
    grad_shown = grad.last if grad.bad is None else grad.bad
    return LayerStats(path, row.calls, *_nums(fwd_shown), None if fwd_shown is None else fwd.bad is None,
                      *_nums(grad_shown), None if grad_shown is None else grad.bad is None, birth)


_UNSEEN = (None, None, None)


def _nums(values: Optional[list[float]]) -> tuple[Optional[float], Optional[float], Optional[float]]:
    """``[min, max, mean]`` for the table; JSON (the widget's sync) has no NaN/Inf: a non-finite value
    is None there, and the row's finiteness flag says why."""
    if values is None:
        return _UNSEEN
    lo, hi, mean = values
    if _isfinite(lo) and _isfinite(hi) and _isfinite(mean):
        return lo, hi, mean
    return (lo if _isfinite(lo) else None, hi if _isfinite(hi) else None, mean if _isfinite(mean) else None)


def nonfinite_reading(values: Optional[list[float]]) -> bool:
    """A reading ``[min, max, mean]`` holds a NaN/Inf (None: not read yet, as on the deferred path)."""
    return values is not None and not (_isfinite(values[0]) and _isfinite(values[1]) and _isfinite(values[2]))
