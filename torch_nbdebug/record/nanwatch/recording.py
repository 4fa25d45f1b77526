"""What a watch recorded, handed over once by :meth:`NanRecorder.stop` (pyinstrument's ``Session``): plain
data, no tensor and nothing of the user's; ``api/nanwatch.py`` builds the report from it alone."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from torch_nbdebug.data.nanwatch import LayerStats, NanEvent
from torch_nbdebug.record.nanwatch.context import WatchOptions


@dataclass(frozen=True)
class NanRecording:
    """``events`` in the order they happened, ``absorbed`` the indices among them of births thrown away
    (where/masked_fill, a GradScaler skip); ``full``: the log reached ``options.max_events``; ``dropped``:
    events left out past it; ``notes``: the replay's notes, then checks that failed (internal errors)."""

    options: WatchOptions
    events: tuple[NanEvent, ...] = ()
    absorbed: frozenset[int] = frozenset()
    layers: tuple[LayerStats, ...] = ()
    ops_seen: int = 0
    ops_checked: int = 0
    dropped: int = 0
    full: bool = False
    scaler_skips: tuple[int, ...] = ()
    saw_torch: bool = False
    other_thread: bool = False
    notes: tuple[str, ...] = ()
    # (iteration, optimizer steps completed before it) at each iteration that began after a step; () when
    # optimizer steps were not watched (then a birth's step is its iteration's, from 0)
    step_starts: tuple[tuple[int, int], ...] = ()

    def steps_before(self, iteration: int) -> Optional[int]:
        """Optimizer steps completed before ``iteration`` began, or None when steps were not counted."""
        best: Optional[int] = None
        for start, steps in self.step_starts:
            if start > iteration:
                break
            best = steps
        return best
