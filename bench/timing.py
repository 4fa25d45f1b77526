"""Interleaved timing shared by the benchmarks: wall clock and this process's CPU time, side by side.

Not a benchmark itself (``./dev bench`` runs every ``bench/*.py``; this one only defines helpers).
The machine the benchmarks run on is shared, so variants are timed interleaved within each repeat
(machine noise then hits them alike) and compared by ratios of medians. With one thread, the process's
CPU time is the steadier measure: other processes inflate our wall clock, not our CPU time, and
contention only ever adds to it, so the minimum is the least disturbed repeat.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence, TypeVar

T = TypeVar("T")


class Sample(NamedTuple):
    """One timed call: elapsed seconds and this process's CPU seconds."""

    wall: float
    cpu: float


class Summary(NamedTuple):
    """One variant over its repeats: median wall, median CPU and least CPU seconds."""

    wall: float
    cpu: float
    cpu_min: float


def clock(fn: Callable[[], T], sync: Optional[Callable[[], None]] = None) -> tuple[Sample, T]:
    """Time ``fn()``; ``sync`` (e.g. ``torch.cuda.synchronize``) runs before the start and before the stop,
    so queued device work is neither charged to this call nor left out of it."""
    if sync is not None:
        sync()
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    if sync is not None:
        sync()
    return Sample(time.perf_counter() - wall, time.process_time() - cpu), out


def alternating(names: Sequence[str], repeat: int) -> list[str]:
    """The order of the variants in repeat number ``repeat``: as given on even repeats, reversed on odd
    ones, so no variant always runs right after the same neighbour (caches, allocator state)."""
    return list(names) if repeat % 2 == 0 else list(reversed(names))


class Timings:
    """Samples per variant, appended as interleaved repeats run; medians and minima per variant."""

    def __init__(self, names: Sequence[str], sync: Optional[Callable[[], None]] = None) -> None:
        self.samples: dict[str, list[Sample]] = {name: [] for name in names}
        self.sync = sync

    def time(self, name: str, fn: Callable[[], T]) -> T:
        """Time ``fn()`` as one sample of ``name`` and return what it returned."""
        sample, out = clock(fn, self.sync)
        self.samples[name].append(sample)
        return out

    def repeats(self, name: str) -> int:
        return len(self.samples[name])

    def median_wall(self, name: str) -> float:
        return statistics.median(s.wall for s in self.samples[name])

    def median_cpu(self, name: str) -> float:
        return statistics.median(s.cpu for s in self.samples[name])

    def min_cpu(self, name: str) -> float:
        return min(s.cpu for s in self.samples[name])

    def median_walls(self) -> dict[str, float]:
        return {name: self.median_wall(name) for name, samples in self.samples.items() if samples}

    def summary(self, name: str) -> Summary:
        return Summary(self.median_wall(name), self.median_cpu(name), self.min_cpu(name))

    def summaries(self) -> dict[str, Summary]:
        """Every variant that has samples, in the order the variants were named."""
        return {name: self.summary(name) for name, samples in self.samples.items() if samples}


def interleave(fns: Mapping[str, Callable[[], Any]], repeats: int, *, warmup: int = 0, alternate: bool = False,
               sync: Optional[Callable[[], None]] = None, budget_s: Optional[float] = None) -> Timings:
    """Call every function once per repeat, interleaved (reversing the order on odd repeats when
    ``alternate``), after ``warmup`` untimed rounds. With ``budget_s``, stop after the first repeat that
    ends past that many seconds (``Timings.repeats`` then tells how many ran)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    timings = Timings(list(fns), sync)
    start = time.perf_counter()
    for r in range(repeats):
        for name in (alternating(list(fns), r) if alternate else fns):
            timings.time(name, fns[name])
        if budget_s is not None and time.perf_counter() - start > budget_s:
            break
    return timings


def cuda_syncs(block: Callable[[], Any]) -> int:
    """How many host synchronisations ``block`` makes on CUDA (torch's sync debug mode warns at each)."""
    import warnings

    import torch

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            block()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(1 for w in caught if "synchroniz" in str(w.message).lower())


class Pairs:
    """Each variant timed right next to the base (its own pair per repeat): the ratio of the two is taken
    within the pair, so drift (the allocator, the page cache, other load) and a heavy neighbour (a
    variant that leaves the caches cold or the heap grown) hit both sides of it alike."""

    def __init__(self, base: str, names: Sequence[str]) -> None:
        self.base = base
        self.pairs: dict[str, list[tuple[Sample, Sample]]] = {name: [] for name in names if name != base}

    def ratios(self, name: str, cpu: bool = True) -> list[float]:
        """Per-pair ratios of ``name`` to the base next to it (CPU seconds, or wall-clock)."""
        pick = (lambda s: s.cpu) if cpu else (lambda s: s.wall)
        return [pick(s) / pick(b) for b, s in self.pairs[name] if pick(b) > 0]

    def ratio(self, name: str, cpu: bool = True) -> float:
        """The median paired ratio (issue 11's measure)."""
        return statistics.median(self.ratios(name, cpu)) if name != self.base else 1.0

    def spread(self, name: str) -> tuple[float, float]:
        """First and third quartile of the paired CPU ratios: how much one pair can be trusted."""
        values = sorted(self.ratios(name)) if name != self.base else [1.0]
        if len(values) < 4:
            return values[0], values[-1]
        q = statistics.quantiles(values, n=4)
        return q[0], q[2]

    def distance(self, name: str, floor: str) -> tuple[float, float, float]:
        """How far ``name`` sits above ``floor`` (issue 27's measure): the median over repeats of
        ``name``'s paired CPU ratio minus ``floor``'s in the same repeat, with the first and third
        quartiles. Both were timed in the same repeat, so load that hits a repeat hits both."""
        values = sorted(s.cpu / b.cpu - fs.cpu / fb.cpu for (b, s), (fb, fs) in zip(self.pairs[name], self.pairs[floor])
                        if b.cpu > 0 and fb.cpu > 0)
        if len(values) < 4:
            return statistics.median(values), values[0], values[-1]
        q = statistics.quantiles(values, n=4)
        return statistics.median(values), q[0], q[2]

    def versus_floor(self, name: str, floor: str) -> str:
        """One line for a tool against its floor, timed in the same run: the tool's median paired CPU
        ratio, the floor's, and the distance between them, each with its quartiles."""
        lo, hi = self.spread(name)
        f_lo, f_hi = self.spread(floor)
        d, d_lo, d_hi = self.distance(name, floor)
        return (f"ratio {self.ratio(name):.2f}x [{lo:.2f}-{hi:.2f}], floor {self.ratio(floor):.2f}x "
                f"[{f_lo:.2f}-{f_hi:.2f}], distance {d:+.2f}x [{d_lo:+.2f}-{d_hi:+.2f}]")

    def summary(self, name: str) -> Summary:
        """Median wall, median CPU and least CPU seconds of ``name`` (the base over all its pairs)."""
        if name == self.base:
            samples = [b for pairs in self.pairs.values() for b, _ in pairs]
        else:
            samples = [s for _, s in self.pairs[name]]
        return Summary(statistics.median(s.wall for s in samples), statistics.median(s.cpu for s in samples),
                       min(s.cpu for s in samples))

    def names(self) -> list[str]:
        return [self.base, *self.pairs]


def paired(fns: Mapping[str, Callable[[], Any]], base: str, repeats: int, *, warmup: int = 0,
           sync: Optional[Callable[[], None]] = None, after: Optional[Callable[[str, Any], None]] = None) -> Pairs:
    """Time every variant of ``fns`` in a pair with ``fns[base]`` (back to back, which one goes first
    alternating), ``repeats`` pairs each, the variants' order alternating over repeats, after ``warmup``
    untimed rounds of everything. ``after(name, returned)`` sees each call's result, outside the timing."""
    def timed(name: str) -> Sample:
        sample, out = clock(fns[name], sync)
        if after is not None:
            after(name, out)
        return sample

    for _ in range(warmup):
        for name in fns:
            timed(name)
    pairs = Pairs(base, list(fns))
    others = list(pairs.pairs)
    for r in range(repeats):
        for i, name in enumerate(alternating(others, r)):
            if (r + i) % 2 == 0:
                b = timed(base)
                s = timed(name)
            else:
                s = timed(name)
                b = timed(base)
            pairs.pairs[name].append((b, s))
    return pairs
