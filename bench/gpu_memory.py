"""%%cudamem on a CUDA device: correctness checks, then overhead against the allocator history alone and
torch.profiler(profile_memory=True), side by side. Finishes in well under 3 minutes.

    python bench/gpu_memory.py              # exits with code 2 and a clear message when there is no CUDA
    python bench/gpu_memory.py --repeats 5 --layers 12

Checks (each prints PASS/FAIL; any FAIL makes the exit code 1):
- 100 MiB allocated, freed, 50 MiB allocated: peak and final exact (allocator block sizes);
- the allocator-history setting is restored: off stays off, a user's own history stays on and keeps
  its entries;
- parameters / gradients bytes equal the model's (rounded to the allocator's 512-byte blocks);
- the exported snapshot loads in PyTorch's own ``torch.cuda._memory_viz`` parsers.
Timing: a GPT-2-small-like step (12 blocks, d=768); medians of interleaved repeats.
"""
from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import GPT, lm_loss, mlp, training_step  # noqa: E402
from timing import interleave  # noqa: E402

MIB = 1 << 20
FAILED: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'}  {name}{'  ' + detail if detail else ''}", flush=True)
    if not ok:
        FAILED.append(name)


def history_on() -> bool:
    return bool(torch._C._cuda_isHistoryEnabled())


def block(nbytes: int) -> int:
    return max(512, -(-nbytes // 512) * 512)


def correctness() -> None:
    from torch_nbdebug import memory_timeline

    with memory_timeline({}, device="cuda") as tl:
        a = torch.empty(100 * MIB, dtype=torch.uint8, device="cuda")
        del a
        b = torch.empty(50 * MIB, dtype=torch.uint8, device="cuda")
    del b
    check("known allocations: peak", tl.peak_bytes - tl.start_bytes == 100 * MIB, f"{tl.peak_bytes - tl.start_bytes}")
    check("known allocations: final", tl.final_bytes - tl.start_bytes == 50 * MIB, f"{tl.final_bytes - tl.start_bytes}")
    check("history off stays off", not history_on())

    torch.cuda.memory._record_memory_history("all", max_entries=100000)
    try:
        x = torch.ones(1000, device="cuda")
        with memory_timeline({}, device="cuda") as tl2:
            y = torch.ones(2000, device="cuda")
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
        check("user's history stays on", history_on())
        check("user's entries kept", any(e["action"] == "alloc" and e["size"] == 4096 for e in trace))
        check("only the block's events", [al.nbytes for al in tl2.allocations if al.start >= 0] == [8192],
              str([al.nbytes for al in tl2.allocations if al.start >= 0]))
        del x, y
    finally:
        torch.cuda.memory._record_memory_history(enabled=None, clear_history=True)

    model = mlp(256, 512, 10).cuda()
    opt = torch.optim.Adam(model.parameters())
    inp = torch.randn(64, 256, device="cuda")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "snap.pickle")
        with memory_timeline({"model": model, "opt": opt, "inp": inp}, device="cuda", export=path) as tl3:
            for _ in range(2):
                loss = model(inp).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        with open(path, "rb") as f:
            snap = pickle.load(f)
    params = sum(block(p.nbytes) for p in model.parameters())
    grads = sum(block(p.grad.nbytes) for p in model.parameters())
    check("parameters bytes", tl3.category_totals["parameters"]["final"] == params,
          f"{tl3.category_totals['parameters']['final']} vs {params}")
    check("gradients bytes", tl3.category_totals["gradients"]["final"] == grads,
          f"{tl3.category_totals['gradients']['final']} vs {grads}")
    check("phases seen", {p.phase for p in tl3.phases} >= {"forward", "backward", "optimizer"})
    check("no leak in a clean loop", tl3.leaks == (), str([lk.holder for lk in tl3.leaks]))
    from torch.cuda import _memory_viz

    check("snapshot loads in torch.cuda._memory_viz", "TOTAL MEM" in _memory_viz.trace(snap))
    print(tl3.text().splitlines()[0])


def overhead(layers: int, repeats: int, budget_s: float = 30.0) -> None:
    from torch.profiler import ProfilerActivity, profile

    from torch_nbdebug import memory_timeline

    torch.manual_seed(0)
    model = GPT(8192, 768, layers, 12, 256).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    idx = torch.randint(0, 8192, (8, 256), device="cuda")

    def step() -> None:
        training_step(opt, lambda: lm_loss(model, idx, idx))

    ns = {"model": model, "opt": opt, "idx": idx}

    def ours() -> None:
        with memory_timeline(ns, device="cuda"):
            step()

    def history_only() -> None:
        torch.cuda.memory._record_memory_history("all", context="all", stacks="python")
        try:
            step()
            torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None, clear_history=True)

    last_profile: list[Any] = []

    def profiler() -> None:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], profile_memory=True,
                     record_shapes=True, with_stack=True) as prof:
            step()
        last_profile[:] = [prof]

    variants = {"plain": step, "memory_timeline": ours, "history only": history_only, "profiler": profiler}
    timings = interleave(variants, repeats, warmup=1, sync=torch.cuda.synchronize,
                         budget_s=budget_s)  # gpu_check.sh gives this script 80 s in all
    if timings.repeats("plain") < repeats:
        print(f"  (stopped after {timings.repeats('plain')} repeat(s) to stay within the time budget)")
    export_times: list[float] = []
    if last_profile:  # the profiler's memory timeline is slow to build: timed once, on the last run
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            last_profile[0].export_memory_timeline(os.path.join(tmp, "m.json"), device="cuda:0")
            export_times.append(time.perf_counter() - t0)
    plain = timings.median_wall("plain")
    print(f"GPT-like {layers} blocks d=768 batch 8 seq 256 on {torch.cuda.get_device_name(0)}; "
          f"medians of {repeats} interleaved repeats")
    for name in variants:
        med = timings.median_wall(name)
        print(f"  {name:<18} {med * 1000:9.1f} ms   {med / plain:5.2f}x")
    if export_times:
        print(f"  profiler export_memory_timeline: {statistics.median(export_times):.2f} s (not in the ratio above)")


def main() -> None:
    parser = argparse.ArgumentParser(description="%%cudamem on CUDA: checks and overhead")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_memory: no CUDA device here (torch.cuda.is_available() is False); nothing to check", file=sys.stderr)
        sys.exit(2)
    start = time.perf_counter()
    correctness()
    overhead(args.layers, args.repeats)
    print(f"gpu_memory: {len(FAILED)} check(s) failed; {time.perf_counter() - start:.0f} s in all")
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
