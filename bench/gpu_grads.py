"""record_gradients on CUDA: its cost next to the foreach-norm anchor, and its host synchronisations.

    python bench/gpu_grads.py                   # < 60 s on one GPU; exits 2 with a message without CUDA
    python bench/gpu_grads.py --device cpu --model small --repeats 3   # the same logic on a CPU

1. Host synchronisations of a recorded block of 3 AdamW steps of the 2-layer GPT beyond the plain
   steps' own: on CUDA counted by ``torch.cuda.set_sync_debug_mode`` (every synchronising call,
   host-to-device copies included), on a CPU by wrapping the reading methods as
   tests/test_grads_cost.py does. Target (issue 11): at most one per step.
2. The table of bench/bench_grads.py on the device: plain, ``torch._foreach_norm`` read once per
   step (the anchor), a per-parameter logger, and ``record_gradients`` (entering and leaving the block
   and the trace included; the exact last step is computed at the trace's first read, from a copy of its
   gradients queued at the block's end, when that copy fits: see bench_grads.py), each timed back to back
   with the plain steps, each
   call synchronised: median wall time and median paired ratio to plain. Targets: <= 1.10x on
   GPT-2-small-like, <= 1.5x on the small model.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from bench_grads import STEPS, small_gpt, variants  # noqa: E402
from models import GPT, lm_loss, training_step  # noqa: E402
from timing import cuda_syncs, paired  # noqa: E402
from torch_nbdebug.api.grads import record_gradients  # noqa: E402


def synchronisations(dev: str) -> tuple[int, int]:
    """(plain block, recorded block) synchronisations for 3 steps of the 2-layer GPT, after a warm-up step."""
    torch.manual_seed(0)
    model = small_gpt().to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, 512, (2, 32), device=dev)

    def steps() -> None:
        for _ in range(STEPS):
            training_step(opt, lambda: lm_loss(model, idx, idx))

    def recorded() -> None:
        with record_gradients(model, name="gpt") as rec:
            steps()
        assert len(rec.steps) == STEPS and rec.trace.exact[-1].all()  # read here: its copies counted too

    steps()
    return _count(dev, steps), _count(dev, recorded)


def _count(dev: str, block: Callable[[], None]) -> int:
    if dev.startswith("cuda"):
        return cuda_syncs(block)
    sys.path.insert(0, str(ROOT / "tests"))
    from host_syncs import counting_host_syncs  # the counter of tests/test_grads_cost.py

    with counting_host_syncs() as counted:
        block()
    return counted.count


def table(label: str, model: torch.nn.Module, vocab: int, batch: int, seq: int, dev: str, repeats: int) -> None:
    idx = torch.randint(0, vocab, (batch, seq), device=dev)
    sync = torch.cuda.synchronize if dev.startswith("cuda") else None
    pairs = paired(variants(model, idx), "plain", repeats, warmup=1, sync=sync)
    n = sum(p.numel() for p in model.parameters())
    print(f"{label}: {n / 1e6:.2f}M parameters, batch {batch}, seq {seq}, {STEPS} AdamW steps per call, "
          f"{repeats} pairs per variant (each timed next to the plain steps), median wall time and paired ratio")
    for name in pairs.names():
        print(f"  {name:<13} {pairs.summary(name).wall * 1e3:8.2f} ms  ratio {pairs.ratio(name, cpu=False):5.2f}x",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu, to check this script's logic")
    parser.add_argument("--model", choices=("small", "gpt2", "both"), default="both")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_grads: no CUDA device; run with --device cpu to check the logic on a CPU", file=sys.stderr)
        sys.exit(2)
    dev = args.device
    if not dev.startswith("cuda"):
        torch.set_num_threads(1)  # as bench/bench_grads.py: one thread, the CPU stand-in for a GPU
    torch.manual_seed(0)
    plain, recorded = synchronisations(dev)
    print(f"host synchronisations, 2-layer GPT, {STEPS} AdamW steps: plain {plain}, recorded {recorded}, "
          f"extra {recorded - plain} ({(recorded - plain) / STEPS:.2f} per step; target <= 1)", flush=True)
    if args.model in ("small", "both"):
        table("2-layer GPT (d=64)", small_gpt().to(dev), 512, 2, 32, dev, args.repeats or 21)
    if args.model in ("gpt2", "both"):
        model = GPT(vocab=50257, tied=True, fused_attention=True).to(dev)
        table("GPT-2-small-like", model, 50257, 8, 256, dev, args.repeats or 9)


if __name__ == "__main__":
    main()
