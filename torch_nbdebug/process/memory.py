"""Pure functions from a memory recording to the timeline: series by category, peak, phases, leaks,
and the min/max-preserving decimation that keeps a million-event timeline drawable.
"""
from __future__ import annotations

import re
from collections import Counter
from operator import attrgetter
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from torch_nbdebug.data.memory import (
    CATEGORIES, PHASES, SAVED_BY_GRAPH, Allocation, Leak, MemoryRecording, MemoryTimeline, PhaseSpan,
)

_CAT = {name: i for i, name in enumerate(CATEGORIES)}
# Categories that are expected to persist after a training step; never reported as leaks.
_STATE = {"parameters", "gradients", "optimizer_state"}
_SUBSCRIPT = re.compile(r"\[[^\[\]]*\]$")
_IN_CONTAINER = re.compile(r"^(\w+)\[")


def build_timeline(rec: MemoryRecording, *, top: int = 10) -> MemoryTimeline:
    """Turn a recording into a :class:`MemoryTimeline` (series, peak, totals, phases, leaks).

    Each numeric field of the allocations is read into an array once and shared by the series, the
    peak's allocations and the totals (reading a field of every row costs more than the arithmetic)."""
    spans = allocation_spans(rec.allocations)
    columns = _Columns(spans[0], spans[2], _category_indices(rec.allocations))
    by_category = category_series(rec.allocations, rec.events, columns)
    totals = by_category.sum(axis=1)
    peak_step = int(np.argmax(totals)) if len(totals) else 0
    steps = np.arange(len(totals), dtype=np.int64)
    time_s = np.concatenate([[0.0], rec.event_time_ns / 1e9])
    leaks = rec.leaks or find_leaks(rec.allocations)
    return MemoryTimeline(
        device=rec.device, note=rec.note, steps=steps, time_s=time_s, by_category=by_category,
        reserved=rec.reserved, start_bytes=int(totals[0]), final_bytes=int(totals[-1]),
        peak_bytes=int(totals[peak_step]), peak_step=peak_step,
        peak_allocations=alive_at(rec.allocations, peak_step, top, spans),
        category_totals=category_totals(rec.allocations, by_category, peak_step, columns),
        phases=phase_spans(rec.event_phase, rec.iteration_starts),
        iterations=len(rec.iteration_starts),
        leaks=leaks, allocations=rec.allocations, duration_s=rec.duration_s, snapshot=rec.snapshot,
        allocator=dict(rec.allocator))


class _Columns(NamedTuple):
    """Fields of every allocation as arrays, in allocation order: start, bytes, category index."""

    start: np.ndarray
    nbytes: np.ndarray
    category: np.ndarray


def _columns(allocations: Sequence[Allocation]) -> _Columns:
    return _Columns(_ints(allocations, "start"), _ints(allocations, "nbytes"), _category_indices(allocations))


def category_series(allocations: Sequence[Allocation], events: np.ndarray,
                    columns: Optional[_Columns] = None) -> np.ndarray:
    """Live bytes per category after each event: shape ``(len(events) + 1, len(CATEGORIES))``.

    ``events[i] >= 0`` allocates allocation ``events[i]``; ``-(id + 1)`` frees it. Row 0 holds
    the allocations alive before recording (``start == -1``). ``columns``: the allocations' fields
    already read (``build_timeline`` shares them).
    """
    n_cat = len(CATEGORIES)
    starts, nbytes, cats = columns if columns is not None else _columns(allocations)
    out = np.zeros((len(events) + 1, n_cat), dtype=np.int64)
    before = starts < 0
    np.add.at(out[0], cats[before], nbytes[before])  # row 0: what was alive before recording
    if len(events):
        ids = np.where(events >= 0, events, -events - 1)
        delta = np.where(events >= 0, nbytes[ids], -nbytes[ids])
        out[np.arange(1, len(events) + 1), cats[ids]] = delta
        np.cumsum(out, axis=0, out=out)
    return out


_ALIVE = int(np.iinfo(np.int64).max)  # the end of an allocation alive at the end (looked up once: it costs)


def allocation_spans(allocations: Sequence[Allocation]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(start, end, nbytes)`` arrays (end = a huge number while alive): vectorised liveness queries."""
    ends = np.fromiter([_ALIVE if end is None else end for end in map(attrgetter("end"), allocations)], np.int64,
                       len(allocations))
    return _ints(allocations, "start"), ends, _ints(allocations, "nbytes")


def _ints(allocations: Sequence[Allocation], name: str) -> np.ndarray:
    """One integer field of every allocation as an array (``map`` of an ``attrgetter``: no Python frame
    per row, where a generator expression resumes one per row)."""
    return np.fromiter(map(attrgetter(name), allocations), np.int64, len(allocations))


def _category_indices(allocations: Sequence[Allocation]) -> np.ndarray:
    return np.fromiter(map(_CAT.__getitem__, map(attrgetter("category"), allocations)), np.int64, len(allocations))


def alive_at(allocations: Sequence[Allocation], sample: int, top: Optional[int] = None,
             spans: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None) -> tuple[Allocation, ...]:
    """Allocations alive at ``sample``, largest first (``top`` of them when given)."""
    starts, ends, nbytes = spans if spans is not None else allocation_spans(allocations)
    alive = np.flatnonzero((starts < sample) & (ends >= sample))
    order = alive[np.lexsort((alive, -nbytes[alive]))]  # bytes descending, then id
    return tuple(allocations[i] for i in (order[:top] if top is not None else order))


def category_totals(allocations: Sequence[Allocation], by_category: np.ndarray,
                    peak_step: int, columns: Optional[_Columns] = None) -> dict[str, dict[str, int]]:
    """Per category: bytes at start, at the peak, the maximum, at the end, and allocated in total."""
    starts, nbytes, cats = columns if columns is not None else _columns(allocations)
    allocated = np.zeros(len(CATEGORIES), dtype=np.int64)
    made = starts >= 0
    np.add.at(allocated, cats[made], nbytes[made])
    start, peak, most, final = (row.tolist() for row in (by_category[0], by_category[peak_step],
                                                         by_category.max(axis=0), by_category[-1]))
    return {c: {"start": start[i], "peak": peak[i], "max": most[i], "final": final[i], "allocated": int(allocated[i])}
            for i, c in enumerate(CATEGORIES)}


def phase_spans(event_phase: np.ndarray, iteration_starts: Sequence[int]) -> tuple[PhaseSpan, ...]:
    """Runs of forward/backward/optimizer events as sample ranges, numbered by loop iteration."""
    if not len(event_phase):
        return ()
    change = np.flatnonzero(np.diff(event_phase)) + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [len(event_phase)]])
    iters = np.asarray(sorted(iteration_starts), dtype=np.int64)
    spans = []
    for s, e in zip(starts.tolist(), ends.tolist()):
        phase = PHASES[int(event_phase[s])]
        if phase != "idle":
            spans.append(PhaseSpan(phase, s + 1, e, int(np.searchsorted(iters, s, side="right"))))
    return tuple(spans)


def _container(name: str) -> str:
    """The top-level container for ``losses[17]`` / ``models[3].fc.weight`` (``losses``, ``models``);
    else the name without its last subscript (``x`` -> ``x``, ``obj.cache[0]`` -> ``obj.cache``)."""
    root = _IN_CONTAINER.match(name)
    return root.group(1) if root else _SUBSCRIPT.sub("", name)


def find_leaks(allocations: Sequence[Allocation]) -> tuple[Leak, ...]:
    """Tensors allocated during recording and still alive, grouped by what holds them.

    Model and optimizer state is expected to persist and a single tensor bound to a plain variable is
    the cell's result; what remains are containers that grew (``losses[17]``), graphs kept alive by
    a held tensor (their saved activations) and memory reachable from nowhere in the namespace.
    """
    survivors = [a for a in allocations if a.start >= 0 and a.end is None
                 and (a.category not in _STATE or _grown_state(a))]
    groups: dict[str, list[Allocation]] = {}
    orphans: list[Allocation] = []
    saved_by: dict[str, list[Allocation]] = {}  # saved for backward by a held tensor's graph
    for a in survivors:
        if a.holder is None:
            orphans.append(a)
        elif a.holder.endswith(SAVED_BY_GRAPH):
            saved_by.setdefault(_container(a.holder[:-len(SAVED_BY_GRAPH)]), []).append(a)
        else:
            groups.setdefault(_container(a.holder), []).append(a)
    graph_holders = [k for k, members in groups.items() if any(m.has_graph for m in members)]
    saved = [a for a in orphans if a.category == "activations"]
    leaks = []
    for key, members in groups.items():
        kept = saved_by.get(key, []) + (saved if graph_holders and key == graph_holders[0] else [])
        is_result = len(members) == 1 and members[0].holder == key and not kept
        if not is_result:
            leaks.append(_leak(key, members, kept))
    if saved and not graph_holders:
        leaks.append(_leak("(autograd graph not reachable from the namespace)", saved, []))
    rest = [a for a in orphans if a.category != "activations"]
    if rest:
        leaks.append(_leak("(not reachable from the namespace: a closure, cache or cycle)", rest, []))
    return tuple(sorted(leaks, key=lambda leak: -leak.nbytes))


def _grown_state(a: Allocation) -> bool:
    """Model/optimizer state kept in a list or dict (``models[3].fc.weight``): a model made per batch."""
    return a.holder is not None and _IN_CONTAINER.match(a.holder) is not None


def _leak(holder: str, members: list[Allocation], kept: list[Allocation]) -> Leak:
    has_graph = any(m.has_graph for m in members)
    lines = Counter(m.line for m in members if m.line is not None)
    note = ""
    if has_graph:
        note = "autograd graph attached: keep loss.item() or tensor.detach() instead of the tensor"
        if kept:
            note += f"; the graph keeps {len(kept)} saved activation(s) alive"
    everything = members + kept
    return Leak(holder=holder, names=tuple(m.holder or "?" for m in members[:5]) + (("…",) if len(members) > 5 else ()),
                count=len(everything), nbytes=sum(m.nbytes for m in everything), has_graph=has_graph,
                line=lines.most_common(1)[0][0] if lines else None,
                allocation_ids=tuple(m.id for m in everything), note=note)


def leaks_first(allocations: Sequence[Allocation], leaks: Sequence[Leak]) -> list[Allocation]:
    """The allocations of a detected leak first (the finding), each group in its given order."""
    leaked = {i for leak in leaks for i in leak.allocation_ids}
    return sorted(allocations, key=lambda a: a.id not in leaked)


def decimate(totals: np.ndarray, max_points: int) -> np.ndarray:
    """Indices of at most ``max_points`` samples keeping each bucket's minimum and maximum.

    Picking real samples (not averages) keeps stacked categories consistent at every drawn point;
    the global peak, every local spike wider than a bucket's width and the first/last sample survive.
    """
    n = len(totals)
    if n <= max_points:
        return np.arange(n, dtype=np.int64)
    buckets = max(1, (max_points - 2) // 2)
    width = -(-n // buckets)
    padded = np.concatenate([totals, np.full(buckets * width - n, totals[-1])]).reshape(buckets, width)
    offsets = np.arange(buckets, dtype=np.int64) * width
    picks = np.concatenate([[0, n - 1], offsets + padded.argmax(axis=1), offsets + padded.argmin(axis=1)])
    return np.unique(np.minimum(picks, n - 1))


def window(tl: MemoryTimeline, lo: int, hi: int, max_points: int = 1200, top: int = 8,
           spans: Optional[tuple[np.ndarray, np.ndarray, np.ndarray]] = None) -> dict[str, Any]:
    """What the widget draws for samples ``lo..hi``: decimated stacked series, phases, local peak.

    Pass ``spans`` (from :func:`allocation_spans`) when asking repeatedly for the same timeline.
    """
    n = len(tl.steps)
    lo, hi = max(0, int(lo)), min(n - 1, int(hi))
    if hi <= lo:
        lo, hi = max(0, min(lo, n - 2)), min(n - 1, max(lo, 0) + 1)
    totals = tl.by_category[lo:hi + 1].sum(axis=1)
    idx = decimate(totals, max_points) + lo
    local_peak = lo + int(np.argmax(totals)) if len(totals) else lo
    return {
        "lo": lo, "hi": hi, "steps": tl.steps[idx].tolist(), "time_s": tl.time_s[idx].round(6).tolist(),
        "series": [tl.by_category[idx, c].tolist() for c in range(len(CATEGORIES))],
        "reserved": None if tl.reserved is None else tl.reserved[idx].tolist(),
        "phases": [p.to_dict() for p in tl.phases if p.end >= lo and p.start <= hi][:2000],
        "local_peak": {"step": local_peak, "bytes": int(tl.totals[local_peak]),
                       "allocations": [a.to_dict() for a in leaks_first(alive_at(tl.allocations, local_peak, top, spans),
                                                                         tl.leaks)]},
    }


def cpu_snapshot(tl: MemoryTimeline) -> dict[str, Any]:
    """The timeline as a snapshot in the format of ``torch.cuda.memory._snapshot()``.

    It is the format PyTorch itself produces for CPU memory profiles
    (``torch.cuda._memory_viz.profile_plot``), so its memory viewer opens it: one device trace of
    alloc / free_requested / free_completed entries (with our category on each alloc) and one
    segment holding the blocks alive at the end at their real addresses.
    """
    entries: list[tuple[int, int, Allocation]] = []
    for a in tl.allocations:
        if a.start >= 0:
            entries.append((a.start, 0, a))
        if a.end is not None:
            entries.append((a.end, 1, a))
    entries.sort(key=lambda e: (e[0], e[1]))
    trace: list[dict[str, Any]] = []
    for step, kind, a in entries:
        base = {"addr": a.address, "size": a.nbytes, "stream": 0, "frames": _frames(a),
                "time_us": int(tl.time_s[min(step + 1, len(tl.time_s) - 1)] * 1e6) if len(tl.time_s) else 0}
        if kind == 0:
            trace.append({"action": "alloc", "category": a.category, **base})
        else:
            trace.extend({"action": action, **base} for action in ("free_requested", "free_completed"))
    return {"device_traces": [trace], "segments": _segments(tl.allocations)}


def _frames(a: Allocation) -> list[dict[str, Any]]:
    frames = []
    if a.line is not None:
        frames.append({"filename": a.line.filename, "line": a.line.lineno, "name": a.line.function})
    if a.module:
        frames.append({"filename": "module", "line": 0, "name": a.module})
    return frames


def _segments(allocations: Sequence[Allocation]) -> list[dict[str, Any]]:
    """One segment per block alive at the end: CPU tensors are not carved out of cached segments,
    so a segment spanning them all would show the heap between them as reserved-but-free."""
    return [{"device": 0, "address": a.address, "total_size": a.nbytes, "stream": 0, "segment_type": "large",
             "segment_pool_id": (0, 0), "allocated_size": a.nbytes, "active_size": a.nbytes,
             "requested_size": a.nbytes,
             "blocks": [{"address": a.address, "size": a.nbytes, "requested_size": a.nbytes,
                         "state": "active_allocated", "frames": _frames(a)}]}
            for a in sorted((a for a in allocations if a.end is None), key=lambda a: a.address)]
