"""Cost of record_gradients on a GPT-2-small-like and a 2-layer GPT training step, against anchors run side by side.

Each timed call is a block of 3 AdamW steps (zero_grad, forward, cross-entropy, backward, step).
Each variant is timed in pairs with the plain block, back to back (which goes first alternates): its
ratio is the median over pairs of its time over the plain one's (issue 11's "median paired ratio"; a
GPT-2 step's time depends on what ran before it, so a pair shares its neighbours). Times are the
process's CPU time, which other processes on a busy machine disturb far less than wall time:

- ``plain``: the 3 steps;
- ``foreach_norm``: plain + one ``torch._foreach_norm`` over all gradients per step, read on the host
  (the cheapest useful anchor);
- ``naive``: plain + per-parameter norm and 64-bin ``histc``, each read with ``.item()``/``.tolist()``
  (what a hand-written logger does; one host sync per parameter);
- ``record``: the 3 steps inside ``record_gradients(model)`` (default sample=4096, 64 bins), entering
  and leaving the block included (the kept steps reduced, the trace the view shows). The exact statistics
  of the last step are computed when the trace is first read, from a copy of its gradients taken at the
  block's end (issue 27's decision; at the end itself when that copy would pass 256 MB, as GPT-2-small's
  does): the phases line prints that first read's cost on its own.

The small model (d=64, sequence of 32) is the CPU stand-in for a GPU: its ops are so cheap that any
Python work per op or per parameter shows, as it would next to microsecond kernels.
The tool's floor is ``foreach_norm``: the least a per-step gradient recorder does (one batched norm over
every gradient per step, read on the host); each model prints record's ratio, the floor's and the distance
between them (per repeat, the record ratio minus the floor ratio of the same repeat), with quartiles.
Targets (issue 27): record <= 1.10x on GPT-2-small-like, <= 1.5x on the small model.
``--long`` also times 128 recorded steps of the small model (flushes included), paired with 128 plain
steps and with the floor's 128: the per-step cost of leaving the recorder on (target <= 1.25x).
Run: ``.venv/bin/python bench/bench_grads.py [--quick] [--long] [--model small|gpt2|both]``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import models  # noqa: E402
from models import GPT, lm_loss, training_step  # noqa: E402
from timing import paired  # noqa: E402
from torch_nbdebug.api.grads import record_gradients  # noqa: E402

STEPS = 3


def small_gpt() -> nn.Module:
    """The shared 2-layer GPT when bench/models.py has it, else the same model built here."""
    make = getattr(models, "small_gpt", None)
    return make() if make is not None else GPT(vocab=512, d=64, layers=2, heads=4, ctx=64)


def variants(model: nn.Module, idx: torch.Tensor) -> dict[str, Callable[[], None]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = list(model.parameters())

    def steps(after_backward: Callable[[], None] = lambda: None) -> None:
        for _ in range(STEPS):
            training_step(opt, lambda: lm_loss(model, idx, idx), after_backward)

    def norms() -> None:
        torch.stack(torch._foreach_norm([p.grad for p in params])).cpu()

    def naive() -> None:
        for p in params:
            p.grad.norm().item()
            torch.histc(p.grad, 64).tolist()

    def record() -> None:
        with record_gradients(model, name="gpt") as rec:
            steps()
        assert len(rec.steps) == STEPS and rec.step_kind == "optimizer"  # (neither reads the statistics)

    return {"plain": steps, "foreach_norm": lambda: steps(norms), "naive": lambda: steps(naive), "record": record}


def phases(fns: dict[str, Callable[[], None]], model: nn.Module, repeats: int) -> dict[str, float]:
    """Median CPU seconds of entering the block, of its steps, of leaving it (the flush of the kept steps,
    the trace) and of the trace's first read (the exact last step, when not made at the exit; then the
    flags), next to the same steps unrecorded."""
    samples: dict[str, list[float]] = {"plain steps": [], "enter": [], "recorded steps": [], "exit": [],
                                       "first read": []}
    for _ in range(repeats):
        t0 = time.process_time()
        fns["plain"]()
        t1 = time.process_time()
        rec = record_gradients(model, name="gpt")
        rec.__enter__()
        t2 = time.process_time()
        fns["plain"]()
        t3 = time.process_time()
        rec.__exit__(None, None, None)
        t4 = time.process_time()
        rec.flags  # noqa: B018 - what a view reads first
        t5 = time.process_time()
        for key, value in zip(samples, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            samples[key].append(value)
    return {key: statistics.median(values) for key, values in samples.items()}


def measure(label: str, model: nn.Module, vocab: int, seq: int, repeats: int) -> None:
    idx = torch.randint(0, vocab, (2, seq))
    n = sum(p.numel() for p in model.parameters())
    fns = variants(model, idx)
    pairs = paired(fns, "plain", repeats, warmup=1)
    print(f"{label}: {n / 1e6:.2f}M parameters in {len(list(model.parameters()))} tensors, batch 2, seq {seq}, "
          f"{STEPS} AdamW steps per call, {repeats} pairs per variant (each timed next to the plain steps); "
          "ratio = median over pairs of process CPU time over the plain one's [quartiles]")
    for name in pairs.names():
        s, (lo, hi) = pairs.summary(name), pairs.spread(name)
        print(f"  {name:<13} cpu median {s.cpu * 1e3:8.1f} ms  ratio {pairs.ratio(name):5.2f}x [{lo:4.2f}-{hi:4.2f}] | "
              f"wall ratio {pairs.ratio(name, cpu=False):5.2f}x | best cpu {s.cpu_min * 1e3:8.1f} ms", flush=True)
    print(f"  record vs its floor (foreach_norm): {pairs.versus_floor('record', 'foreach_norm')}")
    split = phases(fns, model, max(3, repeats // 3))
    plain = split["plain steps"]
    print("  record, by phase (cpu medians): " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in split.items()) +
          f"; steps while recording {split['recorded steps'] / plain:.2f}x plain, "
          f"enter+exit {(split['enter'] + split['exit']) / plain:.2f} plain blocks, "
          f"first read {split['first read'] / plain:.2f}")


def long_run(model: nn.Module, vocab: int, seq: int, repeats: int, steps: int = 128) -> None:
    """128 steps recorded (the kept steps flushed every 64 steps, the block's end included), paired with
    128 plain steps and with 128 steps of the floor: the per-step cost of leaving the recorder on."""
    idx = torch.randint(0, vocab, (2, seq))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = list(model.parameters())

    def run(after_backward: Callable[[], None] = lambda: None) -> None:
        for _ in range(steps):
            training_step(opt, lambda: lm_loss(model, idx, idx), after_backward)

    def floor() -> None:
        run(lambda: torch.stack(torch._foreach_norm([p.grad for p in params])).cpu())

    def record() -> None:
        with record_gradients(model, name="gpt") as rec:
            run()
        assert len(rec.steps) == steps

    pairs = paired({"plain": run, "foreach_norm": floor, "record": record}, "plain", repeats, warmup=1)
    plain = pairs.summary("plain").cpu / steps
    print(f"  long run, {steps} steps per call, {repeats} pairs: plain {plain * 1e3:.2f} ms/step, recorded "
          f"{pairs.summary('record').cpu / steps * 1e3:.2f} ms/step (flushes and the block's end included); "
          f"record {pairs.versus_floor('record', 'foreach_norm')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, a shorter GPT-2 sequence")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--model", choices=("small", "gpt2", "both"), default="both")
    parser.add_argument("--long", action="store_true", help="also time 128 recorded steps of the small model")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.model in ("small", "both"):
        measure("2-layer GPT (d=64)", small_gpt(), 512, 32, args.repeats or (15 if args.quick else 41))
        if args.long:
            long_run(small_gpt(), 512, 32, 3 if args.quick else 7)
    if args.model in ("gpt2", "both"):
        model = GPT(vocab=50257, tied=True, fused_attention=True)  # GPT-2's vocabulary, tied head: 124M parameters
        measure("GPT-2-small-like", model, 50257, 32 if args.quick else 64, args.repeats or (3 if args.quick else 5))


if __name__ == "__main__":
    main()
