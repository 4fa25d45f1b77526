"""Which statement of the user's is the main thread running: a light sampler, about once a millisecond.

Each look takes the innermost frame of user code (a notebook cell or the user's own file:
:func:`torch_nbdebug.record.source.user_frame`), never a library frame, so the time of
``optimizer.step()`` goes to that line and the time of a slow ``Dataset.__getitem__`` to the line in
it (a comprehension's or generator expression's frame counts as the statement that runs it). Each
sample weighs the wall time since the previous look. Frames are read and dropped at once (a frame
keeps its locals alive); no trace or profile function is installed.

Two ways to look, the first that this process allows:

- **a timer signal** (Linux): a POSIX timer on the monotonic clock sends ``SIGPROF`` to the main thread
  every ``interval``; Python runs our handler in the main thread at its next bytecode, with the frame
  it was running. A long torch op (GIL held or not) delays the look until it returns, so its time goes
  to the statement that called it, and a ``time.sleep`` or a blocking read is interrupted and looked at
  right away. Taken only when nobody else uses ``SIGPROF``; syscalls are restarted (``SA_RESTART``).
- **a thread** otherwise: it reads the main thread's frame from ``sys._current_frames()``. It needs the
  GIL, and gets it soonest where the main thread releases it (in a torch op), so on a busy machine its
  looks gather there and credit the Python before them to that statement. While it runs the GIL
  switch interval is lowered (restored on stop) to narrow that.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import signal
import sys
import threading
import time
import types
from typing import Any, Optional

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


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class _Sigevent(ctypes.Structure):  # glibc's struct sigevent (64 bytes); the thread id opens its union
    _fields_ = [("sigev_value", ctypes.c_void_p), ("sigev_signo", ctypes.c_int), ("sigev_notify", ctypes.c_int),
                ("sigev_tid", ctypes.c_int), ("_pad", ctypes.c_int * 11)]


_CLOCK_MONOTONIC, _SIGEV_THREAD_ID = 1, 4


_LIBRARY: list[Any] = []


def _libc() -> Any:
    """The C library with ``timer_create`` (glibc 2.34+ has it, older ones in librt), found once:
    ``find_library`` runs a subprocess, which would be in the first profiled step's time."""
    if not _LIBRARY:
        libc = ctypes.CDLL(None, use_errno=True)  # what this process already links: glibc
        if getattr(libc, "timer_create", None) is None:
            libc = ctypes.CDLL(ctypes.util.find_library("rt"), use_errno=True)
        _LIBRARY.append(libc)
    return _LIBRARY[0]


class SignalTimer:
    """A POSIX timer sending ``SIGPROF`` to this thread every ``interval`` seconds (Linux, glibc), or
    None from :meth:`create` where there is none."""

    def __init__(self, libc: Any, timer: ctypes.c_void_p) -> None:
        self._libc = libc
        self._timer: Optional[ctypes.c_void_p] = timer

    @classmethod
    def create(cls, interval: float) -> Optional["SignalTimer"]:
        if not sys.platform.startswith("linux") or not hasattr(threading, "get_native_id"):
            return None
        try:
            libc = _libc()
            event = _Sigevent(None, int(signal.SIGPROF), _SIGEV_THREAD_ID, threading.get_native_id())
            timer = ctypes.c_void_p()
            if libc.timer_create(_CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
                return None
        except (OSError, AttributeError, TypeError):
            return None
        made = cls(libc, timer)
        seconds, fraction = divmod(interval, 1.0)
        tick = _Timespec(int(seconds), int(fraction * 1e9))
        if libc.timer_settime(timer, 0, ctypes.byref(_Itimerspec(tick, tick)), None) != 0:
            made.delete()
            return None
        return made

    def delete(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            self._libc.timer_delete(timer)


class LineSampler:
    """``start()`` / ``stop()``; then ``samples`` holds ``(perf_counter_ns, position index, weight ns)``
    and ``positions`` the distinct positions, in the order they were first seen. ``mode`` is how it looks:
    "signal", "thread", or "auto" (the signal where it can)."""

    def __init__(self, interval: float = 0.001, thread: Optional[int] = None, mode: str = "auto") -> None:
        self.interval = interval
        self.mode = mode
        self._target = thread if thread is not None else threading.get_ident()
        self.samples: list[tuple[int, int, int]] = []
        self.positions: list[Position] = []
        self._index: dict[Position, int] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._switch: Optional[float] = None
        self._timer: Optional[SignalTimer] = None
        self._previous: Any = None
        self._last = 0

    def start(self) -> None:
        if self.mode != "thread" and self._start_signal():
            self.mode = "signal"
            return
        self.mode = "thread"
        self._start_thread()

    def _start_signal(self) -> bool:
        """The timer signal, when this is the main thread and ``SIGPROF`` is nobody's."""
        if threading.current_thread() is not threading.main_thread() or self._target != threading.get_ident():
            return False
        if signal.getsignal(signal.SIGPROF) not in (signal.SIG_DFL, None) or signal.getitimer(signal.ITIMER_PROF) != (0.0, 0.0):
            return False
        self._last = time.perf_counter_ns()
        self._previous = signal.signal(signal.SIGPROF, self._on_signal)
        signal.siginterrupt(signal.SIGPROF, False)  # SA_RESTART: a tick never fails a syscall
        self._timer = SignalTimer.create(self.interval)
        if self._timer is None:
            signal.signal(signal.SIGPROF, self._previous)
            self._previous = None
            return False
        return True

    def _on_signal(self, signum: int, frame: Optional[types.FrameType]) -> None:
        now = time.perf_counter_ns()
        position = statement(frame) if frame is not None else None
        del frame
        self._keep(now, position, self._last)
        self._last = now

    def _keep(self, now: int, position: Optional[Position], last: int) -> None:
        if position is not None:
            index = self._index.get(position)
            if index is None:
                index = self._index[position] = len(self.positions)
                self.positions.append(position)
            self.samples.append((now, index, now - last))

    def _start_thread(self) -> None:
        self._stop.clear()
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch, self.interval / 5))
        self._thread = threading.Thread(target=self._run, name="torch_nbdebug-profile-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the timer and put the signal back, or stop the thread and wait for it (it finishes its
        current look, well under a millisecond)."""
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.delete()
            previous, self._previous = self._previous, None
            signal.signal(signal.SIGPROF, previous if previous is not None else signal.SIG_DFL)
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
            self._keep(now, position, last)
            last = now
