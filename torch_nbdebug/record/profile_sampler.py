"""Which statement of the user's is the main thread running: a light sampler, about once a millisecond.

A daemon thread wakes every ``interval`` seconds, reads the main thread's frame from
``sys._current_frames()`` and keeps the innermost frame of user code (a notebook cell or the user's
own file: :func:`torch_nbdebug.record.source.user_frame`), never a library frame, so the time of
``optimizer.step()`` goes to that line and the time of a slow ``Dataset.__getitem__`` to the line in
it (a comprehension's or generator expression's frame counts as the statement that runs it). Each
sample weighs the time since the sampler's previous look.

Pure Python holds the GIL for ``sys.getswitchinterval()`` (5 ms by default) before a waiting thread
gets it, and then the sampler would see the *next* statement, the one that released the GIL, and
give it the time of the Python before it. So while sampling, the switch interval is lowered to the
sampling interval (restored on stop): a fifth of it, so the sampler looks when it meant to, not
at the next statement that releases the GIL.

Frames are read and dropped at once (a frame keeps its locals alive). Nothing is installed in the
interpreter: no trace or profile function, so the user's code runs unchanged.
"""
from __future__ import annotations

import sys
import threading
import time
import types
from typing import Optional

from torch_nbdebug.record.source import user_frame

Position = tuple[str, int, str]   # (filename, lineno, function)
_INLINE = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"})


def statement(frame: types.FrameType) -> Optional[Position]:
    """The user's statement running in ``frame`` (or above it): a comprehension is its enclosing statement."""
    user = user_frame(frame)
    if user is None:
        return None
    while user.f_code.co_name in _INLINE and user.f_back is not None and \
            user.f_back.f_code.co_filename == user.f_code.co_filename:
        user = user.f_back
    return user.f_code.co_filename, user.f_lineno, user.f_code.co_name


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
        self._switch: Optional[float] = None

    def start(self) -> None:
        self._stop.clear()
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch, self.interval / 5))
        self._thread = threading.Thread(target=self._run, name="torch_nbdebug-profile-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop and wait for the thread (it finishes its current look, well under a millisecond)."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        switch, self._switch = self._switch, None
        if switch is not None:
            sys.setswitchinterval(switch)

    def _run(self) -> None:
        wait, target, clock = self._stop.wait, self._target, time.perf_counter_ns
        last = clock()
        while not wait(self.interval):
            frame = sys._current_frames().get(target)
            position = statement(frame) if frame is not None else None
            del frame
            now = clock()
            if position is not None:
                index = self._index.get(position)
                if index is None:
                    index = self._index[position] = len(self.positions)
                    self.positions.append(position)
                self.samples.append((now, index, now - last))
            last = now
