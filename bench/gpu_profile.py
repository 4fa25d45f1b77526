"""%%profile on a CUDA device: the sync verdict, kernels linked to lines, device idle, and the cost.

    python bench/gpu_profile.py          # run by bench/gpu_check.sh; needs a CUDA device

Checks (each prints ok / FAILED; the exit status is 1 if any failed):

1. a step that reads ``loss.item()`` after heavy GPU work every step is **sync**-bound, the verdict names
   the ``.item()`` line, and the syncs are counted (one per step at least);
2. the same step reading the loss every 10 steps instead is not sync-bound, and ``compare`` says the
   sync time went down;
3. CUPTI works: kernels were recorded (device busy time per step, device time on the modules and
   lines) — or the report says it could not record them;
4. every step's categories add up to the step;
5. the cost: profile() + summary vs torch.profiler(record_shapes, with_stack) + key_averages on the same
   steps, each timed next to plain steps (median paired wall ratio).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torch_nbdebug.api.profile import profile  # noqa: E402

FAILED: list[str] = []


def check(ok: bool, what: str) -> None:
    print(f"{'ok     ' if ok else 'FAILED '} {what}")
    if not ok:
        FAILED.append(what)


def setup() -> tuple[nn.Module, Any, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                          nn.Linear(4096, 2048)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x, y = torch.randn(2048, 2048, device="cuda"), torch.randn(2048, 2048, device="cuda")
    return model, opt, x, y


def syncing_steps(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor, n: int, every: int) -> list[float]:
    losses = []
    for step in range(n):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if step % every == 0:
            losses.append(loss.item())  # the sync
    return losses


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_profile: no CUDA device")
        return 2
    model, opt, x, y = setup()
    syncing_steps(model, opt, x, y, 3, 1)
    torch.cuda.synchronize()
    ns = {"model": model, "opt": opt}

    with profile(ns, steps=8) as every_step:
        syncing_steps(model, opt, x, y, 9, 1)
    print(every_step.text())
    v = every_step.verdict
    check(v.kind == "sync", f"reading loss.item() every step is sync-bound (got {v.kind}, {v.share:.0%})")
    check(v.line is not None and "loss.item()" in v.line.text, f"the verdict names the .item() line ({v.line})")
    check(all(s.syncs >= 1 for s in every_step.breakdown),
          f"syncs counted per step: {[s.syncs for s in every_step.breakdown]}")

    torch.cuda.synchronize()
    with profile(ns, steps=8) as every_ten:
        syncing_steps(model, opt, x, y, 9, 10)
        torch.cuda.synchronize()
    change = every_ten.compare(every_step)
    print(change.text())
    sync = {c.name: c for c in change.categories}["sync"]
    check(every_ten.verdict.kind != "sync" or every_ten.verdict.share < v.share,
          f"reading every 10 steps: verdict {every_ten.verdict.kind}")
    check(sync.delta_ms < 0, f"compare: sync time per step {sync.before_ms:.2f} -> {sync.after_ms:.2f} ms")

    busy = [s.device_busy_ms for s in every_step.breakdown]
    cupti = all(b is not None and b > 0 for b in busy)
    said = any("CUPTI" in n for n in every_step.data.notes)
    check(cupti or said, f"kernels recorded (device busy ms per step {busy}) or the report says why not")
    if cupti:
        check(any((m.device_ms or 0) > 0 for m in every_step.by_module), "device time on the modules")
        check(any((r.device_ms or 0) > 0 for r in every_step.by_line), "device time on the launching lines")
        idle = [s.device_idle_ms for s in every_step.breakdown]
        print(f"device idle per step (ms): {[round(i or 0, 2) for i in idle]}")
    check(all(abs(sum(s.categories.values()) - s.ms) < 1e-6 * max(1.0, s.ms) for s in every_step.breakdown),
          "every step's categories add up to the step")

    cost(model, opt, x, y, ns)
    print("gpu_profile:", "all checks passed" if not FAILED else f"{len(FAILED)} FAILED: {FAILED}")
    return 1 if FAILED else 0


def cost(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor, ns: dict[str, Any]) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    def plain() -> None:
        syncing_steps(model, opt, x, y, 6, 10)

    def ours() -> None:
        with profile(ns, steps=None) as prof:
            plain()
        prof.text()

    def anchor() -> None:
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True,
                           with_stack=True) as prof:
            plain()
        prof.key_averages(group_by_stack_n=5).table(sort_by="self_cuda_time_total", row_limit=20)

    def timed(fn: Callable[[], None]) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    ratios: dict[str, list[float]] = {"profile": [], "anchor": []}
    for r in range(5):
        for name, fn in (("profile", ours), ("anchor", anchor)):
            if (r % 2) == 0:
                base, t = timed(plain), timed(fn)
            else:
                t, base = timed(fn), timed(plain)
            ratios[name].append(t / base)
    p, a = statistics.median(ratios["profile"]), statistics.median(ratios["anchor"])
    print(f"cost, 6 steps, median paired wall ratio to plain steps: profile() + summary {p:.2f}x, "
          f"torch.profiler(record_shapes, with_stack) + key_averages {a:.2f}x")
    check(p <= a * 1.05, "profile() is no dearer than the torch.profiler anchor")


if __name__ == "__main__":
    sys.exit(main())
