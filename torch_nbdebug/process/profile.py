"""From the profiler's events to the summary that is kept: steps, categories, modules, lines, ops.

One rule decides what each microsecond of the main thread was: the highest-priority interval covering
it (a host sync, then DataLoader iteration, the optimizer, backward, a top-level torch op), else
"Python outside torch ops". So the categories of a step add up to the step time by construction.
The verdict is decided from these figures in :mod:`torch_nbdebug.process.profile_verdict`.
"""
from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from dataclasses import replace
from typing import Iterable

from torch_nbdebug.data.profile import (CATEGORIES, Capture, Event, LineRow, ModuleRow, OpRow, ProfileData,
                                        Segment, Step)
from torch_nbdebug.process.profile_verdict import Figures, decide

MODULE_PREFIX = "module: "          # the recorder's module ranges (record/profile.py names them so)
DATA_PREFIX = "enumerate(DataLoader)#"
OPTIMIZER_PREFIXES = ("Optimizer.step#", "Optimizer.zero_grad#")
BACKWARD_PREFIX = "autograd::engine::evaluate_function: "
COPY_OPS = frozenset({"aten::to", "aten::_to_copy", "aten::copy_", "aten::contiguous", "aten::pin_memory",
                      "aten::_pin_memory"})
# Priority of what covers a microsecond (highest wins); the rest is "python".
_PRIORITY = ("forward", "backward", "optimizer", "data", "sync")
_SOON_US = 3000.0                  # a look at most this long after the previous one names an op's line
MAX_LINES, MAX_MODULES, MAX_OPS, MAX_SEGMENTS = 40, 40, 25, 1500


def kind_of(e: Event, device: str) -> str:
    """What an event is: data, optimizer, backward, sync, module, device, annotation or op."""
    name = e.name
    if e.on_device:
        return "device"
    if name.startswith(DATA_PREFIX):
        return "data"
    if name.startswith(OPTIMIZER_PREFIXES):
        return "optimizer"
    if name.startswith(BACKWARD_PREFIX):
        return "backward"
    if name.startswith(MODULE_PREFIX):
        return "module"
    if device == "cuda" and name.startswith("cuda") and "Synchronize" in name:
        return "sync"
    if e.annotation or e.python or name.startswith("torch_nbdebug"):
        return "annotation"
    return "op"


class _Tree:
    """The events with their kinds, and for each: is it a top-level op, its innermost module."""

    def __init__(self, capture: Capture) -> None:
        events = capture.events
        self.events = events
        self.kinds = [kind_of(e, capture.device) for e in events]
        n = len(events)
        self.module = [""] * n          # innermost enclosing module range's path ("" outside modules)
        self.under_op = [False] * n     # an op or backward node encloses it
        self.phase = [""] * n           # data / optimizer / backward ancestor, if any
        for i in self._parents_first():
            p = events[i].parent
            if p < 0:
                continue
            pk = self.kinds[p]
            self.module[i] = events[p].name[len(MODULE_PREFIX):] if pk == "module" else self.module[p]
            self.under_op[i] = self.under_op[p] or pk in ("op", "backward")
            self.phase[i] = pk if pk in ("data", "optimizer", "backward") else self.phase[p]
        main = capture.main_thread
        self.top_ops = [i for i in range(n) if self.kinds[i] in ("op", "backward") and not self.under_op[i]
                        and events[i].thread == main and self.phase[i] != "data"]

    def _parents_first(self) -> list[int]:
        order: list[int] = []
        seen = [False] * len(self.events)
        for i in range(len(self.events)):
            chain = []
            j = i
            while j >= 0 and not seen[j]:
                chain.append(j)
                seen[j] = True
                j = self.events[j].parent
            order.extend(reversed(chain))
        return order


def step_windows(capture: Capture, tree: _Tree) -> tuple[list[tuple[float, float]], str]:
    """Each step's (start, end): optimizer steps, else DataLoader batches, else the whole cell."""
    if capture.marks:
        bounds = [capture.start, *capture.marks]
        return list(zip(bounds[:-1], bounds[1:])), "optimizer"
    starts = sorted(e.start for e, k in zip(tree.events, tree.kinds)
                    if k == "data" and e.thread == capture.main_thread and e.parent < 0)
    if len(starts) >= 2:
        return list(zip(starts[:-1], starts[1:])), "dataloader"
    return [(capture.start, capture.end)], "cell"


def partition(tree: _Tree, capture: Capture) -> list[Segment]:
    """The main thread's time cut into segments, each with the highest-priority category covering it."""
    intervals: list[tuple[float, float, int, str]] = []
    for i, (e, k) in enumerate(zip(tree.events, tree.kinds)):
        if k == "backward" and not tree.under_op[i]:
            intervals.append((e.start, e.end, _PRIORITY.index("backward"), e.name[len(BACKWARD_PREFIX):]))
        elif e.thread != capture.main_thread:
            continue
        elif k in ("data", "optimizer", "sync"):
            intervals.append((e.start, e.end, _PRIORITY.index(k), e.name))
    for i in tree.top_ops:
        e = tree.events[i]
        if tree.kinds[i] == "op" and not tree.phase[i]:
            intervals.append((e.start, e.end, 0, e.name))
    points: list[tuple[float, int, int, str]] = []
    for start, end, prio, label in intervals:
        if end > start:
            points.append((start, 1, prio, label))
            points.append((end, -1, prio, label))
    points.sort(key=lambda p: (p[0], p[1]))
    active = [0] * len(_PRIORITY)
    labels: list[str] = [""] * len(_PRIORITY)
    out: list[Segment] = []
    at = capture.start
    for t, delta, prio, label in points:
        if t > at:
            top = next((p for p in range(len(_PRIORITY) - 1, -1, -1) if active[p] > 0), -1)
            _append(out, at, t, _PRIORITY[top] if top >= 0 else "python", labels[top] if top >= 0 else "")
            at = t
        active[prio] += delta
        if delta > 0:
            labels[prio] = label
    if capture.end > at:
        _append(out, at, capture.end, "python", "")
    return out


def _append(out: list[Segment], start: float, end: float, category: str, label: str) -> None:
    if out and out[-1].category == category and out[-1].label == label and out[-1].end == start:
        out[-1] = replace(out[-1], end=end)
    else:
        out.append(Segment(start, end, category, label))


def _clip(segments: list[Segment], starts: list[float], lo: float, hi: float) -> Iterable[Segment]:
    k = max(0, bisect.bisect_right(starts, lo) - 1)
    while k < len(segments) and segments[k].start < hi:
        s = segments[k]
        if s.end > lo:
            yield Segment(max(s.start, lo), min(s.end, hi), s.category, s.label)
        k += 1


def _union_ms(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    total, reach = 0.0, lo
    for start, end in sorted(intervals):
        start, end = max(start, reach), min(end, hi)
        if end > start:
            total += end - start
            reach = end
    return total / 1000


def summarize(capture: Capture, warmup: int = 1) -> ProfileData:
    """The kept summary of a capture; the first ``warmup`` steps are left out (when more steps ran)."""
    tree = _Tree(capture)
    windows, source = step_windows(capture, tree)
    notes = list(capture.notes)
    skip = warmup if len(windows) > warmup else 0
    if warmup and not skip and source != "cell":
        notes.append(f"only {len(windows)} step(s) ran: none was skipped as warm-up, so the first one's "
                     f"one-off costs are in the figures")
    numbered = list(enumerate(windows))[skip:]  # a step's number: optimizer steps before it
    segments = partition(tree, capture)
    seg_starts = [s.start for s in segments]
    device_spans = [(e.start, e.end) for e, k in zip(tree.events, tree.kinds) if k == "device"]
    has_device = bool(device_spans)
    op_start = sorted((tree.events[i].start, i) for i in tree.top_ops)
    op_times = [t for t, _ in op_start]
    steps: list[Step] = []
    for number, (lo, hi) in numbered:
        cats = dict.fromkeys(CATEGORIES, 0.0)
        for s in _clip(segments, seg_starts, lo, hi):
            cats[s.category] += (s.end - s.start) / 1000
        ops = [i for _, i in op_start[bisect.bisect_left(op_times, lo):bisect.bisect_left(op_times, hi)]]
        copy = sum(tree.events[i].end - tree.events[i].start for i in ops if tree.events[i].name in COPY_OPS) / 1000
        syncs = sum(1 for e, k in zip(tree.events, tree.kinds) if k == "sync" and lo <= e.start < hi)
        steps.append(Step(number, (hi - lo) / 1000, cats, len(ops), copy, syncs,
                          _union_ms(device_spans, lo, hi) if has_device else None))
    kept = [w for _, w in numbered]
    count = max(1, len(kept))
    mean_step = sum(s.ms for s in steps) / count
    modules = _modules(tree, kept, count, mean_step, capture)
    lines = _lines(capture, tree, kept, count, mean_step, segments, seg_starts)
    op_rows = _ops(tree, kept, count, mean_step, capture.device)
    median_step = sorted(steps, key=lambda s: s.ms)[len(steps) // 2] if steps else None
    timeline: tuple[Segment, ...] = ()
    if median_step is not None:
        lo, hi = windows[median_step.number]
        timeline = _thin([Segment((s.start - lo) / 1000, (s.end - lo) / 1000, s.category, s.label)
                          for s in _clip(segments, seg_starts, lo, hi)])
    kept_ops = [tree.events[i].end - tree.events[i].start for t, i in op_start if _in(t, kept, [w[0] for w in kept])]
    figures = Figures.of(steps, modules, lines, op_rows, capture.device, has_device,
                         statistics.median(kept_ops) if kept_ops else 0.0)
    data = ProfileData(steps=tuple(steps), modules=modules, lines=lines, ops=op_rows, timeline=timeline,
                       timeline_step=median_step.number if median_step else 0, verdict=decide(figures),
                       device=capture.device, step_source=source, warmup=skip, steps_seen=capture.steps_seen,
                       status=capture.status, patterns=capture.patterns, notes=tuple(notes))
    return data


def _in(t: float, windows: list[tuple[float, float]], starts: list[float]) -> bool:
    k = bisect.bisect_right(starts, t) - 1
    return k >= 0 and t < windows[k][1]


def _modules(tree: _Tree, windows: list[tuple[float, float]], count: int, mean_step: float,
             capture: Capture) -> tuple[ModuleRow, ...]:
    starts = [w[0] for w in windows]
    total: dict[str, float] = defaultdict(float)
    inner: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    ops: dict[str, int] = defaultdict(int)
    device: dict[str, float] = defaultdict(float)
    for i, (e, k) in enumerate(zip(tree.events, tree.kinds)):
        if k != "module" or not _in(e.start, windows, starts):
            continue
        path = e.name[len(MODULE_PREFIX):]
        total[path] += e.end - e.start
        calls[path] += 1
        if tree.module[i]:
            inner[tree.module[i]] += e.end - e.start
    for i in tree.top_ops:
        path = tree.module[i]
        if path and _in(tree.events[i].start, windows, starts):
            ops[path] += 1
    if capture.device == "cuda":
        for i, e in enumerate(tree.events):
            if e.device and tree.module[i] and _in(e.start, windows, starts):
                for path in _ancestors(tree.module[i]):
                    device[path] += e.device
    rows = [ModuleRow(path, total[path] / 1000 / count, (total[path] - inner[path]) / 1000 / count,
                      calls[path] / count, total[path] / 1000 / count / mean_step if mean_step else 0.0,
                      ops[path] / count, device[path] / 1000 / count if capture.device == "cuda" else None)
            for path in total]
    rows.sort(key=lambda r: -r.ms)
    return tuple(rows[:MAX_MODULES])


def _ancestors(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:k]) for k in range(1, len(parts) + 1)]


def _lines(capture: Capture, tree: _Tree, windows: list[tuple[float, float]], count: int, mean_step: float,
           segments: list[Segment], seg_starts: list[float]) -> tuple[LineRow, ...]:
    starts = [w[0] for w in windows]
    ms: dict[int, float] = defaultdict(float)
    cats: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    samples, categories = [], []
    for s in capture.samples:
        w = bisect.bisect_right(starts, s.time) - 1
        if w < 0 or s.time >= windows[w][1]:
            continue
        weight = min(s.weight, s.time - windows[w][0])  # the part of its wait inside the step
        k = bisect.bisect_right(seg_starts, s.time) - 1
        category = segments[k].category if 0 <= k < len(segments) and s.time < segments[k].end else "python"
        ms[s.line] += weight
        cats[s.line][category] += weight / 1000 / count
        samples.append(s)
        categories.append(category)
    ops: dict[int, int] = defaultdict(int)
    device: dict[int, float] = defaultdict(float)
    times = [s.time for s in samples]
    for i in tree.top_ops:
        if tree.kinds[i] == "backward":
            continue  # backward nodes all come from `.backward()`: the forward line that recorded them counts
        # An op goes to the line of the first look after it started, when that look came soon (the main
        # thread did not hold the sampler off) and saw no DataLoader: the statement that launched it.
        e = tree.events[i]
        k = bisect.bisect_left(times, e.start)
        if k < len(samples) and samples[k].time - samples[k].weight <= e.start and categories[k] != "data" \
                and samples[k].weight <= _SOON_US:
            ops[samples[k].line] += 1
            device[samples[k].line] += _device_total(tree, i)
    rows = []
    for index, spent in ms.items():
        first, context = capture.contexts[index] if index < len(capture.contexts) else (0, ())
        rows.append(LineRow(capture.lines[index], spent / 1000 / count,
                            spent / 1000 / count / mean_step if mean_step else 0.0, ops[index] / count,
                            device[index] / 1000 / count if capture.device == "cuda" else None,
                            {c: round(v, 4) for c, v in cats[index].items()}, context, first))
    rows.sort(key=lambda r: -r.ms)
    return tuple(rows[:MAX_LINES])


def _device_total(tree: _Tree, i: int) -> float:
    """Device time of an op and everything under it (kernels are on the ops that launched them)."""
    return tree.events[i].device + sum(_device_total(tree, c) for c in _children(tree).get(i, ()))


def _children(tree: _Tree) -> dict[int, list[int]]:
    cached = getattr(tree, "_children_map", None)
    if cached is None:
        cached = defaultdict(list)
        if any(e.device for e in tree.events):
            for i, e in enumerate(tree.events):
                if e.parent >= 0:
                    cached[e.parent].append(i)
        tree._children_map = cached  # type: ignore[attr-defined]
    return cached


def _ops(tree: _Tree, windows: list[tuple[float, float]], count: int, mean_step: float,
         device: str) -> tuple[OpRow, ...]:
    starts = [w[0] for w in windows]
    durations: dict[str, list[float]] = defaultdict(list)
    dev: dict[str, float] = defaultdict(float)
    for i in tree.top_ops:
        e = tree.events[i]
        if _in(e.start, windows, starts):
            durations[e.name].append(e.end - e.start)
            if device == "cuda":
                dev[e.name] += _device_total(tree, i)
    rows = [OpRow(name, len(d) / count, sum(d) / 1000 / count, statistics.median(d),
                  sum(d) / 1000 / count / mean_step if mean_step else 0.0,
                  dev[name] / 1000 / count if device == "cuda" else None) for name, d in durations.items()]
    rows.sort(key=lambda r: -r.ms)
    return tuple(rows[:MAX_OPS])


def _thin(segments: list[Segment]) -> tuple[Segment, ...]:
    """At most MAX_SEGMENTS segments: neighbours of one category are merged (labels dropped) when more."""
    if len(segments) <= MAX_SEGMENTS:
        return tuple(segments)
    out: list[Segment] = []
    for s in segments:
        if out and out[-1].category == s.category:
            out[-1] = Segment(out[-1].start, s.end, s.category, "")
        else:
            out.append(s)
    if len(out) > MAX_SEGMENTS:  # still too many: keep the longest, in time order
        keep = sorted(sorted(range(len(out)), key=lambda k: out[k].start - out[k].end)[:MAX_SEGMENTS])
        out = [out[k] for k in keep]
    return tuple(out)

