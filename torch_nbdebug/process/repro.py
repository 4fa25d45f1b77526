"""Pure decisions for ``%%repro``: where two runs first differ, why, what to do, and the preflight.

Every rule lives here once and is tested on hand-built traces (``tests/test_repro_process.py``), so
the CUDA-only causes (atomics) are decided by the same code on CPU fakes as on a GPU.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from torch_nbdebug.data.repro import (Cause, Divergence, Fingerprint, NondeterministicUse, OpPlace, OpTrace,
                                      PreflightItem, ReproOp, ReproSummary, Settings, Status, diff_size,
                                      nondeterministic_on)


def same_slot(a: Any, b: Any) -> bool:
    if isinstance(a, Fingerprint) and isinstance(b, Fingerprint):
        return a.same(b)
    return bool(a == b)


def compare_op(index: int, a: OpTrace, b: OpTrace) -> Optional[Divergence]:
    """The first difference between the same op of the two runs: its identity, an input, an output."""
    if a.op != b.op or len(a.inputs) != len(b.inputs) or len(a.outputs) != len(b.outputs):
        return Divergence(index, "sequence", detail=f"run 1 ran {a.op}, run 2 ran {b.op}")
    for slot, (x, y) in enumerate(zip(a.inputs, b.inputs)):
        if not same_slot(x, y):
            return Divergence(index, "input", slot)
    if a.scalars != b.scalars:
        return Divergence(index, "input", None, detail="a Python number or shape passed to the op")
    for slot, (x, y) in enumerate(zip(a.outputs, b.outputs)):
        if not same_slot(x, y):
            return Divergence(index, "output", slot)
    return None


def find_divergence(run1: Sequence[OpTrace], run2: Sequence[OpTrace], start: int = 0) -> Optional[Divergence]:
    """The first op (from ``start``) where run 2 differs from run 1; ops run 2 has not reached yet
    are not compared (call :func:`missing_ops` once run 2 is over)."""
    for i in range(start, len(run2)):
        if i >= len(run1):
            return Divergence(i, "sequence", detail=f"run 2 ran more ops than run 1 ({run2[i].op} is extra)")
        found = compare_op(i, run1[i], run2[i])
        if found is not None:
            return found
    return None


def missing_ops(run1: Sequence[OpTrace], run2: Sequence[OpTrace]) -> Optional[Divergence]:
    if len(run2) < len(run1):
        return Divergence(len(run2), "sequence", detail=f"run 2 stopped before {run1[len(run2)].op}: it ran fewer ops")
    return None


def explain(d: Divergence, run1: Sequence[OpTrace], run2: Sequence[OpTrace], restore_rng: bool) -> Cause:
    """Why the two runs differ at ``d``."""
    if d.kind == "sequence":
        return "external"       # Python chose other ops with every tensor so far equal
    if d.kind in ("state", "exception"):
        return "unknown" if d.kind == "state" else "external"
    op = run2[d.index]
    if d.kind == "output":
        return "rng" if op.random else "nondeterministic_op"
    if d.slot is None:
        return "external"
    origin = op.input_origins[d.slot] if d.slot < len(op.input_origins) else None
    if origin == "uninitialized" or op.reads_uninitialized is not None:
        return "uninitialized"
    if origin is not None and origin.startswith("state:"):
        return "unknown"
    return "external"


def input_description(d: Divergence, op: OpTrace) -> Optional[str]:
    """The input that differed, named by the schema and where it came from."""
    if d.kind != "input":
        return None
    if d.slot is None:
        return d.detail
    name = op.input_names[d.slot] if d.slot < len(op.input_names) else f"input {d.slot}"
    origin = op.input_origins[d.slot] if d.slot < len(op.input_origins) else None
    where = {
        None: "a tensor made by an earlier op, then changed outside torch or chosen differently by Python",
        "python_data": "a tensor made from Python data (torch.tensor / from_numpy)",
        "uninitialized": "memory from torch.empty-like allocation, read before it was written",
        "not_in_snapshot": "a tensor from outside the snapshot (not a parameter, buffer or namespace variable)",
    }.get(origin, f"the restored state {origin[6:]}" if origin and origin.startswith("state:") else origin)
    return f"{name}: {where}"


def first_op(d: Divergence, run1: Sequence[OpTrace], run2: Sequence[OpTrace],
             place: Optional[OpPlace], line: str, allocated_at: Optional[str] = None) -> Optional[ReproOp]:
    if d.index >= len(run2) or d.kind in ("state", "exception"):
        return None
    b = run2[d.index]
    a = run1[d.index] if d.index < len(run1) else None
    size = None
    if a is not None and d.kind in ("input", "output"):
        size = _size(d, a, b)
    place = place or OpPlace()
    return ReproOp(op=b.op, module=place.module, filename=place.filename, lineno=place.lineno, line=line,
                   phase=b.phase, max_abs_diff=size, input=input_description(d, b), kind=d.kind, index=d.index,
                   allocated_at=allocated_at)


def _size(d: Divergence, a: OpTrace, b: OpTrace) -> Optional[float]:
    """How far apart the differing values are; for a Python-number input, how far apart the outputs are."""
    if d.kind == "input" and d.slot is not None:
        pairs = [(a.inputs[d.slot], b.inputs[d.slot])]
    else:
        pairs = list(zip(a.outputs, b.outputs)) if d.slot is None else [(a.outputs[d.slot], b.outputs[d.slot])]
    for x, y in pairs:
        if isinstance(x, Fingerprint) and isinstance(y, Fingerprint) and not x.same(y):
            return diff_size(x, y)
    return None


def hint(cause: Optional[Cause], first: Optional[ReproOp], restore_rng: bool, detail: str = "") -> str:
    """The fix, for a cause and the op it was found at."""
    if cause is None:
        return ""
    at = f" (`{first.line}`)" if first is not None and first.line else ""
    if cause == "rng":
        if not restore_rng:
            return (f"a random op{at} drew different numbers: seed at the top of the cell (torch.manual_seed, "
                    "random.seed, np.random.seed) or run with the RNG restored (drop --no-restore-rng)")
        return (f"a random op{at} drew from a generator the snapshot did not restore: a torch.Generator of your "
                "own (DataLoader(generator=...), a module attribute) - seed it in the cell or pass it in state=")
    if cause == "uninitialized":
        return (f"memory from torch.empty / empty_like / new_empty was read before it was written{at}: use "
                "torch.zeros(...) or write every element before reading it")
    if cause == "nondeterministic_op":
        return (f"same inputs, different output{at}: a nondeterministic kernel (atomic adds on CUDA). Call "
                "torch.use_deterministic_algorithms(True) (it raises for ops without a deterministic version), "
                "set CUBLAS_WORKSPACE_CONFIG=:4096:8 before CUDA starts, and torch.backends.cudnn.benchmark=False")
    if cause == "external":
        return (f"a value from outside torch's state differed{at}: Python `random`, time, a counter or attribute "
                "the previous run changed, a file. Seed it, compute it before the cell, or reset it in the cell. "
                + detail).strip()
    changed = f"`{detail}` was changed outside torch's ops by the first run, so the snapshot could not restore " \
        "it: " if detail else "the runs differ but no op explains it: state changed outside torch ops "
    return (changed + "a NumPy view of a tensor, a `.data` assignment, a tensor not in the snapshot. Change it "
            "with torch ops, or pass it in state=")


def preflight(settings: Settings) -> tuple[PreflightItem, ...]:
    """The settings that decide whether a run can repeat, each with its status and advice."""
    cuda = settings.cuda_used
    gpu_status: Status = "warn" if cuda else "info"
    items = [
        PreflightItem("torch.use_deterministic_algorithms", "on" + (" (warn only)" if settings.deterministic_warn_only
                                                                   else "") if settings.deterministic else "off",
                      "ok" if settings.deterministic else gpu_status,
                      "" if settings.deterministic else "torch.use_deterministic_algorithms(True) to make "
                      "nondeterministic CUDA kernels deterministic (or raise, naming them)"),
        PreflightItem("CUBLAS_WORKSPACE_CONFIG", settings.cublas_workspace or "unset",
                      "ok" if settings.cublas_workspace in (":4096:8", ":16:8") else gpu_status,
                      "" if settings.cublas_workspace in (":4096:8", ":16:8") else
                      "set CUBLAS_WORKSPACE_CONFIG=:4096:8 before CUDA starts (cuBLAS determinism)"),
        PreflightItem("TF32 matmul / cuDNN", f"{_on(settings.matmul_tf32)} / {_on(settings.cudnn_tf32)}", "info",
                      "TF32 is deterministic but less precise: results differ from float32 on other GPUs"),
        PreflightItem("torch.backends.cudnn.benchmark", _on(settings.cudnn_benchmark),
                      gpu_status if settings.cudnn_benchmark else "ok",
                      "benchmark=True may pick a different convolution algorithm each run: set it False"
                      if settings.cudnn_benchmark else ""),
    ]
    for loader in settings.loaders:
        items.append(PreflightItem(f"DataLoader {loader}", "workers without a seeded generator", "warn",
                                   "pass generator=torch.Generator().manual_seed(s) and a worker_init_fn "
                                   "that seeds NumPy/random in each worker"))
    return tuple(items)


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def nondeterministic_uses(counts: dict[tuple[str, str], list[Any]], lines: dict[tuple[str, str], str]
                          ) -> tuple[NondeterministicUse, ...]:
    """The ops used that PyTorch lists as nondeterministic on their device, with the first line of each."""
    uses = []
    for (op, device), (count, place) in sorted(counts.items()):
        if not nondeterministic_on(op, device):
            continue
        place = place or OpPlace()
        uses.append(NondeterministicUse(op=op, device=device, count=count, filename=place.filename,
                                        lineno=place.lineno, line=lines.get((op, device), "")))
    return tuple(uses)


def summarize(d: Optional[Divergence], cause: Optional[Cause], first: Optional[ReproOp], **fields: Any) -> ReproSummary:
    restore_rng = bool(fields.get("restore_rng", True))
    text = hint(cause, first, restore_rng, d.detail if d is not None and d.kind in ("state", "exception") else "")
    return ReproSummary(identical=d is None, first=first, cause=cause, hint=text, **fields)
