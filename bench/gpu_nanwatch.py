"""nanwatch on CUDA: correctness of the deferred (device-side) checks, host syncs, and overhead.

    python bench/gpu_nanwatch.py            # < 90 s on one GPU; exits 2 with a message without CUDA

1. Births found on the GPU: a forward log of negatives in a module, sqrt's infinite gradient at 0
   in backward, float16 overflow, and a causal mask's -inf that must stay quiet.
2. Host synchronisations per training step of the 2-layer GPT beyond the plain step's
   (torch.cuda.set_sync_debug_mode counts them): the deferred path reads once per step (target <= 1).
3. Step time of a GPT-2-small-like model (12 blocks, d=768) and of the 2-layer GPT (d=64), timed with
   torch.cuda.synchronize, each watcher timed back to back with a plain step (median paired ratio, as
   bench/bench_nanwatch.py on the CPU): plain, detect_anomaly, detect_anomaly(check_nan=True), nanwatch,
   nanwatch module mode.
"""
from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_nanwatch import watchers  # noqa: E402
from models import GPT, lm_loss, small_gpt, training_step  # noqa: E402
from timing import cuda_syncs, paired  # noqa: E402
from torch_nbdebug.api.nanwatch import nanwatch  # noqa: E402


class LogBlock(nn.Sequential):
    """A linear layer, then log: its negative outputs make NaN in this module's own forward."""

    def __init__(self) -> None:
        super().__init__(nn.Linear(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(super().forward(x))


def check_births(dev: str) -> list[str]:
    """Each case returns a failure message or nothing; all run on the GPU with the deferred path."""
    failures = []
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), LogBlock(), nn.Linear(16, 1)).to(dev)
    with nanwatch(namespace={"model": model}) as r:
        model(torch.randn(32, 16, device=dev)).sum().backward()
    if not (r.first and r.first.op == "aten.log.default" and r.first.module == "model.1" and r.first.deferred):
        failures.append(f"forward log birth: got {r.first.title() if r.first else None}")
    x = torch.zeros(4, device=dev, requires_grad=True)
    with nanwatch() as r:
        torch.sqrt(x).sum().backward()
    if not (r.first and r.first.phase == "backward" and r.first.op == "SqrtBackward0"):
        failures.append(f"backward sqrt birth: got {r.first.title() if r.first else None}")
    h = torch.full((64,), 300.0, device=dev, dtype=torch.float16)
    with nanwatch() as r:
        h * h
    if not (r.first and r.first.kind == "inf" and r.first.output.dtype == "float16"):
        failures.append(f"float16 overflow: got {r.first.title() if r.first else None}")
    gpt = GPT(vocab=512, d=64, layers=2, heads=4).to(dev)
    with nanwatch(namespace={"gpt": gpt}) as r:
        F.cross_entropy(gpt(torch.randint(0, 512, (2, 32), device=dev)).flatten(0, 1),
                        torch.randint(0, 512, (64,), device=dev)).backward()
    if r.events:
        failures.append(f"causal mask reported: {r.first.title()}")
    return failures


def count_syncs(dev: str, mode: str) -> tuple[int, int]:
    """Host synchronisations in one training step of the 2-layer GPT (warnings of sync debug mode):
    (plain step, watched step), each counted on a step after a first one (AdamW's state exists)."""
    torch.manual_seed(0)
    gpt = small_gpt().to(dev)
    opt = torch.optim.AdamW(gpt.parameters(), lr=1e-4)
    idx = torch.randint(0, 512, (4, 33), device=dev)

    def step() -> None:
        training_step(opt, lambda: lm_loss(gpt, idx[:, :-1], idx[:, 1:]))

    def counted() -> int:
        return cuda_syncs(step)

    step()
    plain = counted()
    with nanwatch(mode=mode, namespace={"gpt": gpt}):
        step()
        watched = counted()
    return plain, watched


def time_steps(dev: str, case: str, repeats: int) -> dict[str, tuple[float, float]]:
    """Per watcher: median step time and median paired ratio to the plain step (each timed back to back
    with a plain step, as bench_nanwatch.py does on the CPU), for the GPT-2-small-like model (batch 8,
    seq 255) or the 2-layer GPT (batch 4, seq 32), each call synchronised with the device."""
    torch.manual_seed(0)
    if case == "gpt2":
        model, idx = GPT().to(dev), torch.randint(0, 8192, (8, 256), device=dev)
    else:
        model, idx = small_gpt().to(dev), torch.randint(0, 512, (4, 33), device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    modes = watchers({"model": model, "opt": opt})

    def step(mode: str) -> Callable[[], None]:
        def watched() -> None:
            with modes[mode]():
                training_step(opt, lambda: lm_loss(model, idx[:, :-1], idx[:, 1:]))
        return watched

    sync = torch.cuda.synchronize if dev.startswith("cuda") else None
    pairs = paired({m: step(m) for m in modes}, "plain", repeats, warmup=1, sync=sync)
    return {m: (pairs.summary(m).wall, pairs.ratio(m, cpu=False)) for m in pairs.names()}


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_nanwatch: no CUDA device here (torch.cuda.is_available() is False); "
              "run it on a machine with a GPU. The CPU benchmark is bench/bench_nanwatch.py.")
        return 2
    dev = "cuda"
    warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
    print(f"gpu_nanwatch: torch {torch.__version__} on {torch.cuda.get_device_name(0)}")
    t0 = time.perf_counter()
    failures = check_births(dev)
    print("births on CUDA:", "all found" if not failures else "FAILED: " + "; ".join(failures))
    for mode in ("op", "module"):
        plain, watched = count_syncs(dev, mode)
        print(f"host syncs per training step (2-layer GPT, fwd+bwd+AdamW), nanwatch mode={mode}: "
              f"{watched - plain} beyond the plain step's {plain} (target: at most 1)")
    columns = {"gpt2": time_steps(dev, "gpt2", repeats=5), "small": time_steps(dev, "small", repeats=15)}
    print("step time on CUDA (median wall clock) and median paired ratio to the plain step next to it:")
    print(f"  {'':16s} {'GPT-2-small-like (b8, seq 255)':>32s} {'2-layer GPT (b4, seq 32)':>28s}")
    for mode in columns["gpt2"]:
        cells = [f"{c[mode][0] * 1e3:9.2f} ms {c[mode][1]:5.2f}x" for c in columns.values()]
        print(f"  {mode:16s} {cells[0]:>32s} {cells[1]:>28s}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
