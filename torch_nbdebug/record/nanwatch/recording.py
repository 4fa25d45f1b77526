"""What a watch recorded, handed over once by :meth:`NanRecorder.stop` (pyinstrument's ``Session``): plain
data, no tensor and nothing of the user's; ``api/nanwatch.py`` builds the report from it alone."""
from __future__ import annotations

from dataclasses import dataclass

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
