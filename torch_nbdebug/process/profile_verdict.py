"""Why is the step slow: the verdict rules, in one place, on the figures of the profiled steps.

The rules are checked in order, the first that holds is the verdict (each names its figures, the
line and module to look at, and the fix):

1. **sync** (CUDA only, never on CPU): host syncs take at least :data:`SYNC_SHARE` of the step;
2. **data**: waiting for the DataLoader takes at least :data:`DATA_SHARE`;
3. **launch**: at least :data:`LAUNCH_OPS` top-level torch ops per step with a median under
   :data:`LAUNCH_MEDIAN_US`, and ops plus the Python between them at least :data:`LAUNCH_SHARE`;
4. **memory**: copies (``.to``, ``.copy_``, ``.contiguous``, host↔device) take at least :data:`COPY_SHARE`;
5. **host**: Python outside torch ops takes at least :data:`HOST_SHARE`;
6. **compute**: torch ops (forward, backward, optimizer) take at least :data:`COMPUTE_SHARE`;
7. **balanced** otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from torch_nbdebug.data.profile import CATEGORIES, LineRow, ModuleRow, OpRow, Step, Verdict, VerdictKind
from torch_nbdebug.data.source import SourceLine

SYNC_SHARE = 0.25
DATA_SHARE = 0.4
LAUNCH_OPS = 200
LAUNCH_MEDIAN_US = 25.0
LAUNCH_SHARE = 0.6
COPY_SHARE = 0.3
HOST_SHARE = 0.4
COMPUTE_SHARE = 0.6


@dataclass(frozen=True)
class Figures:
    """What the rules read: mean ms per step, shares of the mean step, ops, and the rows."""

    step_ms: float
    shares: dict[str, float]
    ops_per_step: float
    median_op_us: float
    copy_share: float
    syncs_per_step: float
    device: str
    device_idle_share: Optional[float]
    lines: Sequence[LineRow] = field(default_factory=tuple)
    modules: Sequence[ModuleRow] = field(default_factory=tuple)
    ops: Sequence[OpRow] = field(default_factory=tuple)

    @classmethod
    def of(cls, steps: Sequence[Step], modules: Sequence[ModuleRow], lines: Sequence[LineRow],
           ops: Sequence[OpRow], device: str, has_device: bool, median_op_us: float) -> "Figures":
        n = max(1, len(steps))
        step_ms = sum(s.ms for s in steps) / n
        shares = {c: (sum(s.categories.get(c, 0.0) for s in steps) / n / step_ms if step_ms else 0.0)
                  for c in CATEGORIES}
        idle = None
        if has_device and step_ms:
            idle = sum(s.device_idle_ms or 0.0 for s in steps) / n / step_ms
        return cls(step_ms, shares, sum(s.ops for s in steps) / n, median_op_us,
                   sum(s.copy_ms for s in steps) / n / step_ms if step_ms else 0.0,
                   sum(s.syncs for s in steps) / n, device, idle, tuple(lines), tuple(modules), tuple(ops))

    def top_line(self, category: Optional[str] = None) -> Optional[SourceLine]:
        """The line with the most time (in ``category``, when given)."""
        rows = [r for r in self.lines if category is None or r.categories.get(category, 0.0) > 0]
        if not rows:
            return None
        return max(rows, key=lambda r: r.categories.get(category, 0.0) if category else r.ms).line

    def busiest_line(self) -> Optional[SourceLine]:
        """The line that launched the most ops."""
        rows = [r for r in self.lines if r.ops > 0]
        return max(rows, key=lambda r: r.ops).line if rows else None

    def busiest_module(self) -> Optional[str]:
        """The innermost module that ran the most ops (a leaf before the model that holds it)."""
        rows = [r for r in self.modules if r.ops > 0]
        return max(rows, key=lambda r: (r.ops, r.path.count("."))).path if rows else None

    def heaviest_module(self) -> Optional[str]:
        """The module with the most time of its own (outside its sub-modules)."""
        return max(self.modules, key=lambda r: r.self_ms).path if self.modules else None


def _at(line: Optional[SourceLine]) -> str:
    return f" at {line}" if line is not None else ""


def _in(module: Optional[str]) -> str:
    return f" in {module}" if module else ""


def _of_the_step(kind: VerdictKind, share: float, says: str, fix: str, figures: dict[str, float],
                 line: Optional[SourceLine] = None, module: Optional[str] = None) -> Verdict:
    """A verdict whose summary leads with the share of the step it explains: ``42% of the step <says>``."""
    return Verdict(kind, share, f"{share:.0%} of the step {says}", fix, figures, line, module)


def decide(f: Figures) -> Verdict:
    s = f.shares
    ops_share = s["forward"] + s["backward"] + s["optimizer"]
    figures = {"step_ms": round(f.step_ms, 4), **{f"{c}_share": round(v, 4) for c, v in s.items()},
               "ops_per_step": round(f.ops_per_step, 1), "median_op_us": round(f.median_op_us, 2),
               "copy_share": round(f.copy_share, 4), "syncs_per_step": round(f.syncs_per_step, 2)}
    if f.device_idle_share is not None:
        figures["device_idle_share"] = round(f.device_idle_share, 4)
    if f.device == "cuda" and s["sync"] >= SYNC_SHARE:
        line = f.top_line("sync")
        return _of_the_step("sync", s["sync"], f"waits in host syncs ({f.syncs_per_step:.0f} per step){_at(line)}",
                            "keep values on the device: read .item()/.cpu()/print a tensor every N steps, not every "
                            "step; avoid nonzero() and boolean-mask indexing in the step (they sync to size their "
                            "output); torch.cuda.set_sync_debug_mode('warn') points at each sync", figures, line)
    if s["data"] >= DATA_SHARE:
        line = f.top_line("data")
        return _of_the_step("data", s["data"], f"waits for the DataLoader ({s['data'] * f.step_ms:.1f} ms per "
                            f"batch); the slowest loading line is{_at(line) or ' unknown'}",
                            "load batches in the background: DataLoader(..., num_workers=4, pin_memory=True, "
                            "persistent_workers=True); cache decoded or preprocessed samples instead of redoing "
                            "them; do per-sample work on whole batches (or on the GPU)", figures, line)
    if f.ops_per_step >= LAUNCH_OPS and f.median_op_us <= LAUNCH_MEDIAN_US and ops_share + s["python"] >= LAUNCH_SHARE:
        line, module = f.busiest_line(), f.busiest_module()
        share = ops_share + s["python"]
        return Verdict("launch", share, f"{f.ops_per_step:.0f} torch ops per step, median {f.median_op_us:.1f} µs each: "
                       f"the step is many small ops ({share:.0%} of it in ops and the Python between them), most "
                       f"launched{_at(line)}{_in(module)}",
                       "vectorize the loop (one op on a batched tensor instead of one per element or per layer), fuse "
                       "ops with torch.compile, or replay the step as a CUDA graph (torch.compile(mode='reduce-overhead')); "
                       "optimizers: foreach=True or fused=True", figures, line, module)
    if f.copy_share >= COPY_SHARE:
        line = f.top_line()
        return _of_the_step("memory", f.copy_share, f"copies tensors (.to, .copy_, .contiguous: "
                            f"{f.copy_share * f.step_ms:.1f} ms per step){_at(line)}",
                            "move data to the device once (pin_memory=True and .to(device, non_blocking=True)), "
                            "keep one dtype and layout through the step, avoid .cpu()/.contiguous() round trips",
                            figures, line)
    if s["python"] >= HOST_SHARE:
        line = f.top_line("python")
        return _of_the_step("host", s["python"], f"is Python outside torch ops{', mostly' + _at(line) if line else ''}",
                            "take that work out of the step (precompute it once), write it as torch ops on whole "
                            "tensors, or run it every N steps", figures, line)
    if ops_share >= COMPUTE_SHARE:
        module = f.heaviest_module()
        top = ", ".join(o.name for o in f.ops[:3])
        fix = ("autocast to bfloat16/float16 (torch.autocast), TF32 matmuls (torch.backends.cuda.matmul."
               "allow_tf32 = True), channels_last for convolutions, torch.compile" if f.device == "cuda" else
               "torch.compile, bfloat16 autocast on CPU (torch.autocast('cpu')), all cores (torch.set_num_threads), "
               "or a GPU; a smaller model or batch if the step must be shorter")
        return _of_the_step("compute", ops_share, f"is torch ops doing work{', most of it' + _in(module) if module else ''}"
                            + (f" ({top})" if top else ""), fix, figures, f.top_line(), module)
    parts = ", ".join(f"{c} {v:.0%}" for c, v in sorted(s.items(), key=lambda kv: -kv[1]) if v >= 0.05)
    return Verdict("balanced", max(s.values()) if s else 0.0, f"no single cause: {parts}",
                   "nothing dominates: start with the biggest module and line below", figures,
                   f.top_line(), f.heaviest_module())
