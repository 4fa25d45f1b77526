"""%%profile overhead on CPU: plain steps vs profile() with its summary vs torch.profiler, side by side.

    .venv/bin/python bench/bench_profile.py            # 2-layer GPT (d=64) and a 4-block GPT (d=256)
    .venv/bin/python bench/bench_profile.py --quick    # the small model only, fewer pairs
    .venv/bin/python bench/bench_profile.py --steps 10 --repeats 15

Each timed call runs the same ``--steps`` training steps (zero_grad, forward, loss, backward, Adam):

- plain: the steps alone;
- profile: ``with torch_nbdebug.profile(warmup=1) as prof:`` around them, leaving the block (the summary:
  steps, categories, modules, lines, ops, the verdict) and ``prof.text()``;
- anchor: ``torch.profiler.profile(record_shapes=True, with_stack=True)`` around them and
  ``key_averages(group_by_stack_n=5).table()``: what a user runs to get ops and their source lines
  out of torch.profiler (issue 24's cost anchor).

Each variant is timed in pairs with a plain run, back to back (which goes first alternates), one thread;
its ratio is the median over pairs of its time over the plain one's, with the quartiles. CPU time is
this process's (the line sampler's thread included). Target (issue 24): profile no dearer than the anchor.
The profiler's C++ log lines on fd 2 are silenced while timing (bench output only).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_memory import quiet_fd2  # noqa: E402
from models import GPT, lm_loss, training_step  # noqa: E402
from timing import paired  # noqa: E402
from torch_nbdebug.api.profile import profile  # noqa: E402


def steps_of(model: torch.nn.Module, opt: torch.optim.Optimizer, idx: torch.Tensor, target: torch.Tensor,
             n: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(n):
            training_step(opt, lambda: lm_loss(model, idx, target))
    return run


def profiled(run: Callable[[], None], ns: dict[str, Any]) -> Any:
    with quiet_fd2():
        with profile(ns, warmup=1, steps=None) as prof:
            run()
        prof.text()
    return prof


def anchored(run: Callable[[], None]) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with quiet_fd2():
        with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof:
            run()
        return prof.key_averages(group_by_stack_n=5).table(sort_by="self_cpu_time_total", row_limit=20)


def measure(label: str, model: torch.nn.Module, vocab: int, seq: int, batch: int, steps: int, repeats: int) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    idx, target = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
    run = steps_of(model, opt, idx, target, steps)
    ns = {"model": model, "opt": opt}
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{label}, {n_params / 1e6:.2f}M params, batch {batch}, seq {seq}, {steps} steps per call, 1 thread, "
          f"{repeats} pairs per variant")
    run()
    verdicts: list[str] = []
    pairs = paired({"plain": run, "profile": lambda: profiled(run, ns), "anchor": lambda: anchored(run)}, "plain",
                   repeats, warmup=1,
                   after=lambda name, out: verdicts.append(out.verdict.kind) if name == "profile" else None)
    plain = pairs.summary("plain")
    print(f"plain {steps} steps: wall {plain.wall * 1000:.1f} ms, cpu {plain.cpu * 1000:.1f} ms")
    for name, what in (("profile", "profile() + summary + text"),
                       ("anchor", "torch.profiler(record_shapes, with_stack) + key_averages table")):
        lo, hi = pairs.spread(name)
        print(f"  {what:62s} cpu paired ratio {pairs.ratio(name):.2f}x [{lo:.2f}-{hi:.2f}], "
              f"wall {pairs.ratio(name, cpu=False):.2f}x")
    ours, anchor = pairs.ratio("profile"), pairs.ratio("anchor")
    print(f"  profile / anchor: {ours / anchor:.2f} ({'within' if ours <= anchor else 'ABOVE'} the target); "
          f"verdicts seen: {sorted(set(verdicts))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the small model only, 5 pairs")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    repeats = args.repeats or (5 if args.quick else 11)
    measure("2-layer GPT (d=64)", GPT(512, 64, 2, 4, 64), 512, 32, 2, args.steps, repeats)
    if not args.quick:
        measure("4-block GPT (d=256)", GPT(2048, 256, 4, 4, 128), 2048, 64, 4, args.steps, repeats)


if __name__ == "__main__":
    main()
