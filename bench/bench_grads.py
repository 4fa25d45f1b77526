"""Cost of record_gradients on a GPT-2-small-like training step, against anchors run side by side.

Variants, interleaved within every repeat (the machine is shared, so only ratios measured in the
same run mean anything; medians of repeats; CPU time of the process, which other processes on a
busy machine disturb far less than wall time):

- ``plain``: zero_grad, forward, cross-entropy, backward, AdamW step;
- ``foreach_norm``: plain + ``torch._foreach_norm`` over all gradients (the cheapest useful anchor);
- ``naive``: plain + per-parameter norm and 64-bin ``histc``, each read with ``.item()``/``.tolist()``
  (what a hand-written logger does; one host sync per parameter);
- ``record``: plain inside ``record_gradients(model)`` (default sample=4096, 64 bins), steady state;
  ``record_first``: the first step of a block, which is also recorded at the end of its backward
  (until an optimizer has stepped, a step is a backward pass).

The one-off costs of entering and leaving the block (the exact recomputation of the last step
over every element) are printed separately. Run: ``.venv/bin/python bench/bench_grads.py [--quick]``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import GPT, lm_loss, training_step  # noqa: E402
from timing import Timings, clock  # noqa: E402
from torch_nbdebug.api.grads import record_gradients  # noqa: E402
from torch_nbdebug.record.grads_stats import Sampler, sampled_rows  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and a shorter sequence")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    repeats = args.repeats or (3 if args.quick else 7)
    seq = args.seq or (32 if args.quick else 64)
    model = GPT(vocab=50257, tied=True, fused_attention=True)  # GPT-2's vocabulary, tied head: 124M parameters
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    idx = torch.randint(0, 50257, (args.batch, seq))
    params = list(model.parameters())
    n = sum(p.numel() for p in params)

    def step(after_backward: Callable[[], None] = lambda: None) -> None:
        training_step(opt, lambda: lm_loss(model, idx, idx), after_backward)

    def norms() -> None:
        torch.stack(torch._foreach_norm([p.grad for p in params])).cpu()

    def naive() -> None:
        for p in params:
            p.grad.norm().item()
            torch.histc(p.grad, 64).tolist()

    names = ("plain", "foreach_norm", "naive", "record", "record_first")
    timings = Timings(names)
    enter_exit: list[float] = []
    sampler = Sampler(params, 4096)
    present = tuple(range(len(params)))

    def record_work() -> None:
        """What the recorder adds to one step, alone: gather w, all statistics, gather w again."""
        sampler.gather(params, present, params[0].device)
        out = sampled_rows(params, present, sampler, 64)
        sampler.gather(params, present, params[0].device)
        out["raw"].cpu()

    work: list[float] = []
    step()  # warm up allocator and AdamW state
    for _ in range(repeats):
        work.append(clock(record_work)[0].cpu)
        timings.time("plain", step)
        timings.time("foreach_norm", lambda: step(norms))
        timings.time("naive", lambda: step(naive))
        c0 = time.process_time()
        with record_gradients(model, name="gpt") as rec:
            c1 = time.process_time()
            timings.time("record_first", step)  # the first step of a block is also recorded at its backward's end
            timings.time("record", step)
            c2 = time.process_time()
        enter_exit.append(time.process_time() - c2 + c1 - c0)
    assert len(rec.steps) == 2 and rec.trace.step_kind == "optimizer"
    assert rec.layer("gpt.blocks.0.c_attn").norm > 0  # real gradients, not an all-zero degenerate loss
    print(f"GPT-2-small-like: {n / 1e6:.1f}M parameters in {len(params)} tensors, batch {args.batch}, "
          f"seq {seq}, 1 thread, {repeats} interleaved repeats, medians")
    print("  CPU time of this process is the measure (the machine is shared; wall time shown for reference)")
    print("  (min: the least disturbed repeat; contention only ever adds time)")
    base = timings.summary("plain")
    for name in names:
        s = timings.summary(name)
        print(f"  {name:<13} cpu median {s.cpu * 1e3:8.1f} ms/step ratio {s.cpu / base.cpu:5.3f}x | "
              f"cpu min ratio {s.cpu_min / base.cpu_min:5.3f}x | wall median ratio {s.wall / base.wall:5.3f}x")
    print(f"  recorder work alone on the same gradients: cpu {statistics.median(work) * 1e3:.1f} ms = "
          f"{statistics.median(work) / base.cpu:.3f} of a plain step")
    print(f"  record_gradients enter+exit (once per block, includes the exact last step): "
          f"cpu {statistics.median(enter_exit) * 1e3:.0f} ms")

if __name__ == "__main__":
    main()
