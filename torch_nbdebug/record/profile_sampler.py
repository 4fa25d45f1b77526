"""Which statement of the user's is the main thread running: a light sampler, about once a millisecond.

A daemon thread wakes every ``interval`` seconds, reads the main thread's frame from
``sys._current_frames()`` and keeps the innermost frame of user code (a notebook cell or the user's
own file: :func:`torch_nbdebug.record.source.user_position`), never a library frame, so the time of
``optimizer.step()`` goes to that line and the time of a slow ``Dataset.__getitem__`` to the line in
it. Each sample weighs the time since the sampler's previous look: the main thread may hold the GIL
for longer than the interval (pure Python runs for up to ``sys.getswitchinterval()`` before it lets
the sampler in), and those milliseconds still count, for the line seen when they end.

Frames are read and dropped at once (a frame keeps its locals alive). Nothing is installed in the
interpreter: no trace or profile function, so the user's code runs unchanged.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Optional

from torch_nbdebug.record.source import user_position

Position = tuple[str, int, str]   # (filename, lineno, function)


class LineSampler:
    """``start()`` / ``stop()``; then ``samples`` holds ``(perf_counter_ns, position index, weight ns)``
    and ``positions`` the distinct positions, in the order they were first seen."""

    def __init__(self, interval: float = 0.001, thread: Optional[int] = None) -> None:
        self.interval = interval
        self._target = thread if thread is not None else threading.get_ident()
        self.samples: list[tuple[int, int, int]] = []
        self.positions: list[Position] = []
        self._index: dict[Position, int] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="torch_nbdebug-profile-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop and wait for the thread (it finishes its current look, well under a millisecond)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        wait, target, clock = self._stop.wait, self._target, time.perf_counter_ns
        last = clock()
        while not wait(self.interval):
            frame = sys._current_frames().get(target)
            position = user_position(frame) if frame is not None else None
            del frame
            now = clock()
            if position is not None:
                index = self._index.get(position)
                if index is None:
                    index = self._index[position] = len(self.positions)
                    self.positions.append(position)
                self.samples.append((now, index, now - last))
            last = now
