"""The profile summary and the verdict rules on hand-built captures: the partition adds up, the sync verdict
on a fake CUDA step (and never on CPU), balanced, memory, device idle, line attribution, compare."""
from __future__ import annotations

from typing import Any

import pytest

from torch_nbdebug.data.profile import Capture, Event, LineRow, ProfileData, Sample
from torch_nbdebug.data.source import SourceLine
from torch_nbdebug.process.profile import partition, summarize, _Tree
from torch_nbdebug.process.profile_compare import compare
from torch_nbdebug.process.profile_verdict import Figures, decide

CELL = "/tmp/ipykernel_1/123.py"
LINES = (SourceLine(CELL, 3, "<module>", "loss = model(x).sum()", 5),
         SourceLine(CELL, 5, "<module>", "total += loss.item()", 5),
         SourceLine(CELL, 6, "<module>", "opt.step()", 5))


def ev(name: str, start: float, end: float, parent: int = -1, **kw: Any) -> Event:
    return Event(name, start, end, parent, **kw)


def step_events(t0: float, sync_us: float, device: bool) -> list[Event]:
    """One step from t0 (us): forward 0-300 (a module with a linear), .item() 300-300+sync with a
    cudaStreamSynchronize inside, then the optimizer for 100 us; on a device, a kernel of 250 us."""
    out = [ev("module: model", t0, t0 + 300), ev("aten::linear", t0 + 10, t0 + 290)]
    out.append(ev("aten::item", t0 + 300, t0 + 310 + sync_us))
    out.append(ev("cudaStreamSynchronize", t0 + 305, t0 + 305 + sync_us))
    out.append(ev("Optimizer.step#SGD.step", t0 + 320 + sync_us, t0 + 420 + sync_us, annotation=True))
    if device:
        out.append(ev("void gemm_kernel", t0 + 20, t0 + 270, on_device=True))
    return out


def capture(device: str, sync_us: float = 2000.0, steps: int = 4) -> Capture:
    events: list[Event] = []
    marks: list[float] = []
    samples: list[Sample] = []
    t = 0.0
    length = 500 + sync_us
    for _ in range(steps):
        chunk = step_events(t, sync_us, device == "cuda")
        offset = len(events)
        for e in chunk:  # parents: the linear is in the module range, the sync in the item op
            parent = -1
            if e.name == "aten::linear":
                parent = offset
            elif e.name == "cudaStreamSynchronize":
                parent = offset + 2
            events.append(Event(e.name, e.start, e.end, parent, 0, e.annotation, e.device, e.on_device))
        samples += [Sample(t + 150, 0, 150), Sample(t + 300 + sync_us / 2, 1, sync_us / 2), Sample(t + 380 + sync_us, 2, 50)]
        t += length
        marks.append(t)
    return Capture(events=tuple(events), samples=tuple(samples), lines=LINES, marks=tuple(marks), start=0.0, end=t,
                   main_thread=0, device=device, steps_seen=steps, contexts=((1, ("a", "b")),) * 3)


def test_a_step_waiting_in_cuda_syncs_is_sync_bound_and_names_the_item_line() -> None:
    data = summarize(capture("cuda"), warmup=1)
    assert len(data.steps) == 3
    v = data.verdict
    assert v.kind == "sync"
    assert v.line is not None and v.line.text == "total += loss.item()"
    assert v.figures["syncs_per_step"] == 1
    step = data.steps[0]
    assert step.categories["sync"] == pytest.approx(2.0)  # ms
    assert sum(step.categories.values()) == pytest.approx(step.ms)
    assert step.device_busy_ms == pytest.approx(0.25) and step.device_idle_ms == pytest.approx(step.ms - 0.25)


def test_the_same_events_on_cpu_are_never_sync_bound() -> None:
    data = summarize(capture("cpu"), warmup=1)
    assert data.verdict.kind != "sync"
    assert all(s.categories["sync"] == 0 for s in data.steps)
    assert data.steps[0].device_busy_ms is None


def test_a_short_sync_is_not_the_verdict() -> None:
    assert summarize(capture("cuda", sync_us=20.0), warmup=1).verdict.kind != "sync"


def test_the_partition_gives_each_microsecond_to_the_highest_priority_interval() -> None:
    cap = capture("cuda", steps=1)
    segments = partition(_Tree(cap), cap)
    assert segments[0].start == 0 and segments[-1].end == cap.end
    assert all(a.end == b.start for a, b in zip(segments, segments[1:]))
    by = {(s.category, s.label) for s in segments}
    assert ("sync", "cudaStreamSynchronize") in by and ("forward", "aten::linear") in by
    assert ("optimizer", "Optimizer.step#SGD.step") in by
    # the item op around the sync shows as forward only before and after the sync
    item = [s for s in segments if s.label == "aten::item"]
    assert sum(s.end - s.start for s in item) == pytest.approx(10.0)


def test_modules_and_lines_per_step() -> None:
    data = summarize(capture("cpu", steps=3), warmup=0)
    (model,) = data.modules
    assert model.path == "model" and model.calls == 1 and model.ms == pytest.approx(0.3)
    assert model.ops == 1
    rows = {r.text: r for r in data.lines}
    assert rows["loss = model(x).sum()"].ops == 1  # the linear started in the window of that look
    assert rows["total += loss.item()"].ms == pytest.approx(1.0)


def figures(**shares: float) -> Figures:
    base = dict.fromkeys(("data", "forward", "backward", "optimizer", "sync", "python"), 0.0)
    base.update(shares)
    return Figures(10.0, base, 40, 50.0, 0.0, 0, "cpu", None)


def test_the_rules_in_order() -> None:
    assert decide(figures(forward=0.3, backward=0.3, python=0.2, data=0.2)).kind == "compute"
    assert decide(figures(forward=0.3, python=0.3, data=0.3, optimizer=0.1)).kind == "balanced"
    assert decide(figures(python=0.5, forward=0.5)).kind == "host"
    assert decide(figures(data=0.45, forward=0.55)).kind == "data"
    assert decide(figures(sync=0.9)).kind != "sync"  # not on CPU
    f = figures(forward=0.9)
    memory = Figures(f.step_ms, f.shares, 40, 500.0, 0.5, 0, "cpu", None)
    assert decide(memory).kind == "memory" and "pin_memory" in decide(memory).fix
    launch = Figures(f.step_ms, f.shares, 800, 4.0, 0.0, 0, "cpu", None)
    assert decide(launch).kind == "launch"
    slow_ops = Figures(f.step_ms, f.shares, 800, 400.0, 0.0, 0, "cpu", None)
    assert decide(slow_ops).kind == "compute"


def test_compare_matches_cell_lines_by_their_text_across_reruns() -> None:
    before = summarize(capture("cuda"), warmup=1)
    after_lines = tuple(LineRow(SourceLine("/tmp/ipykernel_1/999.py", r.lineno, r.line.function, r.text, 9),
                                r.ms / 2, r.share) for r in before.lines)
    from dataclasses import replace

    after = replace(before, lines=after_lines)
    change = compare(before, after)
    assert {c.name for c in change.lines} == {r.text for r in before.lines}
    assert all(c.delta_ms < 0 for c in change.lines)
    assert not change.verdict_changed


def test_json_round_trip_keeps_everything() -> None:
    data = summarize(capture("cuda"), warmup=1)
    assert ProfileData.from_dict(data.to_dict()) == data
