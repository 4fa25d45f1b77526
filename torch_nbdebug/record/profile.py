"""Profile the steps a cell runs: torch.profiler (Kineto) for the ops, our module ranges, the user's lines.

What is installed while the block runs, all removed on exit (also on Stop or an error):

- ``torch.profiler.profile`` with CPU activities, and CUDA ones when a device is there (no shapes, no
  stacks: the summary does not need them, and they are what makes the profiler dear; ``tidy=True``
  records both, for TorchTidy's anti-patterns);
- global module forward hooks that open a ``record_function`` range per module call, named
  ``module: model.fc`` after the user's variable (``with_modules`` only works for TorchScript); inside
  compiled code they do nothing, so a ``torch.compile``'d model stays compiled and shows as one range;
- torch's global optimizer step hooks: the first optimizer that steps is the clock, each of its steps
  ends a profiling step; after ``warmup + steps`` of them the profiler stops at the next top-level
  module call (never inside a range) and the cell runs on unprofiled;
- :class:`~torch_nbdebug.record.profile_sampler.LineSampler`, a thread that names the user's statement.

:meth:`ProfileRecorder.finish` reduces the profiler's events to a :class:`~torch_nbdebug.data.profile.Capture`
(plain tuples on the profiler's clock, the sampler's times moved onto it through a marker range), read
from the raw Kineto events (torch's own ``FunctionEvent`` tree would cost more than the profiling), and
drops the profiler unless the trace is to be kept.
"""
from __future__ import annotations

import contextlib
import linecache
import os
import sys
import time
import weakref
from typing import Any, Iterator, Mapping, Optional

import torch
from torch.autograd.profiler import record_function
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from torch_nbdebug.data.profile import Capture, Event, Pattern, Sample, Status
from torch_nbdebug.errors import InputError
from torch_nbdebug.record import compat
from torch_nbdebug.record.lifecycle import HookScope
from torch_nbdebug.record.modules import ModuleNamer
from torch_nbdebug.record.profile_sampler import LineSampler
from torch_nbdebug.record.source import line_of, skipped_note

MODULE_PREFIX = "module: "
_CLOCK = "torch_nbdebug: clock"


class ModuleRanges:
    """A ``record_function`` range around every module's forward, named by the user's path."""

    def __init__(self, namespace: Optional[Mapping[str, Any]], on_top: Any) -> None:
        self.namer = ModuleNamer(namespace)
        self.active = True
        self._on_top = on_top          # called before a top-level module call (the recorder's safe point)
        self._stack: list[tuple[str, Any]] = []

    def install(self, scope: HookScope) -> None:
        """The global module hooks (and torch's warning about them, held while they are on), taken off by
        ``scope``; what a Stop inside a forward left open is closed after them."""
        compat.global_hook_warning.acquire()
        scope.callback(compat.global_hook_warning.release)
        scope.callback(self._close_open)
        scope.hook(register_module_forward_pre_hook(self._pre))
        scope.hook(register_module_forward_hook(self._post, always_call=True))

    def _close_open(self) -> None:
        while self._stack:  # a Stop inside a forward: close what it left open
            _, rf = self._stack.pop()
            if rf is not None:
                rf.__exit__(None, None, None)
        self.namer.clear()

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            return  # traced into the compiled graph as nothing: the model stays compiled
        if not self._stack:
            self._on_top()
        if not self.active:
            self._stack.append(("", None))
            return
        path = self.namer.name(module, self._stack[-1][0] or None if self._stack else None)
        rf = record_function(MODULE_PREFIX + path)
        rf.__enter__()
        self._stack.append((path, rf))

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if torch.compiler.is_compiling() or not self._stack:
            return
        _, rf = self._stack.pop()
        if rf is not None:
            rf.__exit__(None, None, None)


class ProfileRecorder:
    """Context manager around the profiled code; :meth:`finish` returns the :class:`Capture`."""

    def __init__(self, namespace: Optional[Mapping[str, Any]] = None, *, steps: Optional[int] = 20,
                 warmup: int = 1, interval: float = 0.001, keep_trace: bool = False, tidy: bool = False) -> None:
        self.steps, self.warmup, self.keep_trace, self.tidy = steps, warmup, keep_trace, tidy
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.profiler: Any = None
        self.notes: list[str] = []
        self._namespace = namespace
        self._sampler = LineSampler(interval)
        self._ranges: Optional[ModuleRanges] = None
        self._scope = HookScope()
        self._clock_opt: Optional[weakref.ref[Any]] = None
        self._marks: list[int] = []        # perf_counter_ns at each clock step's end
        self._stepped = 0
        self._started = 0
        self._stop_due = False
        self._running = False
        self._offset_ns = 0                # perf_counter_ns minus the profiler's clock (in ns)
        self._start_ns = self._end_ns = 0

    @property
    def stepped(self) -> int:
        """Optimizer steps of the clock optimizer so far, the one running included (the live view reads it
        from its own step hook, which may run before ours)."""
        return self._started

    @property
    def profiling(self) -> bool:
        """Whether the profiler still runs (it stops after ``warmup + steps`` steps)."""
        return self._running and not self._stop_due

    # -- install / remove -------------------------------------------------------------------
    def __enter__(self) -> "ProfileRecorder":
        self._scope.open(self._install)
        return self

    def _install(self, scope: HookScope) -> None:
        scope.callback(self._release)  # (last: also when the profiler could not start)
        scope.callback(self._stop_profiler)
        self._start_profiler()
        scope.hook(register_optimizer_step_pre_hook(self._pre_step))
        scope.hook(register_optimizer_step_post_hook(self._post_step))
        self._ranges = ModuleRanges(self._namespace, self._at_top)
        self._ranges.install(scope)
        scope.callback(self._sampler.stop)
        self._sampler.start()
        self._mark_start()

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def _start_profiler(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device == "cuda" else [])
        if compat.profiler_running():
            raise InputError("another torch.profiler is already running: end its `with` block (or call its "
                             "stop()) first; one profiler runs at a time")
        prof = profile(activities=activities, record_shapes=self.tidy, with_stack=self.tidy)
        with quiet_stderr():
            prof.start()
        self.profiler, self._running = prof, True

    def _mark_start(self) -> None:
        """The profiled time starts here, once everything is installed: a marker range whose start on
        the profiler's clock is ``_start_ns`` on ours (the two clocks are tied through it)."""
        before = time.perf_counter_ns()
        with record_function(_CLOCK):
            pass
        self._start_ns = before

    def _stop_profiler(self) -> None:
        if not self._running:
            return
        self._running = False
        self._end_ns = self._end_ns or time.perf_counter_ns()
        self._sampler.stop()
        if self._ranges is not None:
            self._ranges.active = False
        with quiet_stderr():
            self.profiler.stop()

    def remove(self) -> None:
        """Take everything off (a Stop meanwhile is raised once all of it is); safe to call again."""
        if self._running and not self._end_ns:
            self._end_ns = time.perf_counter_ns()  # the profiled time ends here, before our clean-up
        self._scope.close()

    def _release(self) -> None:
        """Drop the namespace (a twin's is the caller's frame: it would keep its locals alive), saying
        first what in it could not be inspected while naming modules."""
        namespace, self._namespace = self._namespace, None
        skipped = getattr(namespace, "skipped", ())
        if skipped:
            self.notes.append(skipped_note(skipped))
        release = getattr(namespace, "release", None)
        if callable(release):
            release()

    # -- hooks -------------------------------------------------------------------------------
    def _at_top(self) -> None:
        if self._stop_due and self._running:
            self._stop_profiler()

    def _is_clock(self, opt: Any) -> bool:
        """The first optimizer that steps is the clock: its steps are the profiled steps."""
        if self._clock_opt is None:
            self._clock_opt = weakref.ref(opt)  # no callback: see record/interrupts.py
        return self._clock_opt() is opt

    def _pre_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self._is_clock(opt):
            self._started += 1

    def _post_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        if not self._is_clock(opt):
            return
        self._stepped += 1
        if self._running:
            self._marks.append(time.perf_counter_ns())
            if self.steps is not None and self._stepped >= self.warmup + self.steps:
                self._stop_due = True

    # -- the capture -------------------------------------------------------------------------
    def finish(self, status: Status) -> Capture:
        self.remove()
        prof = self.profiler
        events, main = self._events(prof)
        positions = self._sampler.positions
        lines = tuple(line_of(*p) for p in positions)
        contexts = tuple(_context(p[0], p[1]) for p in positions)
        shift = self._offset_ns
        samples = tuple(Sample((t - shift) / 1000, i, w / 1000) for t, i, w in self._sampler.samples
                        if t <= self._end_ns)
        notes = list(self.notes)
        if self.device == "cuda" and not any(e.on_device for e in events) and \
                any(e.name.startswith("cuda") for e in events):
            notes.append("the profiler recorded no device activity (CUPTI is not working here): device time, "
                         "device idle and kernels are unknown; host times are right")
        patterns = tuple(Pattern(*p) for p in compat.profiler_anti_patterns(prof)) if self.tidy else ()
        if not self.keep_trace:
            self.profiler = None  # the trace is not kept: only the summary
        return Capture(events=events, samples=samples, lines=lines,
                       marks=tuple((m - shift) / 1000 for m in self._marks), start=(self._start_ns - shift) / 1000,
                       end=(self._end_ns - shift) / 1000, main_thread=main, device=self.device, status=status,
                       steps_seen=self._stepped, notes=tuple(notes), patterns=patterns, contexts=contexts)

    def _events(self, prof: Any) -> tuple[tuple[Event, ...], int]:
        """The profiler's events as plain tuples, each with its parent on its thread (ranges on a thread
        nest); sets the clock offset from the marker range."""
        raw = compat.profiler_events(prof)
        frontend = {r[7]: r for r in raw if not r[6] and r[8] == 0}   # ops by correlation id
        device_ns: dict[int, int] = {}
        rows = []
        for name, start, end, thread, annotation, python, on_device, corr, linked in raw:
            if name == _CLOCK:
                self._offset_ns = self._start_ns - start
            if on_device:
                if linked in frontend:
                    device_ns[linked] = device_ns.get(linked, 0) + (end - start)
            elif linked in frontend:
                thread = frontend[linked][3]  # a runtime call runs on the thread of the op that made it
            rows.append((name, start, end, thread, annotation, python, on_device, corr, linked))
        main = next((r[3] for r in rows if r[0] == _CLOCK), 0)
        order = sorted(range(len(rows)), key=lambda k: (rows[k][6], rows[k][3], rows[k][1], -rows[k][2]))
        parents = [-1] * len(rows)
        stack: list[int] = []
        for k in order:
            name, start, end, thread, _, _, on_device, _, _ = rows[k]
            while stack and (rows[stack[-1]][3] != thread or rows[stack[-1]][6] or rows[stack[-1]][2] <= start):
                stack.pop()
            if on_device:
                continue
            parents[k] = stack[-1] if stack else -1
            stack.append(k)
        events = tuple(Event(name, start / 1000, end / 1000, parents[k], thread, annotation,
                             device_ns.get(corr, 0) / 1000 if not on_device and linked == 0 else 0.0, on_device,
                             python)
                       for k, (name, start, end, thread, annotation, python, on_device, corr, linked) in enumerate(rows))
        return events, main

    def export_chrome_trace(self, path: str) -> None:
        if self.profiler is None:
            raise InputError("the trace was not kept: profile with keep_trace=True (or %%profile --trace FILE)")
        self.profiler.export_chrome_trace(path)


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Kineto logs "profiler_start" / "profiler_stop" lines on the process's fd 2 at each start and stop,
    which a notebook shows under the cell: fd 2 goes to /dev/null for those two calls only."""
    try:
        sys.stderr.flush()
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    except (OSError, ValueError, AttributeError):  # no fd 2 here: nothing to silence
        yield
        return
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _context(filename: str, lineno: int, around: int = 2) -> tuple[int, tuple[str, ...]]:
    """The lines around ``lineno`` (the view that opens a line shows them), and the first one's number."""
    first = max(1, lineno - around)
    lines = linecache.getlines(filename)[first - 1:lineno + around]
    return first, tuple(line.rstrip("\n") for line in lines)
