"""%%repro cost on CPU: a plain training step vs the same step under ``repro()`` (which runs it twice).

    .venv/bin/python bench/bench_repro.py            # MLP and GPT-2-small-like (a few minutes)
    .venv/bin/python bench/bench_repro.py --quick    # fewer repeats, shorter GPT sequence
    .venv/bin/python bench/bench_repro.py --models gpt2 --threads 1 --repeats 5

Every timed call is one full step (zero_grad, forward, loss, backward, AdamW step); ``repro`` snapshots
the model and optimizer, runs the step, restores, runs it again with op-by-op comparison, and builds
the report, all inside the timing (as a %%repro cell would). Variants are interleaved within each
repeat and compared by ratios of medians, for wall clock and process CPU time. Target on the
GPT-2-small-like step: repro <= 3x the plain step (it runs the step twice, so 2x is the floor).

Where the time goes (GPT-2-small-like, batch 2 x 63 tokens, AdamW, one CPU thread; process CPU time
per phase, plain step ~210/390/400 ms forward/backward/optimizer): the two runs (2x); the snapshot of
what the step writes, in run 1's optimizer phase (+~200 ms): the AdamW moments are cloned before their
first write (~0.8 GB; their clones take their place in the restored state, nothing is copied back),
the parameters are not cloned: their first write (AdamW's ``mul_``) is computed out of place into
new memory and they get their own memory back when restored; the dispatch mode and per-op Python
(~+15 ms per 1000 ops inside an optimizer step, which take a short path, ~+30 ms per 1000 forward
and backward ops); fingerprints, one integer sum of the bits per computed output (~0.7 GB per run,
weight gradients mostly; copies and views are not read) about +40 ms per run; the comparison in
flushes of 64 ops. Larger batches raise the step's compute but not the snapshot, so the ratio falls
towards 2x; glibc returns the snapshot's memory to the system at times, and the next call then
faults it in again (system time, the first call always).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import GPT, lm_loss, mlp, training_step  # noqa: E402
from timing import Summary, Timings, alternating  # noqa: E402
from torch_nbdebug.api.repro import repro  # noqa: E402


def mlp_case(quick: bool) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    model = mlp(784, 512, 512, 10)
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    return model, lambda m: F.cross_entropy(m(x), y)


def gpt2_case(quick: bool, batch: int = 2, seq: int = 64) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    seq = 32 if quick else seq
    model = GPT()
    idx = torch.randint(0, 8192, (batch, seq))
    return model, lambda m: lm_loss(m, idx[:, :-1], idx[:, 1:])


CASES = {"mlp": mlp_case, "gpt2": gpt2_case}


def run_case(name: str, repeats: int, quick: bool) -> dict[str, Summary]:
    torch.manual_seed(0)
    model, loss_fn = CASES[name](quick)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def plain() -> None:
        training_step(opt, lambda: loss_fn(model))

    def twice() -> Any:
        report = repro(plain, state={"model": model, "opt": opt})
        if not report.identical:
            raise SystemExit(f"benchmark step is not reproducible: {report.text()}")
        return report

    variants = {"plain": plain, "repro": twice}
    warm = Timings(list(variants))
    for fn_name, fn in variants.items():
        warm.time(fn_name, fn)
    timings = Timings(list(variants))
    for r in range(repeats):
        for variant in alternating(list(variants), r):
            timings.time(variant, variants[variant])
    return timings.summaries()


def report(name: str, results: dict[str, Summary]) -> None:
    plain = results["plain"]
    print(f"\n{name}: step time and ratio to the plain step "
          "(median wall clock | median process CPU time | best process CPU time)")
    for variant, s in results.items():
        print(f"  {variant:8s} {s.wall * 1e3:9.1f} ms {s.wall / plain.wall:5.2f}x | {s.cpu * 1e3:9.1f} ms"
              f" {s.cpu / plain.cpu:5.2f}x | {s.cpu_min * 1e3:9.1f} ms {s.cpu_min / plain.cpu_min:5.2f}x")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per variant (median taken)")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and a shorter GPT sequence")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (3 if args.quick else 7)
    print(f"torch {torch.__version__}, CPU, {args.threads} thread(s), {repeats} interleaved repeats per variant")
    for name in args.models:
        report(name, run_case(name, repeats if name == "gpt2" else repeats * 3, args.quick))
    print("\ntarget (gpt2, fwd+bwd+optimizer, run twice and compared): repro <= 3x the plain step")


if __name__ == "__main__":
    main()
