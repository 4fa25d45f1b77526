"""What a script run's report costs at 64 ranks x 10,000 steps, measured on synthetic rank files.

    .venv/bin/python bench/bench_ranks.py                   # 64 ranks, 10,000 steps, 4 DDP buckets a step
    .venv/bin/python bench/bench_ranks.py --ranks 8 --steps 1000

A rank file does not grow with the steps: it keeps the last 64 collectives, the first 16 it sent NaN/Inf
into and at most --max-events births (50 by default), and the tool's report, which nanwatch bounds the same
way. So the costs are (1) the write before each collective, paid steps x buckets times per rank, and (2) the
merge at exit (read every rank file, work out the findings, write report.json and report.html), paid once.
The synthetic files are the worst case: every rank has 50 births, each with its source window, 16 sent
collectives and a full collective log. Prints each figure and the per-step cost of the writes.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torch_nbdebug.api.ranks import RunReport  # noqa: E402
from torch_nbdebug.data import ranks as data  # noqa: E402
from torch_nbdebug.record.collectives import KEEP, KEEP_SENT  # noqa: E402
from torch_nbdebug.render.ranks import page  # noqa: E402


def _report(max_events: int) -> dict:
    """A real nanwatch report with ``max_events`` births (one real birth, repeated at later steps)."""
    import dataclasses

    import torch_nbdebug

    with torch_nbdebug.nanwatch(max_events=max_events) as report:
        x = torch.zeros(16, 16, requires_grad=True)
        torch.log(x).sum().backward()
    summary = report.summary
    events = tuple(dataclasses.replace(summary.events[0], iteration=i + 1) for i in range(max_events))
    return dataclasses.replace(summary, events=events).to_dict()


def _collective(seq: int, step: int, bad: int) -> dict:
    return {"seq": seq, "op": "allreduce", "aten": "c10d.allreduce_.default", "step": step, "bucket": seq % 4,
            "shapes": [[6_553_600]], "dtypes": ["float32"], "sent_nonfinite": bad, "file": "/work/train.py",
            "line": 84, "function": "train", "state": "issued", "started": 1.7e9, "duration_s": 0.0123}


def part(rank: int, world: int, steps: int, buckets: int, report: dict) -> dict:
    total = steps * buckets
    births = [{"step": i, "order": i, "event": e} for i, e in enumerate(report["events"])]
    return data.rank_part(
        "nanwatch", rank, world, host="node", pid=1000 + rank, argv=["train.py"], status="finished", exit_code=0,
        steps=steps, updated=1.7e9, report=report, births=births,
        collectives=[_collective(total - KEEP + i, steps - 1, 0) for i in range(KEEP)], collectives_total=total,
        sent=[_collective(i, i // buckets, 5) for i in range(KEEP_SENT)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--buckets", type=int, default=4, help="DDP gradient buckets (collectives) per step")
    parser.add_argument("--max-events", type=int, default=50)
    args = parser.parse_args()
    report = _report(args.max_events)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        docs = [part(r, args.ranks, args.steps, args.buckets, report) for r in range(args.ranks)]
        # (1) the write before a collective: one rank's document while it runs (no report yet), dumped and renamed
        running = {**docs[0], "ranks": [dict(docs[0]["ranks"][0], report=None, status="running")]}
        births = json.dumps(running["ranks"][0]["births"])  # encoded when they change, not at every write
        n = 100
        t0 = time.perf_counter()
        for _ in range(n):
            data.write_atomic(data.rank_file(out, 0), running, {"births": births})
        write_s = (time.perf_counter() - t0) / n
        running_bytes = data.rank_file(out, 0).stat().st_size
        for doc in docs[1:]:
            data.write_atomic(data.rank_file(out, doc["ranks"][0]["rank"]), doc)
        data.write_atomic(data.rank_file(out, 0), docs[0])
        rank_bytes = data.rank_file(out, 0).stat().st_size
        # (2) the merge: read, findings, report.json, report.html
        t0 = time.perf_counter()
        merged = RunReport(data.read(out))
        t1 = time.perf_counter()
        data.write_atomic(out / data.REPORT_FILE, merged.document)
        t2 = time.perf_counter()
        (out / data.HTML_FILE).write_text(page(merged.html(), "bench"), encoding="utf-8")
        t3 = time.perf_counter()
        json_bytes = (out / data.REPORT_FILE).stat().st_size
        html_bytes = (out / data.HTML_FILE).stat().st_size
    unthrottled = write_s * args.steps * args.buckets
    print(f"{args.ranks} ranks x {args.steps:,} steps x {args.buckets} collectives a step, "
          f"{args.max_events} births a rank (torch {torch.__version__})")
    print(f"rank file while running: {running_bytes / 1024:.0f} KiB; one write before a collective: "
          f"{write_s * 1e3:.2f} ms -> {write_s * args.buckets * 1e3:.2f} ms a step, {unthrottled:.0f} s a rank over "
          f"the run; final rank file {rank_bytes / 1024:.0f} KiB")
    print(f"merge at exit: read + findings {t1 - t0:.2f} s, report.json {t2 - t1:.2f} s "
          f"({json_bytes / 2 ** 20:.1f} MiB), report.html {t3 - t2:.2f} s ({html_bytes / 2 ** 20:.1f} MiB)")


if __name__ == "__main__":
    main()
