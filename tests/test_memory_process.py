"""%cudamem processors on hand-built data: series, peak, leaks, decimation at 1e6 events, snapshots."""
from __future__ import annotations

import pickle
import time
from typing import Any

import numpy as np

from torch_nbdebug.data.memory import CATEGORIES, Allocation, MemoryRecording, MemoryTimeline
from torch_nbdebug.data.source import SourceLine
from torch_nbdebug.process.memory import (
    build_timeline, category_series, cpu_snapshot, decimate, find_leaks, window,
)
from torch_nbdebug.record.memory.cuda import recording_from_snapshot

LINE = SourceLine("<cell>", 3, "<module>", "losses.append(loss)")


def alloc(i: int, nbytes: int, category: str, start: int, end: int | None = None, **kw: Any) -> Allocation:
    return Allocation(id=i, nbytes=nbytes, shape=(nbytes // 4,), dtype="float32", category=category,
                      phase=kw.pop("phase", "forward"), start=start, end=end, **kw)


def recording(allocs: list[Allocation], events: list[int], **kw: Any) -> MemoryRecording:
    n = len(events)
    return MemoryRecording(device="cpu", allocations=tuple(allocs), events=np.asarray(events, np.int64),
                           event_time_ns=np.arange(n, dtype=np.int64) * 1000,
                           event_phase=np.asarray(kw.pop("phases", [1] * n), np.int8), **kw)


def test_series_peak_and_totals_from_hand_built_events() -> None:
    allocs = [alloc(0, 1000, "parameters", -1), alloc(1, 100, "activations", 0, 2),
              alloc(2, 50, "temporaries", 1, 3), alloc(3, 30, "other", 4)]
    rec = recording(allocs, [1, 2, -2, -3, 3], phases=[1, 1, 2, 2, 3])
    tl = build_timeline(rec)
    assert tl.totals.tolist() == [1000, 1100, 1150, 1050, 1000, 1030]
    assert tl.peak_bytes == 1150 and tl.peak_step == 2
    assert [a.id for a in tl.peak_allocations] == [0, 1, 2]
    assert tl.category_totals["activations"] == {"start": 0, "peak": 100, "max": 100, "final": 0, "allocated": 100}
    assert [(p.phase, p.start, p.end) for p in tl.phases] == [("forward", 1, 2), ("backward", 3, 4), ("optimizer", 5, 5)]
    assert category_series(allocs, rec.events).shape == (6, len(CATEGORIES))


def test_category_totals_are_the_sums_over_allocations() -> None:
    """The totals come from arrays shared with the series: each equals its definition row by row, and
    the series is what the allocations alive at each sample add up to (the samples users read)."""
    rng = np.random.default_rng(0)
    allocs, events = [], []
    for i in range(200):
        start = -1 if i < 20 else len(events)
        if start >= 0:
            events.append(i)
        end = len(events) if rng.random() < 0.6 else None
        if end is not None:
            events.append(-(i + 1))
        allocs.append(alloc(i, int(rng.integers(1, 10**9)) * 1000, CATEGORIES[int(rng.integers(len(CATEGORIES)))],
                            start, end))
    tl = build_timeline(recording(allocs, events))
    for c, name in enumerate(CATEGORIES):
        mine = [a for a in allocs if a.category == name]
        alive = [[a.nbytes for a in mine if a.alive_at(s)] for s in range(len(tl.steps))]
        assert tl.by_category[:, c].tolist() == [sum(x) for x in alive]
        assert tl.category_totals[name] == {
            "start": sum(alive[0]), "peak": sum(alive[tl.peak_step]), "max": max(sum(x) for x in alive),
            "final": sum(alive[-1]), "allocated": sum(a.nbytes for a in mine if a.start >= 0)}
        assert all(type(v) is int for v in tl.category_totals[name].values())


def test_leaks_grouped_by_container_with_graph_and_saved_activations() -> None:
    allocs = [alloc(i, 4, "other", i, holder=f"losses[{i}]", has_graph=True, line=LINE) for i in range(3)]
    allocs += [alloc(3, 400, "activations", 3), alloc(4, 8, "other", 4, holder="x"),
               alloc(5, 16, "parameters", 5, holder="model.w"), alloc(6, 4, "temporaries", 6, 7)]
    leaks = find_leaks(allocs)
    assert len(leaks) == 1
    leak = leaks[0]
    assert leak.holder == "losses" and leak.names == ("losses[0]", "losses[1]", "losses[2]")
    assert leak.has_graph and leak.line == LINE
    assert leak.count == 4 and leak.nbytes == 412 and set(leak.allocation_ids) == {0, 1, 2, 3}


def test_no_leak_when_only_results_and_state_survive() -> None:
    allocs = [alloc(0, 8, "other", 0, holder="out", has_graph=True), alloc(1, 16, "gradients", 1),
              alloc(2, 4, "temporaries", 2, 3), alloc(3, 16, "optimizer_state", 3)]
    assert find_leaks(allocs) == ()


def test_unreachable_memory_is_reported() -> None:
    leaks = find_leaks([alloc(0, 64, "temporaries", 0)])
    assert len(leaks) == 1 and "not reachable" in leaks[0].holder


def test_decimation_keeps_extremes_of_a_million_events() -> None:
    rng = np.random.default_rng(0)
    totals = np.cumsum(rng.integers(-1000, 1001, size=1_000_000)) + 10_000_000
    totals[123_457] += 5_000_000  # a one-event spike must survive
    t0 = time.perf_counter()
    idx = decimate(totals, 1000)
    elapsed = time.perf_counter() - t0
    assert len(idx) <= 1002 and np.all(np.diff(idx) > 0)
    assert 123_457 in idx and int(np.argmin(totals)) in idx
    assert idx[0] == 0 and idx[-1] == len(totals) - 1
    assert elapsed < 1.0, f"decimating 1e6 samples took {elapsed:.2f}s"
    # Every bucket's max is kept: the decimated curve's envelope equals the original's per bucket.
    width = -(-len(totals) // 499)
    kept = set(idx.tolist())
    for b in range(0, len(totals), width * 50):
        seg = totals[b:b + width]
        assert b + int(np.argmax(seg)) in kept


def test_window_on_a_million_event_timeline_is_fast_and_consistent() -> None:
    n = 1_000_001
    rng = np.random.default_rng(1)
    by_cat = np.abs(rng.integers(0, 1000, size=(n, len(CATEGORIES)))).astype(np.int64)
    tl = MemoryTimeline(steps=np.arange(n, dtype=np.int64), time_s=np.linspace(0, 1, n), by_category=by_cat,
                        peak_bytes=int(by_cat.sum(1).max()), peak_step=int(by_cat.sum(1).argmax()))
    t0 = time.perf_counter()
    full = window(tl, 0, n - 1, max_points=1200)
    zoom = window(tl, 400_000, 400_500, max_points=1200)
    elapsed = time.perf_counter() - t0
    assert elapsed < 2.0
    assert len(full["steps"]) <= 1202 and full["lo"] == 0 and full["hi"] == n - 1
    assert zoom["steps"] == list(range(400_000, 400_501))  # zoomed in far enough: every sample
    for k, step in enumerate(full["steps"][:50]):
        assert [full["series"][c][k] for c in range(len(CATEGORIES))] == by_cat[step].tolist()


def test_cpu_snapshot_is_pytorchs_format() -> None:
    from torch.cuda import _memory_viz

    allocs = [alloc(0, 1000, "parameters", -1, address=4096, line=LINE),
              alloc(1, 100, "activations", 0, 1, address=8192), alloc(2, 60, "other", 2, address=9000)]
    tl = build_timeline(recording(allocs, [1, -2, 2]))
    snap = pickle.loads(pickle.dumps(cpu_snapshot(tl)))
    actions = [e["action"] for e in snap["device_traces"][0]]
    assert actions == ["alloc", "free_requested", "free_completed", "alloc"]
    assert snap["device_traces"][0][0]["category"] == "activations"
    assert sorted(s["address"] for s in snap["segments"]) == [4096, 9000]
    assert "TOTAL MEM" in _memory_viz.trace(snap)  # PyTorch's own parsers read it
    assert "segments: 2" in _memory_viz.segsum(snap)
    assert "add_local_files" in _memory_viz.trace_plot(snap)


def hand_snapshot() -> dict[str, Any]:
    """What ``torch.cuda.memory._snapshot()`` returns, written by hand: one 2 MiB segment."""
    mib = 1 << 20
    frames = [{"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
              {"filename": "<ipython-input-3>", "line": 2, "name": "<module>"}]
    trace = [
        {"action": "segment_alloc", "addr": 0x1000000, "size": 2 * mib, "stream": 0, "time_us": 10, "frames": []},
        {"action": "alloc", "addr": 0x1000000, "size": 512, "stream": 0, "time_us": 11, "frames": frames},
        {"action": "alloc", "addr": 0x1000200, "size": 1024, "stream": 0, "time_us": 12, "frames": frames},
        {"action": "free_requested", "addr": 0x1000000, "size": 512, "stream": 0, "time_us": 13, "frames": []},
        {"action": "free_completed", "addr": 0x1000000, "size": 512, "stream": 0, "time_us": 13, "frames": []},
        {"action": "free_completed", "addr": 0x2000000, "size": 2048, "stream": 0, "time_us": 14, "frames": []},
    ]
    segments = [
        {"device": 0, "address": 0x1000000, "total_size": 2 * mib, "stream": 0, "segment_type": "large",
         "allocated_size": 1024, "active_size": 1024,
         "blocks": [{"address": 0x1000000, "size": 512, "state": "inactive", "frames": []},
                    {"address": 0x1000200, "size": 1024, "state": "active_allocated", "frames": frames},
                    {"address": 0x1000600, "size": 2 * mib - 1536, "state": "inactive", "frames": []}]},
        {"device": 0, "address": 0x3000000, "total_size": 2 * mib, "stream": 0, "segment_type": "large",
         "allocated_size": 4096, "active_size": 4096,
         "blocks": [{"address": 0x3000000, "size": 4096, "state": "active_allocated", "frames": []},
                    {"address": 0x3001000, "size": 2 * mib - 4096, "state": "inactive", "frames": []}]},
    ]
    return {"segments": segments, "device_traces": [trace]}


def test_cuda_snapshot_parsing_joins_categories_and_reserved() -> None:
    tag = [alloc(0, 500, "activations", 0, 2, address=0x1000000, module="model.fc"),
           alloc(1, 1000, "gradients", 1, address=0x1000200, holder="model.fc.weight.grad")]
    tagged = recording(tag, [0, 1, -1])
    rec = recording_from_snapshot(hand_snapshot(), 0, tagged=tagged, note="")
    tl = build_timeline(rec)
    by_addr = {a.address: a for a in tl.allocations}
    assert by_addr[0x1000000].category == "activations" and by_addr[0x1000000].nbytes == 512
    assert by_addr[0x1000000].module == "model.fc"
    assert by_addr[0x1000200].category == "gradients" and by_addr[0x1000200].holder == "model.fc.weight.grad"
    assert by_addr[0x1000200].line == SourceLine("<ipython-input-3>", 2, "<module>", "")
    assert by_addr[0x2000000].start == -1 and by_addr[0x2000000].end is not None  # freed, existed before
    assert by_addr[0x3000000].start == -1 and by_addr[0x3000000].end is None      # alive throughout
    # allocated: start 2048 + 4096; +512, +1024, -512, -2048
    assert tl.totals.tolist() == [6144, 6656, 7680, 7168, 5120]
    assert tl.peak_bytes == 7680
    # reserved: 2 MiB before the trace's segment_alloc, 4 MiB after
    assert tl.reserved.tolist() == [2 << 20] + [4 << 20] * 4
    # end state: two 2 MiB segments, 1024 + 4096 live; the free holes of both segments are fragmentation
    assert tl.allocator == {"reserved": 4 << 20, "allocated": 5120, "free_in_used_segments": (4 << 20) - 5120,
                            "largest_free_block": (2 << 20) - 1536, "segments": 2}
    from torch_nbdebug.render.memory import timeline_text

    assert "fragmentation: 4.0 MiB free inside segments in use" in timeline_text(tl)


def test_cuda_snapshot_start_time_filters_older_history() -> None:
    rec = recording_from_snapshot(hand_snapshot(), 0, tagged=None, start_us=12.5)
    assert [int(e) for e in rec.events] == [-1, -2]  # only the two frees after our start
    assert all(a.start == -1 for a in rec.allocations)


def test_models_kept_per_batch_in_a_list_are_a_leak() -> None:
    allocs = [alloc(i, 64, "parameters", i, holder=f"models[{i}].fc.weight") for i in range(3)]
    allocs += [alloc(3, 64, "parameters", 3, holder="model.fc.weight"),
               alloc(4, 64, "optimizer_state", 4, holder="opt.state[model.fc.weight]['exp_avg']")]
    leaks = find_leaks(allocs)
    assert [(leak.holder, leak.count) for leak in leaks] == [("models", 3)]
