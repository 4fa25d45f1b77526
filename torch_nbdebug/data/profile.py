"""Data of ``%%profile``: why a training step is slow, as plain numbers and names.

Two levels. :class:`Capture` is what the recorder hands over (the profiler's events reduced to
tuples, the sampler's lines, the step boundaries, all on the profiler's clock in microseconds); it
lives only until :func:`torch_nbdebug.process.profile.summarize` has read it. :class:`ProfileData`
is the summary that is kept: per step the time by category, the top modules, lines and ops, one
step's timeline, the verdict. It holds no event list, so a 100-step report is a few tens of KB of JSON.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Optional

from torch_nbdebug.data.source import SourceLine
from torch_nbdebug.errors import InputError

VerdictKind = Literal["data", "host", "launch", "sync", "compute", "memory", "balanced"]
Status = Literal["finished", "stopped", "failed"]
VERDICTS: tuple[VerdictKind, ...] = ("data", "host", "launch", "sync", "compute", "memory", "balanced")

# Host time of a step, partitioned: every microsecond of a step is in exactly one of these.
CATEGORIES = ("data", "forward", "backward", "optimizer", "sync", "python")
CATEGORY_LABELS = {"data": "data loading", "forward": "forward (torch ops)", "backward": "backward",
                   "optimizer": "optimizer", "sync": "host syncs", "python": "Python outside torch ops"}
CATEGORY_COLOURS = {"data": "#bc4c00", "forward": "#0969da", "backward": "#8250df", "optimizer": "#1a7f37",
                    "sync": "#cf222e", "python": "#9a6700"}
SCHEMA = "torch_nbdebug.profile/1"


# -- what the recorder hands over (not kept) ----------------------------------------------------
@dataclass(frozen=True)
class Event:
    """One profiler event: an op, a range (module, optimizer, DataLoader) or a device activity.

    ``parent`` is the index of the enclosing event on the same thread (-1 at top level); ``device`` is
    the device time of the kernels the op launched (its own, not its children's), in microseconds.
    """

    name: str
    start: float
    end: float
    parent: int = -1
    thread: int = 0
    annotation: bool = False
    device: float = 0.0
    on_device: bool = False  # a kernel or a copy on the device's own timeline
    python: bool = False     # a Python function (recorded with stacks only): not an op


@dataclass(frozen=True)
class Sample:
    """The sampler saw the main thread at ``time`` in the user's statement ``line`` (an index into
    :attr:`Capture.lines`), ``weight`` microseconds since its previous look."""

    time: float
    line: int
    weight: float


@dataclass(frozen=True)
class Capture:
    events: tuple[Event, ...]
    samples: tuple[Sample, ...]
    lines: tuple[SourceLine, ...]
    marks: tuple[float, ...]          # optimizer step ends (profiler clock, us)
    start: float                      # when profiling started and ended (profiler clock, us)
    end: float
    main_thread: int
    device: str                       # "cpu" or "cuda"
    status: Status = "finished"
    steps_seen: int = 0               # optimizer steps in the whole cell (also those not profiled)
    notes: tuple[str, ...] = ()
    patterns: tuple["Pattern", ...] = ()
    contexts: tuple[tuple[int, tuple[str, ...]], ...] = ()   # per line: (first lineno, the lines around it)


# -- the summary that is kept -------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    """One profiled step: its number (the optimizer steps completed before it in the cell, from 0: the
    README's one step axis; DataLoader batches alike), wall time and host time by category (ms,
    adding up to ``ms``), its top-level torch ops, its copies, and on a GPU the device's busy time."""

    number: int
    ms: float
    categories: dict[str, float]
    ops: int = 0
    copy_ms: float = 0.0
    syncs: int = 0
    device_busy_ms: Optional[float] = None

    @property
    def device_idle_ms(self) -> Optional[float]:
        return None if self.device_busy_ms is None else max(0.0, self.ms - self.device_busy_ms)


@dataclass(frozen=True)
class ModuleRow:
    """A module's forward per step on average: inclusive ms, ms outside its sub-modules, calls."""

    path: str
    ms: float
    self_ms: float
    calls: float
    share: float
    ops: float = 0.0
    device_ms: Optional[float] = None


@dataclass(frozen=True)
class LineRow:
    """A statement of the user's per step on average: sampled host ms, the share of the step, the
    top-level torch ops launched from it (forward and optimizer: backward replays what the forward
    lines recorded), the device time of those ops, and what it spent in each category."""

    line: SourceLine
    ms: float
    share: float
    ops: float = 0.0
    device_ms: Optional[float] = None
    categories: dict[str, float] = field(default_factory=dict)
    context: tuple[str, ...] = ()     # the lines around it, for the view that opens it
    context_start: int = 0

    @property
    def filename(self) -> str:
        return self.line.filename

    @property
    def lineno(self) -> int:
        return self.line.lineno

    @property
    def text(self) -> str:
        return self.line.text


@dataclass(frozen=True)
class OpRow:
    name: str
    calls: float                      # per step
    ms: float                         # per step
    median_us: float
    share: float
    device_ms: Optional[float] = None


@dataclass(frozen=True)
class Segment:
    """A piece of one step's timeline (ms from the step's start) and what the host did in it."""

    start: float
    end: float
    category: str
    label: str = ""


@dataclass(frozen=True)
class Pattern:
    """One of torch's TorchTidy anti-patterns that matched: its name, what to do, how often."""

    name: str
    description: str
    count: int


@dataclass(frozen=True)
class Verdict:
    """Why the step is slow: ``kind``, the share of the step it explains, the figures that prove it,
    the line and module to look at, and the fix."""

    kind: VerdictKind
    share: float
    summary: str
    fix: str
    figures: dict[str, float] = field(default_factory=dict)
    line: Optional[SourceLine] = None
    module: Optional[str] = None

    def __str__(self) -> str:
        return f"{self.kind}: {self.summary}"


@dataclass(frozen=True)
class ProfileData:
    steps: tuple[Step, ...]
    modules: tuple[ModuleRow, ...]
    lines: tuple[LineRow, ...]
    ops: tuple[OpRow, ...]
    timeline: tuple[Segment, ...]
    timeline_step: int
    verdict: Verdict
    device: str
    step_source: str                  # "optimizer", "dataloader" or "cell"
    warmup: int
    steps_seen: int
    status: Status = "finished"
    patterns: tuple[Pattern, ...] = ()
    notes: tuple[str, ...] = ()
    trace: Optional[str] = None       # where a Chrome trace was written

    @property
    def step_ms(self) -> float:
        """The median step time (ms)."""
        times = sorted(s.ms for s in self.steps)
        return times[len(times) // 2] if times else 0.0

    def mean(self, category: str) -> float:
        """Mean ms per step in ``category``."""
        return sum(s.categories.get(category, 0.0) for s in self.steps) / len(self.steps) if self.steps else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **asdict(self)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ProfileData":
        if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
            raise InputError(f"not a %%profile report (expected schema {SCHEMA!r})")
        src = {k: v for k, v in raw.items() if k != "schema"}

        def line(d: Optional[dict[str, Any]]) -> Optional[SourceLine]:
            return None if d is None else SourceLine(**d)

        verdict = dict(src["verdict"])
        verdict["line"] = line(verdict.get("line"))
        return cls(
            steps=tuple(Step(**s) for s in src["steps"]),
            modules=tuple(ModuleRow(**m) for m in src["modules"]),
            lines=tuple(LineRow(**{**r, "line": line(r["line"]), "context": tuple(r.get("context", ()))})
                        for r in src["lines"]),
            ops=tuple(OpRow(**o) for o in src["ops"]),
            timeline=tuple(Segment(**s) for s in src["timeline"]),
            timeline_step=src["timeline_step"], verdict=Verdict(**verdict), device=src["device"],
            step_source=src["step_source"], warmup=src["warmup"], steps_seen=src["steps_seen"],
            status=src.get("status", "finished"), patterns=tuple(Pattern(**p) for p in src.get("patterns", ())),
            notes=tuple(src.get("notes", ())), trace=src.get("trace"))


@dataclass(frozen=True)
class Change:
    """One category, module or line in two profiles: ms per step before and after (0 when absent)."""

    kind: str                         # "category", "module" or "line"
    name: str
    before_ms: float
    after_ms: float

    @property
    def delta_ms(self) -> float:
        return self.after_ms - self.before_ms


@dataclass(frozen=True)
class Comparison:
    """``after.compare(before)``: the median step before and after, the verdicts, and what changed most."""

    before_ms: float
    after_ms: float
    before_verdict: VerdictKind
    after_verdict: VerdictKind
    categories: tuple[Change, ...]
    modules: tuple[Change, ...]
    lines: tuple[Change, ...]

    @property
    def speedup(self) -> float:
        """How many times faster the step is now (below 1: slower)."""
        return self.before_ms / self.after_ms if self.after_ms else float("inf")

    @property
    def verdict_changed(self) -> bool:
        return self.before_verdict != self.after_verdict
