"""nanwatch overhead on CPU: a plain training step vs detect_anomaly vs nanwatch, side by side.

    .venv/bin/python bench/bench_nanwatch.py            # MLP, CNN, GPT-2-small-like, 2-layer GPT (minutes)
    .venv/bin/python bench/bench_nanwatch.py --models gpt2 small   # the two columns of issue 11
    .venv/bin/python bench/bench_nanwatch.py --quick    # fewer repeats, shorter sequence
    .venv/bin/python bench/bench_nanwatch.py --models gpt2 --threads 1 --repeats 7
    .venv/bin/python bench/bench_nanwatch.py --models small --steps 10   # the watch left on over a 10-step loop

Every timed call is one full step (zero_grad, forward, loss, backward, optimizer.step) under the
named watcher, which is entered and left inside the timing (as a %%nanwatch cell would). Modes are
interleaved within each repeat so machine noise hits them alike; medians and ratios to the plain
step are printed, for wall-clock time and for the process's CPU time (with one thread the CPU time
is what to read on a shared, busy machine: other processes inflate the wall clock, not it). The 2-layer
GPT (``small``, d=64, seq 32) stands in for a GPU: its ops are cheap, so per-op Python work dominates.
Targets (issue 11): op mode <= 1.10x on GPT-2-small-like and <= 1.5x on the small model; module mode
<= 1.05x and <= 1.2x.

Rows: ``plain``; ``anomaly`` / ``anomaly+nan`` (``detect_anomaly(check_nan=...)``, the anchor);
``nanwatch`` (op mode, the default ``replay=True``: the per-op watch off inside a model's forward, each
module call's output checked when the model returns and a non-finite call replayed under the per-op
watch; the backward unwatched, checked per module and weight gradient and replayed when non-finite; the
per-op watch on in code outside modules, e.g. the loss); ``nanwatch-always``
(``replay=False``: the per-op watch on for the whole step, same report); ``nanwatch-module`` (module
outputs and the gradients into them only).
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import GPT, lm_loss, mlp, small_cnn, small_gpt, training_step  # noqa: E402
from timing import Summary, Timings, alternating  # noqa: E402
from torch_nbdebug.api.nanwatch import nanwatch  # noqa: E402


def mlp_case(device: str, quick: bool) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    model = mlp(784, 512, 512, 10).to(device)
    x, y = torch.randn(64, 784, device=device), torch.randint(0, 10, (64,), device=device)
    return model, lambda m: F.cross_entropy(m(x), y)


def cnn_case(device: str, quick: bool) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    model = small_cnn().to(device)
    x, y = torch.randn(16, 3, 32, 32, device=device), torch.randint(0, 10, (16,), device=device)
    return model, lambda m: F.cross_entropy(m(x), y)


def gpt2_case(device: str, quick: bool, batch: int = 2, seq: int = 64) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    seq = 32 if quick else seq
    model = GPT().to(device)
    idx = torch.randint(0, 8192, (batch, seq), device=device)
    return model, lambda m: lm_loss(m, idx[:, :-1], idx[:, 1:])


def small_case(device: str, quick: bool, batch: int = 4,
               seq: int = 32) -> tuple[nn.Module, Callable[[nn.Module], torch.Tensor]]:
    """The 2-layer GPT (d=64) of issue 11: per-op work dominates its step, as on a GPU."""
    model = small_gpt().to(device)
    idx = torch.randint(0, 512, (batch, seq + 1), device=device)
    return model, lambda m: lm_loss(m, idx[:, :-1], idx[:, 1:])


CASES = {"mlp": mlp_case, "cnn": cnn_case, "gpt2": gpt2_case, "small": small_case}


def watchers(namespace: dict[str, Any]) -> dict[str, Callable[[], ContextManager[Any]]]:
    return {
        "plain": contextlib.nullcontext,
        "anomaly": lambda: torch.autograd.detect_anomaly(check_nan=False),
        "anomaly+nan": lambda: torch.autograd.detect_anomaly(check_nan=True),
        "nanwatch": lambda: nanwatch(namespace=namespace),
        "nanwatch-always": lambda: nanwatch(replay=False, namespace=namespace),
        "nanwatch-module": lambda: nanwatch(mode="module", namespace=namespace),
    }


def run_case(name: str, device: str, repeats: int, warmup: int, quick: bool,
             sync: Callable[[], None] = lambda: None, steps: int = 1) -> dict[str, Summary]:
    """Median wall, median CPU and best CPU seconds per mode. With one thread, CPU time is robust to
    a busy machine (others' work inflates our wall clock, not our CPU time; noise only adds to it).
    ``steps``: training steps per timed call, all inside one watch (a cell with a training loop);
    the summaries are per call."""
    torch.manual_seed(0)
    model, loss_fn = CASES[name](device, quick)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    modes = watchers({"model": model, "opt": opt})

    def step(mode: str, timings: Timings) -> None:
        # The watcher is entered and left inside the timing, as a %%nanwatch cell would do it.
        def watched() -> Any:
            with modes[mode]() as report:
                for _ in range(steps):
                    training_step(opt, lambda: loss_fn(model))
            return report
        report = timings.time(mode, watched)
        if report is not None and getattr(report, "events", ()):
            raise SystemExit(f"benchmark model produced a NaN/Inf birth: {report.first.title()}")

    warm = Timings(list(modes), sync)  # warm-up rounds: run like the others, not counted
    for _ in range(warmup):
        for mode in modes:
            step(mode, warm)
    timings = Timings(list(modes), sync)
    for r in range(repeats):
        for mode in alternating(list(modes), r):  # interleaved, alternating order
            step(mode, timings)
    return timings.summaries()


def report(name: str, results: dict[str, Summary], steps: int = 1) -> None:
    plain = results["plain"]
    print(f"\n{name}: step time and ratio to the plain step "
          "(median wall clock | median process CPU time | best process CPU time)"
          + (f", {steps} steps per watch, time per step" if steps > 1 else ""))
    for mode, s in results.items():
        print(f"  {mode:16s} {s.wall / steps * 1e3:9.1f} ms {s.wall / plain.wall:5.2f}x | {s.cpu / steps * 1e3:9.1f} ms"
              f" {s.cpu / plain.cpu:5.2f}x | {s.cpu_min / steps * 1e3:9.1f} ms {s.cpu_min / plain.cpu_min:5.2f}x")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per mode (median taken)")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and a shorter GPT sequence")
    ap.add_argument("--steps", type=int, default=1,
                    help="training steps inside each watch (default 1, the issue-11 table: a one-step cell "
                         "pays the watch's start and stop at every step; 10: a cell with a training loop, the "
                         "watch left on)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be at least 1")
    torch.set_num_threads(args.threads)
    repeats = args.repeats or (3 if args.quick else 9)
    print(f"torch {torch.__version__}, CPU, {args.threads} thread(s), {repeats} interleaved repeats per mode")
    results = {}
    for name in args.models:
        reps = repeats if name == "gpt2" else repeats * 3
        results[name] = run_case(name, "cpu", reps, warmup=1, quick=args.quick, steps=args.steps)
        report(name, results[name], args.steps)
    table = "the issue-11 table" if args.steps == 1 else f"{args.steps} steps per watch"
    print(f"\nmedian process CPU time, ratio to the plain step ({table}):")
    print(f"  {'':16s}" + "".join(f"{name:>10s}" for name in results))
    for mode in next(iter(results.values())):
        print(f"  {mode:16s}" + "".join(f"{r[mode].cpu / r['plain'].cpu:9.2f}x" for r in results.values()))
    print("targets: op-precise (nanwatch, nanwatch-always) <= 1.10x gpt2, <= 1.5x small; "
          "nanwatch-module <= 1.05x gpt2, <= 1.2x small")


if __name__ == "__main__":
    main()
