"""nanwatch overhead on CPU: a plain training step vs detect_anomaly vs nanwatch, side by side.

    .venv/bin/python bench/bench_nanwatch.py            # MLP, CNN, GPT-2-small-like (a few minutes)
    .venv/bin/python bench/bench_nanwatch.py --quick    # fewer repeats, shorter sequence
    .venv/bin/python bench/bench_nanwatch.py --models gpt2 --threads 1 --repeats 7

Every timed call is one full step (zero_grad, forward, loss, backward, optimizer.step) under the
named watcher, which is entered and left inside the timing (as a %%nanwatch cell would). Modes are
interleaved within each repeat so machine noise hits them alike; medians and ratios to the plain
step are printed, for wall-clock time and for the process's CPU time (with one thread the CPU time
is what to read on a shared, busy machine: other processes inflate the wall clock, not it). Targets on the GPT-2-small-like step: op mode <= 1.3x, module mode <= 1.1x.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torch_nbdebug.api.nanwatch import nanwatch  # noqa: E402


class Block(nn.Module):
    """A GPT-2 block: pre-LayerNorm causal self-attention and a 4x GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(mask, float("-inf")).softmax(-1)  # intentional -inf: never reported
        y = (attn @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 8192, d: int = 768, layers: int = 12, heads: int = 12, ctx: int = 256) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def mlp_case(device: str, quick: bool) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)).to(device)
    x, y = torch.randn(64, 784, device=device), torch.randint(0, 10, (64,), device=device)
    return model, lambda m: F.cross_entropy(m(x), y)


def cnn_case(device: str, quick: bool) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 10)).to(device)
    x, y = torch.randn(16, 3, 32, 32, device=device), torch.randint(0, 10, (16,), device=device)
    return model, lambda m: F.cross_entropy(m(x), y)


def gpt2_case(device: str, quick: bool, batch: int = 2, seq: int = 64) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    seq = 32 if quick else seq
    model = GPT().to(device)
    idx = torch.randint(0, 8192, (batch, seq), device=device)
    return model, lambda m: F.cross_entropy(m(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())


CASES = {"mlp": mlp_case, "cnn": cnn_case, "gpt2": gpt2_case}


def watchers(namespace: dict[str, Any]) -> dict[str, Callable[[], ContextManager[Any]]]:
    return {
        "plain": contextlib.nullcontext,
        "anomaly": lambda: torch.autograd.detect_anomaly(check_nan=False),
        "anomaly+nan": lambda: torch.autograd.detect_anomaly(check_nan=True),
        "nanwatch": lambda: nanwatch(namespace=namespace),
        "nanwatch-module": lambda: nanwatch(mode="module", namespace=namespace),
    }


def step_fn(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor], opt: torch.optim.Optimizer,
            sync: Callable[[], None]) -> Callable[[Callable[[], ContextManager[Any]]], tuple[float, float]]:
    def step(watch: Callable[[], ContextManager[Any]]) -> tuple[float, float]:
        sync()
        wall, cpu = time.perf_counter(), time.process_time()
        with watch() as report:
            opt.zero_grad(set_to_none=True)
            loss_fn(model).backward()
            opt.step()
        sync()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if report is not None and getattr(report, "events", ()):
            raise SystemExit(f"benchmark model produced a NaN/Inf birth: {report.first.title()}")
        return wall, cpu
    return step


def run_case(name: str, device: str, repeats: int, warmup: int, quick: bool,
             sync: Callable[[], None] = lambda: None) -> dict[str, tuple[float, float, float]]:
    """Median wall, median CPU and best CPU seconds per mode. With one thread, CPU time is robust to
    a busy machine (others' work inflates our wall clock, not our CPU time; noise only adds to it)."""
    torch.manual_seed(0)
    model, loss_fn = CASES[name](device, quick)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    modes = watchers({"model": model, "opt": opt})
    step = step_fn(model, loss_fn, opt, sync)
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for _ in range(warmup):
        for watch in modes.values():
            step(watch)
    for r in range(repeats):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))  # interleaved, alternating order
        for mode in order:
            times[mode].append(step(modes[mode]))
    return {m: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v), min(c for _, c in v))
            for m, v in times.items()}


def report(name: str, results: dict[str, tuple[float, float, float]]) -> None:
    wall0, cpu0, best0 = results["plain"]
    print(f"\n{name}: step time and ratio to the plain step "
          "(median wall clock | median process CPU time | best process CPU time)")
    for mode, (wall, cpu, best) in results.items():
        print(f"  {mode:16s} {wall * 1e3:9.1f} ms {wall / wall0:5.2f}x | {cpu * 1e3:9.1f} ms {cpu / cpu0:5.2f}x"
              f" | {best * 1e3:9.1f} ms {best / best0:5.2f}x")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per mode (median taken)")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and a shorter GPT sequence")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (3 if args.quick else 9)
    print(f"torch {torch.__version__}, CPU, {args.threads} thread(s), {repeats} interleaved repeats per mode")
    for name in args.models:
        reps = repeats if name == "gpt2" else repeats * 3
        report(name, run_case(name, "cpu", reps, warmup=1, quick=args.quick))
    print("\ntargets (gpt2, fwd+bwd+optimizer watched): nanwatch <= 1.3x, nanwatch-module <= 1.1x")


if __name__ == "__main__":
    main()
