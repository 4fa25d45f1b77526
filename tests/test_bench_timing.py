"""bench/timing.py's paired measure (issue 11's "median paired ratio"): each variant is timed right next
to the base, the two sides of a pair alternate, and a ratio is taken within its pair only."""
from __future__ import annotations

from typing import Any

import pytest
from bench_files import bench_module


timing = bench_module("timing")


def test_every_variant_is_timed_next_to_the_base_with_the_order_alternating() -> None:
    calls: list[str] = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("plain", "a", "b")}
    timing.paired(fns, "plain", repeats=2)
    pairs = [tuple(calls[i:i + 2]) for i in range(0, len(calls), 2)]
    assert len(pairs) == 4 and all("plain" in p and len(set(p)) == 2 for p in pairs)
    assert pairs == [("plain", "a"), ("b", "plain"), ("b", "plain"), ("plain", "a")]


def test_a_ratio_is_taken_within_its_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    """The base drifts 1 -> 10 -> 100 s over the run and a variant always takes 1.5x the base next to it:
    every paired ratio is 1.5, whichever side of its pair went first."""
    drift = [1.0, 10.0, 100.0]
    calls: list[str] = []

    def fake_clock(fn: Any, sync: Any = None) -> tuple[Any, Any]:
        name = fn()
        calls.append(name)
        base = drift[(len(calls) - 1) // 2]
        cpu = base if name == "plain" else 1.5 * base
        return timing.Sample(cpu, cpu), name

    monkeypatch.setattr(timing, "clock", fake_clock)
    seen: list[tuple[str, Any]] = []
    pairs = timing.paired({"plain": lambda: "plain", "x": lambda: "x"}, "plain", repeats=3,
                          after=lambda name, result: seen.append((name, result)))
    assert calls == ["plain", "x", "x", "plain", "plain", "x"]
    assert pairs.ratios("x") == [1.5, 1.5, 1.5] and pairs.ratio("x") == 1.5 and pairs.ratio("plain") == 1.0
    assert seen == [(name, name) for name in calls]  # ``after`` sees each call's own result
    assert pairs.summary("plain").cpu == 10.0 and pairs.summary("x").cpu_min == 1.5
    assert pairs.spread("x") == (1.5, 1.5) and pairs.names() == ["plain", "x"]


def test_a_tool_is_compared_with_its_floor_repeat_by_repeat(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 27's measure: the distance to the floor is taken within each repeat (tool ratio minus floor
    ratio there), so a repeat slowed for both sides moves neither; the line shows all three with quartiles."""
    tool = iter([2.0, 3.0, 2.5, 4.0])  # paired ratios of the tool, repeat by repeat
    floor = iter([1.5, 2.5, 2.0, 3.5])  # and of its floor: always 0.5 below the tool in the same repeat

    def fake_clock(fn: Any, sync: Any = None) -> tuple[Any, Any]:
        name = fn()
        cpu = 1.0 if name == "plain" else next(tool if name == "tool" else floor)
        return timing.Sample(cpu, cpu), name

    monkeypatch.setattr(timing, "clock", fake_clock)
    pairs = timing.paired({"plain": lambda: "plain", "tool": lambda: "tool", "floor": lambda: "floor"}, "plain",
                          repeats=4)
    assert sorted(pairs.ratios("tool")) == [2.0, 2.5, 3.0, 4.0]
    assert pairs.distance("tool", "floor") == (0.5, 0.5, 0.5)
    line = pairs.versus_floor("tool", "floor")
    assert line.startswith(f"ratio {pairs.ratio('tool'):.2f}x") and "distance +0.50x [+0.50-+0.50]" in line
