"""%%explain recording overhead when nothing fails: a plain training step vs the same step under explain().

    .venv/bin/python bench/bench_explain.py            # GPT-2-small-like and small CNN (a few minutes)
    .venv/bin/python bench/bench_explain.py --quick    # GPT-2-small-like only, shorter sequence, fewer repeats
    .venv/bin/python bench/bench_explain.py --device cuda

Every timed call is one full step (zero_grad, forward, loss, backward, AdamW step); for the explain
variants the recorder is entered and left inside the timing, as a %%explain cell would do it. Variants
are interleaved within each repeat (alternating order) and compared by ratios of medians, wall clock and
this process's CPU time (with one thread, CPU time is what to read on a busy shared machine).
Target on the GPT-2-small-like step: explain <= 1.1x.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Any, Callable, ContextManager

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import GPT, lm_loss, small_cnn, training_step  # noqa: E402
from timing import Summary, Timings, alternating  # noqa: E402
from torch_nbdebug.api.explain import explain  # noqa: E402

TARGET = 1.1


def gpt2_case(device: str, quick: bool) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    model = GPT().to(device)
    idx = torch.randint(0, 8192, (2, 33 if quick else 65), device=device)
    return model, lambda m: lm_loss(m, idx[:, :-1], idx[:, 1:])


def cnn_case(device: str, quick: bool) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], torch.Tensor]]:
    model = small_cnn().to(device)
    x, y = torch.randn(16, 3, 32, 32, device=device), torch.randint(0, 10, (16,), device=device)
    return model, lambda m: F.cross_entropy(m(x), y)


CASES = {"gpt2": gpt2_case, "cnn": cnn_case}


def variants(namespace: dict[str, Any]) -> dict[str, Callable[[], ContextManager[Any]]]:
    return {
        "plain": contextlib.nullcontext,
        "explain": lambda: explain(namespace=namespace),
        "explain-check-indices": lambda: explain(namespace=namespace, check_indices=True),
    }


def run_case(name: str, device: str, repeats: int, quick: bool) -> dict[str, Summary]:
    torch.manual_seed(0)
    model, loss_fn = CASES[name](device, quick)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    modes = variants({"model": model, "opt": opt})
    sync = torch.cuda.synchronize if device == "cuda" else None

    def step(mode: str, timings: Timings) -> None:
        def recorded() -> None:
            with modes[mode]() as result:
                training_step(opt, lambda: loss_fn(model))
            if result is not None and result.diagnosis is not None:
                raise SystemExit(f"the benchmark step failed: {result.diagnosis.text()}")
        timings.time(mode, recorded)

    warm = Timings(list(modes), sync)
    for mode in modes:
        step(mode, warm)
    timings = Timings(list(modes), sync)
    for r in range(repeats):
        for mode in alternating(list(modes), r):
            step(mode, timings)
    return timings.summaries()


def report(name: str, results: dict[str, Summary]) -> float:
    plain = results["plain"]
    print(f"\n{name}: step time and ratio to the plain step "
          "(median wall clock | median process CPU time | best process CPU time)")
    for mode, s in results.items():
        print(f"  {mode:22s} {s.wall * 1e3:9.1f} ms {s.wall / plain.wall:5.2f}x | {s.cpu * 1e3:9.1f} ms"
              f" {s.cpu / plain.cpu:5.2f}x | {s.cpu_min * 1e3:9.1f} ms {s.cpu_min / plain.cpu_min:5.2f}x")
    return results["explain"].cpu_min / plain.cpu_min


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=None, choices=list(CASES))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    ap.add_argument("--repeats", type=int, default=None, help="timed steps per variant (median taken)")
    ap.add_argument("--quick", action="store_true", help="GPT only, a shorter sequence and 5 repeats")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    models = args.models or (["gpt2"] if args.quick else list(CASES))
    repeats = args.repeats or (5 if args.quick else 11)
    print(f"torch {torch.__version__}, {args.device}, {args.threads} thread(s), {repeats} interleaved repeats")
    ratios = {name: report(name, run_case(name, args.device, repeats, args.quick)) for name in models}
    if "gpt2" in ratios:
        verdict = "met" if ratios["gpt2"] <= TARGET else "MISSED"
        print(f"\ntarget: explain <= {TARGET}x a plain GPT-2-small-like step (best CPU time): "
              f"{ratios['gpt2']:.3f}x, {verdict}")


if __name__ == "__main__":
    main()
