"""Memory data: allocations, the raw recording, the built timeline and the state now. No live tensors.

Time is counted in *events*: every allocation and every free is one step, as in PyTorch's own
memory viewer, so short bursts of temporaries stay visible however fast they were. Wall-clock
time is kept next to it (``time_s``) for hover details.

Numeric series are numpy arrays (compact at a million events); ``to_dict()`` turns everything into
JSON-able lists and dicts.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import numpy as np

from torch_nbdebug.data.source import SourceLine

# Stacking order of the timeline, bottom to top: what persists first, what comes and goes last.
# Holder names of tensors that a held tensor's autograd graph saved for backward end with this
# (``val_losses[2].grad_fn``): the leak of ``val_losses`` owns them.
SAVED_BY_GRAPH = ".grad_fn"
CATEGORIES: tuple[str, ...] = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "other")
CATEGORY_LABELS: dict[str, str] = {
    "parameters": "parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "activations": "activations saved for backward",
    "temporaries": "temporaries",
    "other": "other",
}
PHASES: tuple[str, ...] = ("idle", "forward", "backward", "optimizer")
NO_CUDA_NOTE = "no CUDA device: showing CPU allocations recorded by torch_nbdebug"
_new, _setattr = object.__new__, object.__setattr__  # Allocation.from_values


@dataclass(frozen=True)
class Allocation:
    """One storage the recorder saw: its bytes count once however many views share it.

    ``start`` is the event index of the allocation (-1: alive before recording began); ``end`` the
    event index of its free, or None when it outlived the recording.
    """

    id: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    category: str
    phase: str
    start: int
    end: Optional[int] = None
    module: Optional[str] = None
    line: Optional[SourceLine] = None
    op: str = ""
    device: str = "cpu"
    holder: Optional[str] = None
    has_graph: bool = False
    address: int = 0

    @classmethod
    def from_values(cls, id: int, nbytes: int, shape: tuple[int, ...], dtype: str, category: str, phase: str,
                    start: int, end: Optional[int], module: Optional[str], line: Optional[SourceLine], op: str,
                    device: str, holder: Optional[str], has_graph: bool, address: int) -> "Allocation":
        """Build one from all its field values, in field order, without the frozen ``__init__``'s
        one ``object.__setattr__`` per field (a third of the cost; recorders build thousands per step):
        its ``__dict__`` is one dict display, set once (a display builds faster than keyword arguments
        merged by ``update``). Equal to ``Allocation(*values)`` (tests/test_memory_fastpath.py checks it)."""
        allocation = _new(cls)
        _setattr(allocation, "__dict__", {
            "id": id, "nbytes": nbytes, "shape": shape, "dtype": dtype, "category": category, "phase": phase,
            "start": start, "end": end, "module": module, "line": line, "op": op, "device": device,
            "holder": holder, "has_graph": has_graph, "address": address})
        return allocation

    def alive_at(self, sample: int) -> bool:
        """Alive in timeline sample ``sample`` (the state after ``sample`` events)."""
        return self.start < sample and (self.end is None or sample <= self.end)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["shape"] = list(self.shape)
        data["line"] = self.line.to_dict() if self.line else None
        return data


@dataclass(frozen=True)
class PhaseSpan:
    """A run of events in one phase; ``iteration`` counts training-loop iterations from 0."""

    phase: str
    start: int
    end: int
    iteration: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Leak:
    """Tensors allocated in the cell and alive after it, grouped by the variable that holds them."""

    holder: str
    names: tuple[str, ...]
    count: int
    nbytes: int
    has_graph: bool
    line: Optional[SourceLine]
    allocation_ids: tuple[int, ...]
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["names"] = list(self.names)
        data["allocation_ids"] = list(self.allocation_ids)
        data["line"] = self.line.to_dict() if self.line else None
        return data


@dataclass(frozen=True, eq=False)
class MemoryRecording:
    """What a recorder hands over: every allocation plus the ordered alloc/free events.

    ``events[i]`` is ``alloc_id`` for an allocation and ``-(alloc_id + 1)`` for a free;
    ``event_phase[i]`` indexes :data:`PHASES`; ``iteration_starts`` are event indices where a new
    loop iteration began. ``reserved`` (CUDA) is the allocator's reserved bytes after each event.
    """

    device: str
    allocations: tuple[Allocation, ...]
    events: np.ndarray
    event_time_ns: np.ndarray
    event_phase: np.ndarray
    iteration_starts: tuple[int, ...] = ()
    reserved: Optional[np.ndarray] = None
    note: str = ""
    leaks: tuple[Leak, ...] = ()
    duration_s: float = 0.0
    snapshot: Optional[dict[str, Any]] = field(default=None, repr=False)
    allocator: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class MemorySample:
    """Live bytes by category after ``step`` events (step 0: the state when recording began)."""

    step: int
    time_s: float
    total: int
    by_category: dict[str, int]
    reserved: Optional[int] = None


@dataclass(frozen=True, eq=False)
class MemoryTimeline:
    """The memory timeline of a block of code (``%%cudamem`` / ``with memory_timeline() as tl``).

    ``allocator`` (CUDA) holds the caching allocator's state at the end: reserved, allocated, free
    bytes inside segments that also hold live blocks (fragmentation) and the largest free block.
    ``by_category[k, c]`` is the live bytes of category ``CATEGORIES[c]`` after ``steps[k]`` events
    (sample 0 is the state when recording began). ``peak_step`` is the first sample at the peak.
    """

    device: str = "cpu"
    note: str = ""
    steps: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    time_s: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    by_category: np.ndarray = field(default_factory=lambda: np.zeros((0, len(CATEGORIES)), np.int64))
    reserved: Optional[np.ndarray] = None
    start_bytes: int = 0
    final_bytes: int = 0
    peak_bytes: int = 0
    peak_step: int = 0
    peak_allocations: tuple[Allocation, ...] = ()
    category_totals: dict[str, dict[str, int]] = field(default_factory=dict)
    phases: tuple[PhaseSpan, ...] = ()
    iterations: int = 0
    leaks: tuple[Leak, ...] = ()
    allocations: tuple[Allocation, ...] = ()
    duration_s: float = 0.0
    snapshot: Optional[dict[str, Any]] = field(default=None, repr=False)
    allocator: dict[str, int] = field(default_factory=dict)

    @property
    def totals(self) -> np.ndarray:
        return self.by_category.sum(axis=1)

    @property
    def samples(self) -> list[MemorySample]:
        """Every sample as an object (convenient for small timelines; use the arrays for large ones)."""
        reserved = self.reserved
        return [MemorySample(int(self.steps[k]), float(self.time_s[k]), int(self.by_category[k].sum()),
                             dict(zip(CATEGORIES, (int(v) for v in self.by_category[k]))),
                             None if reserved is None else int(reserved[k]))
                for k in range(len(self.steps))]

    def _fill(self, other: "MemoryTimeline") -> None:
        """Copy ``other`` into this (empty) timeline: ``with memory_timeline() as tl`` fills ``tl`` at exit."""
        for name in self.__dataclass_fields__:
            object.__setattr__(self, name, getattr(other, name))

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device, "note": self.note, "categories": list(CATEGORIES),
            "samples": {"step": self.steps.tolist(), "time_s": self.time_s.tolist(),
                        "by_category": {c: self.by_category[:, i].tolist() for i, c in enumerate(CATEGORIES)},
                        "reserved": None if self.reserved is None else self.reserved.tolist()},
            "start_bytes": self.start_bytes, "final_bytes": self.final_bytes,
            "peak_bytes": self.peak_bytes, "peak_step": self.peak_step,
            "peak_allocations": [a.to_dict() for a in self.peak_allocations],
            "category_totals": self.category_totals,
            "phases": [p.to_dict() for p in self.phases], "iterations": self.iterations,
            "leaks": [leak.to_dict() for leak in self.leaks], "duration_s": self.duration_s,
            "allocator": dict(self.allocator),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MemoryTimeline":
        """The timeline :meth:`to_dict` wrote (without the allocator snapshot, which is never written)."""
        if list(d.get("categories", CATEGORIES)) != list(CATEGORIES):
            raise ValueError("this memory timeline was saved by another version of torch_nbdebug (categories differ)")
        samples = d["samples"]
        steps = np.asarray(samples["step"], dtype=np.int64)
        by_category = np.zeros((len(steps), len(CATEGORIES)), np.int64)
        for i, c in enumerate(CATEGORIES):
            by_category[:, i] = samples["by_category"][c]
        reserved = samples.get("reserved")
        return cls(device=d["device"], note=d.get("note", ""), steps=steps,
                   time_s=np.asarray(samples["time_s"], dtype=np.float64), by_category=by_category,
                   reserved=None if reserved is None else np.asarray(reserved, dtype=np.int64),
                   start_bytes=d["start_bytes"], final_bytes=d["final_bytes"], peak_bytes=d["peak_bytes"],
                   peak_step=d["peak_step"], peak_allocations=tuple(_allocation(a) for a in d["peak_allocations"]),
                   category_totals=d.get("category_totals", {}), phases=tuple(PhaseSpan(**p) for p in d["phases"]),
                   iterations=d.get("iterations", 0), leaks=tuple(_leak(leak) for leak in d.get("leaks", ())),
                   duration_s=d.get("duration_s", 0.0), allocator=dict(d.get("allocator") or {}))


def _line(d: Optional[dict[str, Any]]) -> Optional[SourceLine]:
    return SourceLine(**d) if d else None


def _allocation(d: dict[str, Any]) -> Allocation:
    return Allocation(**dict(d, shape=tuple(d["shape"]), line=_line(d.get("line"))))


def _leak(d: dict[str, Any]) -> Leak:
    return Leak(**dict(d, names=tuple(d["names"]), allocation_ids=tuple(d["allocation_ids"]),
                       line=_line(d.get("line"))))


@dataclass(frozen=True)
class LiveTensor:
    """A live tensor now, named by the variable or container that holds it (``losses[17]``)."""

    name: str
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    device: str
    category: str
    has_graph: bool = False

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["shape"] = list(self.shape)
        return data


@dataclass(frozen=True)
class MemoryState:
    """Memory now (``%cudamem``): CUDA allocator counters, or the live tensor bytes on CPU."""

    device: str
    live_bytes: int
    by_category: dict[str, int]
    top: tuple[LiveTensor, ...]
    tensor_count: int
    allocated: Optional[int] = None
    reserved: Optional[int] = None
    peak: Optional[int] = None
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["top"] = [t.to_dict() for t in self.top]
        return data
