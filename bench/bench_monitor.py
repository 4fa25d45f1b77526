"""%%monitor overhead: a plain training loop vs the same loop under monitor(...), with live updates.

    .venv/bin/python bench/bench_monitor.py            # GPT-2-small-like model, 9 repeats
    .venv/bin/python bench/bench_monitor.py --quick    # 3 repeats, shorter sequence
    .venv/bin/python bench/bench_monitor.py --models gpt2 small --device cuda --steps 20

Every timed call is a block of ``--steps`` full training steps (zero_grad, forward, loss, backward,
AdamW step), entered and left inside the timing as a %%monitor cell would be. The monitored
variants watch ``loss`` and the learning rate with per-layer gradient norms and update ratios; the
"+live" one also feeds a live view the way a Jupyter kernel would: a rate limiter checked at every
step (at most 4 updates per second) and, when due, the view's panels built and serialised to JSON.
Variants are interleaved within each repeat and compared by ratios of medians (wall clock and this
process's CPU time; on a busy shared machine read the CPU column). Target: monitor+live <= 1.05x.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import GPT, lm_loss  # noqa: E402
from timing import Summary, Timings, alternating  # noqa: E402
from torch_nbdebug.api.monitor import Monitor, monitor  # noqa: E402
from torch_nbdebug.render.live import RateLimiter  # noqa: E402


class KernelLikeLive:
    """What LiveDisplay does under a kernel, minus the socket: tick, and when due build and serialise."""

    def __init__(self, mon: Monitor) -> None:
        self.mon, self.updates, self.limiter = mon, 0, RateLimiter()

    def start(self) -> None:
        self.limiter = RateLimiter()

    def tick(self) -> None:
        if self.limiter.due():
            json.dumps(self.mon.progress())
            self.updates += 1


def variants(namespace: dict[str, Any]) -> dict[str, Callable[[], ContextManager[Any]]]:
    def live() -> Monitor:
        mon = monitor("loss", "opt.param_groups[0]['lr']", namespace=namespace)
        mon.live = KernelLikeLive(mon)
        return mon

    return {
        "plain": contextlib.nullcontext,
        "monitor": lambda: monitor("loss", "opt.param_groups[0]['lr']", namespace=namespace),
        "monitor+live": live,
        "monitor-no-layers": lambda: monitor("loss", namespace=namespace, layers=False),
    }


MODELS = {
    "gpt2": lambda: GPT(),  # GPT-2-small-like: d=768, 12 layers
    "small": lambda: GPT(vocab=512, d=64, layers=2, heads=4, ctx=64),  # cheap ops: per-step Python work shows
}


def run(name: str, device: str, repeats: int, steps: int, quick: bool) -> dict[str, Summary]:
    torch.manual_seed(0)
    model = MODELS[name]().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    seq = 32 if quick or name == "small" else 64
    idx = torch.randint(0, model.head.out_features, (2, seq), device=device)
    namespace: dict[str, Any] = {"model": model, "opt": opt}
    modes = variants(namespace)
    sync = torch.cuda.synchronize if device == "cuda" else None

    def block(mode: str, timings: Timings) -> None:
        def loop() -> None:
            with modes[mode]():
                for _ in range(steps):  # the training step, with the loss where %%monitor reads it
                    opt.zero_grad(set_to_none=True)
                    loss = namespace["loss"] = lm_loss(model, idx[:, :-1], idx[:, 1:])
                    loss.backward()
                    opt.step()
        timings.time(mode, loop)

    warm = Timings(list(modes), sync)
    for mode in modes:
        block(mode, warm)
    timings = Timings(list(modes), sync)
    for r in range(repeats):
        for mode in alternating(list(modes), r):
            block(mode, timings)
    return timings.summaries()


def report(name: str, results: dict[str, Summary], steps: int) -> None:
    plain = results["plain"]
    print(f"\n{name}, {steps} steps per block: time per step and ratio to the plain loop "
          "(median wall clock | median process CPU time | best process CPU time)")
    for mode, s in results.items():
        print(f"  {mode:18s} {s.wall / steps * 1e3:9.1f} ms {s.wall / plain.wall:6.3f}x | "
              f"{s.cpu / steps * 1e3:9.1f} ms {s.cpu / plain.cpu:6.3f}x | "
              f"{s.cpu_min / steps * 1e3:9.1f} ms {s.cpu_min / plain.cpu_min:6.3f}x")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["gpt2"], choices=list(MODELS),
                    help="gpt2: GPT-2-small-like (the target); small: a 2-layer GPT whose step is mostly overhead")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--repeats", type=int, default=None, help="timed blocks per variant (median taken)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per block (default 4, quick 3)")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and a shorter sequence")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (3 if args.quick else 9)
    steps = args.steps or (3 if args.quick else 4)
    print(f"torch {torch.__version__}, {args.device}, {args.threads} thread(s), {repeats} interleaved repeats")
    for name in args.models:
        report(name, run(name, args.device, repeats, steps if name == "gpt2" else 10 * steps, args.quick),
               steps if name == "gpt2" else 10 * steps)


if __name__ == "__main__":
    main()
