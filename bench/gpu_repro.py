"""%%repro on CUDA: the causes only a GPU has, and the cost of a GPT-2-small-like step. Under 30 s.

    python bench/gpu_repro.py          # needs a CUDA device; run by bench/gpu_check.sh

1. ``index_add_`` with many rows per slot uses atomic adds: with deterministic algorithms off, two
   runs from the same state differ in the last bits, and repro must name ``aten.index_add_.default``,
   its line, phase 'forward' and cause 'nondeterministic_op' (retried a few times: atomics may agree
   by chance). The op is listed in ``nondeterministic_ops`` for cuda.
2. The same cell with ``torch.use_deterministic_algorithms(True)`` is identical.
3. A GPT-2-small-like training step (embedding backward uses atomics): deterministic off gives
   identical or 'nondeterministic_op' and nothing else; deterministic on gives identical, and the
   parameters and AdamW moments equal one plain step of a twin model (the state is as if the step
   ran once), for AdamW's foreach kernels (CUDA's default: run 1 writes the parameters through the
   out-of-place ``_foreach_mul``), its fused kernel (copy-on-write) and its per-tensor loop.
4. Timing: the step under repro vs plain, foreach AdamW (the target is <= 3x; printed, not asserted).
"""
from __future__ import annotations

import copy
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: cuBLAS determinism

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import GPT, lm_loss, training_step  # noqa: E402
from torch_nbdebug.api.repro import repro  # noqa: E402

DEVICE = "cuda"


def scatter_cell() -> torch.Tensor:
    index = torch.randint(0, 64, (400_000,), device=DEVICE)
    rows = torch.randn(400_000, 32, device=DEVICE)
    table = torch.zeros(64, 32, device=DEVICE)
    table.index_add_(0, index, rows)  # ATOMICS
    return table.sum()


ATOMICS_LINE = next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if "# ATOMICS" in line)


def check_atomics() -> None:
    torch.use_deterministic_algorithms(False)
    found = None
    for attempt in range(6):
        report = repro(scatter_cell)
        assert report.cause in (None, "nondeterministic_op"), report.text()
        if not report.identical:
            found = report
            break
    assert found is not None, "index_add_ agreed bit for bit in 6 tries: atomics gave no difference"
    first = found.first
    assert (first.op, first.phase, first.lineno) == ("aten.index_add_.default", "forward", ATOMICS_LINE), found.text()
    assert first.input is None and "use_deterministic_algorithms" in found.hint
    assert any(u.op == "aten.index_add_.default" and u.device == "cuda" for u in found.nondeterministic_ops)
    print(f"atomics: found after {attempt + 1} run(s): {first.op} line {first.lineno}, "
          f"max |diff| {first.max_abs_diff}, cause {found.cause}")
    torch.use_deterministic_algorithms(True)
    try:
        assert repro(scatter_cell).identical, "deterministic index_add_ differed"
    finally:
        torch.use_deterministic_algorithms(False)
    print("atomics: identical with torch.use_deterministic_algorithms(True)")


def gpt_case(layers: int = 12, batch: int = 8, seq: int = 128,
             **adamw: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = GPT(layers=layers).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **adamw)
    idx = torch.randint(0, 8192, (batch, seq + 1), device=DEVICE)
    return model, opt, idx


def check_training_step(**adamw: bool) -> None:
    kind = ", ".join(f"{k}={v}" for k, v in adamw.items()) or "foreach (default)"
    model, opt, idx = gpt_case(layers=2, **adamw)
    step = lambda m, o: training_step(o, lambda: lm_loss(m, idx[:, :-1], idx[:, 1:]))  # noqa: E731
    step(model, opt)  # optimizer state exists, as in a real loop
    report = repro(lambda: step(model, opt), state={"model": model, "opt": opt})
    assert report.cause in (None, "nondeterministic_op"), report.text()
    print(f"gpt step, AdamW {kind}, deterministic off: {report.text().splitlines()[0]}"
          + (f" at {report.first.op} ({report.first.phase}, {report.first.module})" if report.first else ""))
    torch.use_deterministic_algorithms(True)
    try:
        twin, twin_opt = copy.deepcopy((model, opt))  # one deepcopy: the twin optimizer steps the twin
        addresses = [p.data_ptr() for p in model.parameters()]
        report = repro(lambda: step(model, opt), state={"model": model, "opt": opt})
        assert report.identical, report.text()
        assert [p.data_ptr() for p in model.parameters()] == addresses, "parameters moved to other memory"
        step(twin, twin_opt)
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q), "state after repro differs from one plain step"
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt.state[p][key], twin_opt.state[q][key]), f"{key} differs from one plain step"
    finally:
        torch.use_deterministic_algorithms(False)
    print(f"gpt step, AdamW {kind}, deterministic on: identical, parameters and moments equal one plain step")


def time_step(repeats: int = 3) -> None:
    model, opt, idx = gpt_case()
    plain = lambda: training_step(opt, lambda: lm_loss(model, idx[:, :-1], idx[:, 1:]))  # noqa: E731
    twice = lambda: repro(plain, state={"model": model, "opt": opt})  # noqa: E731
    times: dict[str, list[float]] = {"plain": [], "repro": []}
    for r in range(repeats + 1):
        for name, fn in (("plain", plain), ("repro", twice)):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if r:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"gpt2-small-like step (batch 8, seq 128): plain {med['plain'] * 1e3:.1f} ms, "
          f"repro {med['repro'] * 1e3:.1f} ms, ratio {med['repro'] / med['plain']:.2f}x (target <= 3x)")


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_repro: no CUDA device")
    start = time.perf_counter()
    check_atomics()
    for adamw in ({}, {"fused": True}, {"foreach": False}):
        check_training_step(**adamw)
    time_step()
    print(f"gpu_repro: ok in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
