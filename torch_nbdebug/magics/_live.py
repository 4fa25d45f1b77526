"""What each recording magic shows while its cell runs: the ``progress()`` callables of the live views.

Each reads its recorder only when an update is due (see ``render/live.py``): nanwatch's event log (host
side: flags still on the device are not read), the gradient recorder's per-layer norms (its rows still
on the device copied in one transfer), the memory recorder's live bytes by category (host bookkeeping).
The recorder is reached through the API object's ``_recorder``, read at each update: once the block has
ended it is gone, and so is anything it held.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from torch_nbdebug.data.memory import CATEGORIES, CATEGORY_LABELS
from torch_nbdebug.render import live as live_views
from torch_nbdebug.render.live import MAX_POINTS, LinesPanel, Progress, RateLimiter, Series, StackPanel, TablePanel

MAX_ROWS = 10     # births listed in the live table (the final report lists them all)
MAX_LAYERS = 12   # layer curves sent besides the whole model's (spread over the model's depth)
_PHASE = {"forward": "forward", "backward": "backward", "optimizer": "optimizer step", "input": "input data"}


def _recorder(owner: Any) -> Any:
    return getattr(owner, "_recorder", None)


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _spread(count: int, limit: int) -> list[int]:
    """At most ``limit`` indices of ``range(count)``, evenly spread, first and last included."""
    if count <= limit:
        return list(range(count))
    return sorted({round(i * (count - 1) / (limit - 1)) for i in range(limit)})


def _finite(values: np.ndarray) -> list[Optional[float]]:
    return [float(v) if math.isfinite(v) else None for v in values]


class _RecorderProgress:
    """A live view's progress over an API object's recorder, read at each update: empty once the
    block has ended (the recorder is gone)."""

    def __init__(self, owner: Any) -> None:
        self._owner = owner

    def __call__(self) -> Progress:
        rec = _recorder(self._owner)
        return Progress(status="") if rec is None else self._read(rec)

    def _read(self, rec: Any) -> Progress:
        raise NotImplementedError


class NanwatchProgress(_RecorderProgress):
    """Births so far (how many, and where: phase, op, module, line) and the ops checked."""

    def _read(self, rec: Any) -> Progress:
        events = rec.log.events[:MAX_ROWS]
        count = len(rec.log.events) + rec.log.dropped
        if not count:
            return Progress(status=f"no NaN/Inf born yet ({_plural(rec.ops_checked, 'op')} checked)", panels=[])
        rows = [[str(i + 1), _PHASE.get(e.phase, e.phase), str(e.iteration), "NaN" if e.kind == "nan" else "Inf",
                 e.op, e.module or e.param or "", "" if e.lineno is None else str(e.lineno)]
                for i, e in enumerate(events)]
        table = TablePanel(kind="table", title="Births so far" + (f" (first {MAX_ROWS})" if count > MAX_ROWS else ""),
                           columns=["#", "phase", "iteration", "kind", "op", "module / parameter", "line"], rows=rows)
        return Progress(status=f"{_plural(count, 'NaN/Inf birth')} so far", alert=True, panels=[table])


class GradsProgress(_RecorderProgress):
    """The gradient norm of the whole model and of up to ``MAX_LAYERS`` layers over the steps so far."""

    def __init__(self, recording: Any) -> None:
        super().__init__(recording)
        self._kind: Optional[str] = None
        self._steps: list[int] = []
        self._norms: list[np.ndarray] = []
        self._names: tuple[str, ...] = ()

    def _read(self, rec: Any) -> Progress:
        since = len(self._steps)
        kind, steps, norms, names = rec.progress(since)
        if kind != self._kind:  # the first optimizer step restarts the rows (backward-only rows dropped)
            self._kind, self._steps, self._norms = kind, [], []
            if since:
                kind, steps, norms, names = rec.progress(0)
        self._names = names
        self._steps.extend(steps)
        self._norms.extend(norms)
        if not self._steps:
            return Progress(status="no gradients yet", panels=[])
        return self._view()

    def _view(self) -> Progress:
        keep = _spread(len(self._steps), MAX_POINTS)
        norms = np.asarray([self._norms[k] for k in keep])  # [S, L]
        total = np.sqrt(np.nansum(norms ** 2, axis=1))
        total[np.isnan(norms).all(axis=1)] = np.nan
        total[~np.isfinite(norms).all(axis=1) & ~np.isnan(norms).all(axis=1)] = np.inf
        series = [Series(name="whole model", y=_finite(total))]
        series += [Series(name=self._names[li], y=_finite(norms[:, li])) for li in _spread(len(self._names), MAX_LAYERS)]
        panel = LinesPanel(kind="lines", title="Gradient norm per layer", x=[self._steps[k] for k in keep],
                           xlabel=f"{self._kind} step", series=series, log=True)
        last = float(total[-1])
        where = f"{self._kind} step {self._steps[-1]}"
        if not math.isfinite(last):
            return Progress(status=f"non-finite gradient norm at {where}", alert=True, panels=[panel])
        return Progress(status=f"gradient norm {last:.3g} at {where}", panels=[panel])


class MemoryProgress(_RecorderProgress):
    """Bytes alive by category, sampled at each update (time in seconds since the recording started),
    and the model calls so far. Updates come at optimizer steps and at top-level forward calls, so a
    forward-only loop (evaluation) is shown while it runs too (see :meth:`follow_forward`)."""

    def __init__(self, scope: Any) -> None:
        super().__init__(scope)
        self._times: list[float] = []
        self._bytes: list[tuple[int, ...]] = []
        self._peak = 0

    def _read(self, rec: Any) -> Progress:
        seconds, totals = rec.progress()
        self._times.append(round(seconds, 3))
        self._bytes.append(totals)
        self._peak = max(self._peak, sum(totals))
        if len(self._times) > MAX_POINTS:  # keep every other sample: bounded however long the cell runs
            self._times, self._bytes = self._times[::2], self._bytes[::2]
        series = [Series(name=CATEGORY_LABELS.get(c, c), y=[float(b[i]) for b in self._bytes])
                  for i, c in enumerate(CATEGORIES)]
        panel = StackPanel(kind="stack", title="Memory by category", x=list(self._times), xlabel="seconds",
                           series=series, unit="bytes")
        calls = getattr(rec, "forward_calls", 0)
        return Progress(status=f"{_size(sum(totals))} alive now (highest sampled: {_size(self._peak)}); "
                               f"{_plural(calls, 'forward call')} so far", panels=[panel])

    def follow_forward(self, live: Any) -> None:
        """Update ``live`` at the recorder's top-level forward calls when an update is due (a forward-only
        loop makes no optimizer step to tick it). Call once recording has started."""
        rec = _recorder(self._owner)
        if rec is None or not getattr(live, "active", False):
            return
        limiter = RateLimiter(live_views.DEFAULT_INTERVAL)  # read now: the live display's own interval
        rec.on_forward = lambda: live.update() if limiter.due() else None


class ProfileProgress(_RecorderProgress):
    """How far the profiling is: optimizer steps seen, the warm-up, and whether the profiler still runs."""

    def _read(self, rec: Any) -> Progress:
        seen, warmup, steps = rec.stepped, rec.warmup, rec.steps
        if not rec.profiling:
            return Progress(status=f"{_plural(seen, 'optimizer step')} so far: profiling done, the cell runs on "
                                   f"at full speed; the report comes when it ends", panels=[])
        if seen < warmup:
            return Progress(status=f"warm-up: {seen} of {_plural(warmup, 'step')}", panels=[])
        of = f" of {steps}" if steps is not None else ""
        return Progress(status=f"profiling: {seen - warmup}{of} steps after {_plural(warmup, 'warm-up step')}",
                        panels=[])


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"
