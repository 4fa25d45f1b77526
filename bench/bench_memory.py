"""%%cudamem overhead on CPU: a plain training step vs memory_timeline vs torch.profiler, side by side.

    .venv/bin/python bench/bench_memory.py             # GPT-2-small-like: 12 blocks, d=768 (a few minutes)
    .venv/bin/python bench/bench_memory.py --quick     # 4 blocks, fewer repeats (under a minute)
    .venv/bin/python bench/bench_memory.py --repeats 7 --seq 64

Each timed call is one full step (zero_grad, forward, loss, backward, Adam step). The memory_timeline
variant enters and leaves the recorder inside the timing and includes building the timeline (what
%%cudamem does before drawing); the static SVG render is timed separately. The profiler variant is
``torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True)`` (what its memory
timeline needs) plus ``export_memory_timeline`` to a .json file. Variants are interleaved within each
repeat, one thread, medians printed with ratios to the plain step. Target: memory_timeline <= 1.3x.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torch_nbdebug.api.memory import memory_timeline  # noqa: E402


class Block(nn.Module):
    """Pre-LayerNorm causal self-attention + 4x GELU MLP, as in GPT-2."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.fc_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = ((q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads))
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, ctx: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_step(model: nn.Module, opt: torch.optim.Optimizer, idx: torch.Tensor, target: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        logits = model(idx)
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
        loss.backward()
        opt.step()
    return step


def time_plain(step: Callable[[], None]) -> dict[str, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    step()
    return {"total": time.perf_counter() - t0, "cpu": time.process_time() - c0}


def time_ours(step: Callable[[], None], ns: dict[str, Any], record_lines: bool = True) -> dict[str, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    with memory_timeline(ns, device="cpu", record_lines=record_lines) as tl:
        step()
    total = time.perf_counter() - t0  # recording + building the timeline (peak, categories, leaks)
    cpu = time.process_time() - c0
    t1 = time.perf_counter()
    tl.html()
    return {"total": total, "cpu": cpu, "render": time.perf_counter() - t1, "events": float(len(tl.steps) - 1)}


def line_cost(step: Callable[[], None], ns: dict[str, Any]) -> tuple[int, float]:
    """Time the recorder's source-line lookup itself (one per allocation, cached per call site)."""
    from torch_nbdebug.record.memory import MemoryRecorder

    original = MemoryRecorder._user_line
    spent, calls = [0.0], [0]

    def timed(self: Any) -> Any:
        t0 = time.thread_time()  # CPU time of this thread: other processes' load does not count
        try:
            return original(self)
        finally:
            spent[0] += time.thread_time() - t0
            calls[0] += 1

    MemoryRecorder._user_line = timed  # type: ignore[method-assign]
    try:
        with memory_timeline(ns, device="cpu"):
            step()
    finally:
        MemoryRecorder._user_line = original  # type: ignore[method-assign]
    return calls[0], spent[0]


def time_profiler(step: Callable[[], None]) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    t0, c0 = time.perf_counter(), time.process_time()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step()
    stepped, cpu = time.perf_counter() - t0, time.process_time() - c0
    with tempfile.TemporaryDirectory() as tmp:
        t1 = time.perf_counter()
        prof.export_memory_timeline(os.path.join(tmp, "mem.json"), device="cpu")
        export = time.perf_counter() - t1
    return {"total": stepped, "cpu": cpu, "export": export}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 blocks and 3 repeats: a smoke run")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--no-profiler", action="store_true", help="skip the torch.profiler comparison")
    parser.add_argument("--lines-cost", action="store_true",
                        help="also time memory_timeline(record_lines=False): the cost of naming source lines")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = args.layers or (4 if args.quick else 12)
    repeats = args.repeats or (3 if args.quick else 5)
    model = GPT(args.vocab, 768, layers, 12, 256)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq))
    target = torch.randint(0, args.vocab, (args.batch, args.seq))
    step = make_step(model, opt, idx, target)
    ns = {"model": model, "opt": opt, "idx": idx, "target": target}
    n_params = sum(p.numel() for p in model.parameters())
    print(f"GPT-like: {layers} blocks, d=768, {n_params / 1e6:.1f}M params, batch {args.batch}, seq {args.seq}, "
          f"1 thread, {repeats} interleaved repeats (medians)")
    step()  # warm-up: Adam state, allocator, lazy init
    time_ours(step, ns)
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "memory_timeline": [], "no lines": [], "profiler": []}
    for r in range(repeats):
        runs["plain"].append(time_plain(step))
        runs["memory_timeline"].append(time_ours(step, ns))
        if args.lines_cost:
            runs["no lines"].append(time_ours(step, ns, record_lines=False))
        if not args.no_profiler:
            runs["profiler"].append(time_profiler(step))
        print(f"  repeat {r + 1}/{repeats}: " + ", ".join(f"{k} {v[-1]['total']:.3f}s" for k, v in runs.items() if v),
              flush=True)
    med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in runs.items() if v}
    plain, plain_cpu = med["plain"]["total"], med["plain"]["cpu"]
    ours = med["memory_timeline"]
    print("(wall = elapsed seconds; cpu = this process's CPU seconds, less sensitive to other load on the machine)")
    print(f"plain step                          wall {plain:.3f} s   cpu {plain_cpu:.3f} s")
    print(f"memory_timeline (record + build)    wall {ours['total']:.3f} s   ratio {ours['total'] / plain:.2f}x; "
          f"cpu ratio {ours['cpu'] / plain_cpu:.2f}x (target <= 1.3x); {int(ours['events'])} events; "
          f"static SVG render {ours['render']:.3f} s")
    if "no lines" in med:
        bare = med["no lines"]
        calls, spent = line_cost(step, ns)
        print(f"memory_timeline(record_lines=False)  cpu ratio {bare['cpu'] / plain_cpu:.2f}x; source lines, timed "
              f"inside the recorder: {calls} lookups, {spent * 1e6 / max(calls, 1):.2f} us each, "
              f"{spent * 1000:.1f} ms per step")
    if "profiler" in med:
        prof = med["profiler"]
        print(f"torch.profiler(profile_memory)      wall {prof['total']:.3f} s   ratio {prof['total'] / plain:.2f}x; "
              f"cpu ratio {prof['cpu'] / plain_cpu:.2f}x; export_memory_timeline {prof['export']:.3f} s; "
              f"with export {(prof['total'] + prof['export']) / plain:.2f}x")


if __name__ == "__main__":
    main()
