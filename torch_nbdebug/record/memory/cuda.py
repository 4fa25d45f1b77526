"""The CUDA path: the caching allocator's own history, joined with the dispatch-mode categories.

``torch.cuda.memory._record_memory_history`` gives the allocator's exact view (block sizes after
rounding, reserved segments, frees that wait for streams) and a snapshot PyTorch's memory viewer
opens. It knows nothing of parameters or activations, so the :class:`MemoryRecorder` runs alongside
on CUDA tensors and each allocator block is matched to the storage at the same address, in order.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import replace
from typing import Any, Optional

import numpy as np
import torch

from torch_nbdebug.data.memory import PHASES, Allocation, MemoryRecording
from torch_nbdebug.data.source import SourceLine
from torch_nbdebug.record import compat
from torch_nbdebug.record.source import is_user_file, line_of

_PHASE = {name: i for i, name in enumerate(PHASES)}
DEFAULT_MAX_ENTRIES = 2_000_000


class CudaHistory:
    """Record allocator history for a block; afterwards ``snapshot`` holds it and the setting is back.

    PyTorch exposes only whether history is on (``_cuda_isHistoryEnabled``), not its options: when the
    user already records history we leave it untouched and keep only the events after our start;
    otherwise we turn it on (clearing stale entries) and turn it off again on exit, clearing our own
    entries so a later snapshot of the user's sees none of ours.
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self.was_enabled = False
        self.start_us: Optional[float] = None
        self.snapshot: Optional[dict[str, Any]] = None

    def __enter__(self) -> "CudaHistory":
        self.was_enabled = history_enabled()
        torch.cuda.synchronize()
        if self.was_enabled:
            self.start_us = time.time() * 1e6
        else:
            compat.start_cuda_memory_history(self.max_entries)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            torch.cuda.synchronize()
            self.snapshot = compat.cuda_memory_snapshot()
        finally:
            if not self.was_enabled:
                # Our events are in the snapshot already; clearing them leaves the allocator as we found it.
                compat.stop_cuda_memory_history()


def history_enabled() -> bool:
    """Whether the user (or anyone) has allocator history recording on."""
    return compat.cuda_history_enabled()


def recording_from_snapshot(snapshot: dict[str, Any], device: int = 0, tagged: Optional[MemoryRecording] = None,
                            start_us: Optional[float] = None, note: str = "") -> MemoryRecording:
    """Turn one device's allocator trace into a recording, categories taken from ``tagged`` by address."""
    trace = [e for e in _device_trace(snapshot, device) if start_us is None or e.get("time_us", start_us) >= start_us]
    segments = [s for s in snapshot.get("segments", []) if s.get("device", device) == device]
    builder = _Builder(tagged, _reserved_at_start(segments, trace))
    for entry in trace:
        builder.apply(entry)
    builder.adopt_blocks_alive_at_end(segments)
    return replace(builder.recording(f"cuda:{device}", note, snapshot), allocator=allocator_state(segments))


def allocator_state(segments: list[dict[str, Any]]) -> dict[str, int]:
    """Reserved vs allocated at the end, and how fragmented the cached memory is.

    Free bytes inside segments that still hold a live block cannot be returned to CUDA by
    ``empty_cache()`` and only serve requests that fit the holes: that is the fragmentation.
    """
    reserved = sum(int(s["total_size"]) for s in segments)
    allocated = fragmented = largest = 0
    for seg in segments:
        blocks = seg.get("blocks", [])
        live = [int(b["size"]) for b in blocks if b.get("state") == "active_allocated"]
        free = [int(b["size"]) for b in blocks if b.get("state") == "inactive"]
        allocated += sum(live)
        if live:
            fragmented += sum(free)
        largest = max([largest, *free])
    return {"reserved": reserved, "allocated": allocated, "free_in_used_segments": fragmented,
            "largest_free_block": largest, "segments": len(segments)}


def _device_trace(snapshot: dict[str, Any], device: int) -> list[dict[str, Any]]:
    traces = snapshot.get("device_traces") or []
    return list(traces[device]) if device < len(traces) else []


def _reserved_at_start(segments: list[dict[str, Any]], trace: list[dict[str, Any]]) -> int:
    end = sum(int(s["total_size"]) for s in segments)
    delta = sum(int(e["size"]) * (1 if e["action"] == "segment_alloc" else -1)
                for e in trace if e["action"] in ("segment_alloc", "segment_free"))
    return end - delta


class _Builder:
    """Replays allocator entries into allocations + events (only alloc and free_completed count)."""

    def __init__(self, tagged: Optional[MemoryRecording], reserved: int) -> None:
        self.tags: dict[int, deque[Allocation]] = {}
        self.pre_tags: dict[int, Allocation] = {}
        for a in sorted(tagged.allocations if tagged else (), key=lambda a: a.start):
            if a.start < 0:
                self.pre_tags[a.address] = a
            else:
                self.tags.setdefault(a.address, deque()).append(a)
        self.iteration_marks = sorted(tagged.iteration_starts) if tagged else []
        self.allocations: list[Allocation] = []
        self.live: dict[int, int] = {}
        self.events: list[int] = []
        self.times: list[float] = []
        self.phases: list[int] = []
        self.reserved_now = reserved
        self.reserved = [reserved]
        self.iterations: list[int] = []
        self.t0: Optional[float] = None

    def apply(self, e: dict[str, Any]) -> None:
        action = e["action"]
        if action == "segment_alloc":
            self.reserved_now += int(e["size"])
        elif action == "segment_free":
            self.reserved_now -= int(e["size"])
        elif action == "alloc":
            self._alloc(e)
        elif action == "free_completed":
            self._free(e)

    def _alloc(self, e: dict[str, Any]) -> None:
        addr, size = int(e["addr"]), int(e["size"])
        queue = self.tags.get(addr)
        tag = queue.popleft() if queue else None
        alloc_id = len(self.allocations)
        step = self._event(alloc_id, _PHASE.get(tag.phase, 0) if tag else self._last_phase(), e)
        if tag is not None:
            self._mark_iteration(tag.start, step)
        self.allocations.append(_allocation(alloc_id, addr, size, step, tag, e.get("frames") or []))
        self.live[addr] = alloc_id

    def _free(self, e: dict[str, Any]) -> None:
        addr = int(e["addr"])
        alloc_id = self.live.pop(addr, None)
        if alloc_id is None:  # allocated before recording began: alive from the start until now
            alloc_id = len(self.allocations)
            self.allocations.append(_allocation(alloc_id, addr, int(e["size"]), -1, self.pre_tags.get(addr),
                                                e.get("frames") or []))
        step = self._event(-(alloc_id + 1), self._last_phase(), e)
        a = self.allocations[alloc_id]
        self.allocations[alloc_id] = _replace(a, end=step, holder=None, has_graph=False)

    def _event(self, code: int, phase: int, e: dict[str, Any]) -> int:
        t = float(e.get("time_us", 0.0))
        self.t0 = t if self.t0 is None else self.t0
        self.events.append(code)
        self.times.append(t - self.t0)
        self.phases.append(phase)
        self.reserved.append(self.reserved_now)
        return len(self.events) - 1

    def _last_phase(self) -> int:
        return self.phases[-1] if self.phases else 0

    def _mark_iteration(self, tagged_start: int, step: int) -> None:
        while self.iteration_marks and self.iteration_marks[0] <= tagged_start:
            self.iteration_marks.pop(0)
            self.iterations.append(step)

    def adopt_blocks_alive_at_end(self, segments: list[dict[str, Any]]) -> None:
        """Blocks allocated at the end that the trace never allocated existed before recording."""
        for seg in segments:
            addr = int(seg.get("address", 0))
            for block in seg.get("blocks", []):
                baddr = int(block.get("address", addr))
                if block.get("state") == "active_allocated" and baddr not in self.live:
                    alloc_id = len(self.allocations)
                    self.allocations.append(_allocation(alloc_id, baddr, int(block["size"]), -1,
                                                        self.pre_tags.get(baddr), block.get("frames") or []))
                    self.live[baddr] = alloc_id
                addr = baddr + int(block["size"])

    def recording(self, device: str, note: str, snapshot: dict[str, Any]) -> MemoryRecording:
        return MemoryRecording(
            device=device, allocations=tuple(self.allocations),
            events=np.asarray(self.events, dtype=np.int64),
            event_time_ns=(np.asarray(self.times, dtype=np.float64) * 1000).astype(np.int64),
            event_phase=np.asarray(self.phases, dtype=np.int8), iteration_starts=tuple(self.iterations),
            reserved=np.asarray(self.reserved, dtype=np.int64), note=note,
            duration_s=(self.times[-1] / 1e6) if self.times else 0.0, snapshot=snapshot)


def _allocation(alloc_id: int, addr: int, size: int, start: int, tag: Optional[Allocation],
                frames: list[dict[str, Any]]) -> Allocation:
    if tag is None:
        return Allocation(id=alloc_id, nbytes=size, shape=(), dtype="", category="other", phase="idle",
                          start=start, line=_user_frame(frames), op="allocator", device="cuda", address=addr)
    return Allocation(id=alloc_id, nbytes=size, shape=tag.shape, dtype=tag.dtype, category=tag.category,
                      phase=tag.phase, start=start, module=tag.module, line=tag.line or _user_frame(frames),
                      op=tag.op, device=tag.device, holder=tag.holder, has_graph=tag.has_graph, address=addr)


def _replace(a: Allocation, **changes: Any) -> Allocation:
    return replace(a, **changes)


def _user_frame(frames: list[dict[str, Any]]) -> Optional[SourceLine]:
    """The innermost user frame of an allocator stack (innermost first, as PyTorch stores them)."""
    for f in frames:
        filename = str(f.get("filename", ""))
        if filename and filename != "??" and is_user_file(filename):
            return line_of(filename, int(f.get("line", 0)), str(f.get("name", "")))
    return None
