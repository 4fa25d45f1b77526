"""Per-step gradient statistics in two halves, for :mod:`torch_nbdebug.record.grads`.

:func:`sampled_rows` runs at each step and only captures: the fixed sample of every gradient
(parameters of at most ``sample`` elements whole) gathered into one flat tensor, the exact L2 norms
of gradients and parameters (one batched ``_foreach_norm`` each), and the exact sum/min/max of the
few parameters too large to be taken whole. A handful of op calls whatever the number of
parameters, and no host synchronisation.

:func:`reduce_rows` turns many captured steps into statistics at once, when the recorder flushes
(every ``_FLUSH`` steps, when the kept samples reach their memory bound, or at the end): counts,
sums and ranges per parameter are segment reductions over all steps' samples together, and the
histograms one ``index_add_`` for every parameter of every step. The results are the numbers a
per-step, per-parameter path gives (counts exact, sums accumulated in float64), so the views keep
their precision; what moved is when, and how many Python calls it takes.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch

from torch_nbdebug.record import compat

RAW = ("norm", "sum", "min", "max", "mean_abs", "zeros", "nan", "inf", "param_norm", "update_ratio")
COL = {name: i for i, name in enumerate(RAW)}


def float_norms(tensors: list[torch.Tensor], ord: float = 2) -> list[torch.Tensor]:
    """Batched float32 norms: a half-precision norm above 65504 would read as a false Inf."""
    if all(t.dtype == torch.float32 for t in tensors):
        return compat.foreach_norm(tensors, ord)
    return compat.foreach_norm(tensors, ord, dtype=torch.float32)


class Layout:
    """Device constants of one set of parameters with a gradient (``present``), built once.

    ``lengths``: elements of each parameter in the gathered sample; ``big``: positions (within
    ``present``) of the parameters sampled rather than taken whole; ``k``/``numel``: sample and
    tensor sizes.
    """

    def __init__(self, sampler: "Sampler", present: tuple[int, ...], device: torch.device) -> None:
        self.present, self.device, self.n = present, device, len(present)
        self.lengths = [int(sampler.count[i]) for i in present]
        self.size = sum(self.lengths)
        self.big = [j for j, i in enumerate(present) if not sampler.exact[i]]
        self.same_device = all(sampler.devices[i] == device for i in present)
        self.k = torch.tensor(self.lengths, dtype=torch.float64).to(device)
        self.numel = torch.tensor([float(sampler.numel[i]) for i in present], dtype=torch.float64).to(device)
        self.big_index = torch.tensor(self.big, dtype=torch.long).to(device)
        self.lengths_t = torch.tensor(self.lengths, dtype=torch.long).to(device)
        self._segments: dict[int, torch.Tensor] = {}  # the largest constants: dropped by release()

    # Built on the device from the constants above: a tensor made from Python values on a GPU would
    # wait for the queue to drain, and the number of steps differs from one flush to the next.
    def lengths_for(self, steps: int) -> torch.Tensor:
        """Segment lengths of ``steps`` samples laid end to end (for ``segment_reduce``)."""
        return self.lengths_t.repeat(steps)

    def segments(self, steps: int) -> torch.Tensor:
        """For each gathered element of ``steps`` samples: its (step, parameter) segment number."""
        if steps not in self._segments:
            if len(self._segments) >= 4:  # a few sizes kept: the number of steps per flush rarely changes
                self._segments.clear()
            first = torch.arange(steps * self.n, device=self.device)
            self._segments[steps] = torch.repeat_interleave(first, self.lengths_for(steps),
                                                            output_size=steps * self.size)
        return self._segments[steps]

    def release(self) -> None:
        """Drop the segment numbers of more than 2**20 elements (8 MB); smaller ones serve the next recording."""
        for steps in [s for s, t in self._segments.items() if t.numel() > 1 << 20]:
            del self._segments[steps]


def sample_index(numel: int, k: int, device: torch.device) -> torch.Tensor:
    """``k`` sorted random element indices of a tensor of ``numel`` elements, from a private
    generator seeded by the size: the same elements every time, the user's RNG state untouched."""
    # Built per recording, never cached at module level: a tool's tensor left alive after it ends would
    # show in the user's memory views (and hold device memory).
    gen = torch.Generator().manual_seed(0x5EED + numel)
    return torch.randint(0, numel, (k,), generator=gen).sort().values.to(device)


class Sampler:
    """Fixed random element indices per parameter; parameters with at most ``k`` elements are taken whole."""

    def __init__(self, params: list[torch.nn.Parameter], k: int) -> None:
        self.index: list[Optional[torch.Tensor]] = []
        self.count = np.zeros(len(params))
        self.numel = np.array([p.numel() for p in params], dtype=np.float64)
        self.devices = [p.device for p in params]
        for i, p in enumerate(params):
            n = p.numel()
            whole = n <= k
            self.index.append(None if whole else sample_index(n, k, p.device))
            self.count[i] = n if whole else k
        self.exact = self.count >= self.numel
        self._layouts: dict[tuple[tuple[int, ...], torch.device], Layout] = {}

    def layout(self, present: tuple[int, ...], device: torch.device) -> Layout:
        key = (present, device)
        if key not in self._layouts:
            self._layouts[key] = Layout(self, present, device)
        return self._layouts[key]

    def release(self) -> None:
        """Drop the per-element constants (as large as the kept samples) once recording is over."""
        for layout in self._layouts.values():
            layout.release()

    def gather(self, tensors: list[torch.Tensor], layout: Layout) -> torch.Tensor:
        """The samples of ``tensors`` (one per ``layout.present``) as one flat float32 tensor."""
        index = self.index
        parts = [t.detach().reshape(-1) if index[i] is None else t.detach().reshape(-1).index_select(0, index[i])
                 for t, i in zip(tensors, layout.present)]
        if not layout.same_device:
            parts = [p.to(layout.device) for p in parts]
        x = torch.cat(parts)
        return x if x.dtype == torch.float32 else x.float()


def sampled_rows(params: list[torch.nn.Parameter], present: tuple[int, ...], sampler: Sampler
                 ) -> dict[str, Any]:
    """Capture one step on the device, no host synchronisation: see the module docstring."""
    grads = [params[i].grad.detach() for i in present]
    layout = sampler.layout(present, grads[0].device)
    captured: dict[str, Any] = {
        "layout": layout, "x": sampler.gather(grads, layout),
        "norm": torch.stack(float_norms(grads)).to(layout.device),
        "param_norm": torch.stack(float_norms([params[i].detach() for i in present])).to(layout.device),
    }
    if layout.big:  # exact even though their other statistics come from the sample
        big = [grads[j] for j in layout.big]
        minmax = [torch.aminmax(g) for g in big]
        captured["big"] = torch.stack([torch.stack([g.sum(dtype=torch.float32), m.min.float(), m.max.float()])
                                       .to(layout.device) for g, m in zip(big, minmax)])
    return captured


def reduce_rows(rows: list[dict[str, Any]], bins: Optional[int]) -> dict[str, torch.Tensor]:
    """Statistics of captured steps sharing one layout: ``raw`` [S, n, len(RAW)] and, for the rows
    with ``want_hist``, ``hist`` [H, n, bins] (estimates of whole-tensor counts) and ``range`` [H, n, 2]."""
    layout: Layout = rows[0]["layout"]
    s, n, dev = len(rows), layout.n, layout.device
    x = torch.cat([r["x"] for r in rows])  # [S*K]: step after step, parameter after parameter
    # Arithmetic, not comparisons: on a CPU these vectorise where boolean masks do not.
    finite = x.nan_to_num(0.0, 0.0, 0.0)  # NaN and ±Inf -> 0
    odd = x - finite  # 0 where finite, else the NaN or the infinity itself
    # Counts of (finite |x|, non-zero finite, +Inf, -Inf, NaN) in one segment sum; exact in float32
    # while every segment is shorter than 2**24 elements.
    columns = torch.cat([finite.abs(), finite.sign().abs(), odd.nan_to_num(0.0, 1.0, 0.0),
                         odd.nan_to_num(0.0, 0.0, 1.0), odd.nan_to_num(1.0, 0.0, 0.0)])
    if max(layout.lengths) >= 1 << 24:
        columns = columns.double()
    sums = torch.segment_reduce(columns, "sum", lengths=layout.lengths_for(5 * s), unsafe=True).view(5, s, n).double()
    abs_sum, nonzero, n_pos, n_neg, n_nan = sums.unbind(0)
    total = torch.segment_reduce(x.double(), "sum", lengths=layout.lengths_for(s), unsafe=True).view(s, n)
    zeros = layout.k - nonzero - n_pos - n_neg - n_nan
    # The finite range: the largest of x and of -x over the finite elements, in one scatter.
    ends = torch.cat([x.nan_to_num(-math.inf, -math.inf, -math.inf), (-x).nan_to_num(-math.inf, -math.inf, -math.inf)])
    ends = torch.full((2 * s * n,), -math.inf, device=dev).scatter_reduce_(0, layout.segments(2 * s), ends, "amax")
    ends = ends.view(2, s, n).double()
    lo, hi = -ends[1], ends[0]
    n_finite = layout.k - n_nan - n_pos - n_neg
    lowest = torch.where(n_nan > 0, math.nan, torch.where(n_neg > 0, -math.inf, lo))  # what aminmax gives
    highest = torch.where(n_nan > 0, math.nan, torch.where(n_pos > 0, math.inf, hi))
    raw = torch.stack([torch.stack([r["norm"] for r in rows]).double(), total, lowest, highest,
                       abs_sum / n_finite.clamp(min=1), zeros / layout.k, n_nan / layout.k,
                       (n_pos + n_neg) / layout.k, torch.stack([r["param_norm"] for r in rows]).double(),
                       _update_ratios(rows, layout)], 2)
    if layout.big:  # sum, min and max of sampled parameters were taken exactly at the step
        big = torch.stack([r["big"] for r in rows]).double()  # [S, B, 3]
        raw[:, layout.big_index, COL["sum"]:COL["max"] + 1] = big
    out = {"raw": raw.float()}
    wanted = [i for i, r in enumerate(rows) if r.get("want_hist")]
    if bins and wanted:
        out["hist"], out["range"] = _histograms(rows, wanted, layout, lo, hi, n_finite, bins)
    return out


def _update_ratios(rows: list[dict[str, Any]], layout: Layout) -> torch.Tensor:
    """‖Δw‖/‖w‖ per parameter from the samples of w before and after the step (NaN without a step)."""
    s, n = len(rows), layout.n
    stepped = [r for r in rows if "after" in r]
    none = torch.full((n,), math.nan, dtype=torch.float64, device=layout.device)
    if not stepped:
        return none.expand(s, n)
    before = torch.cat([r["before"] for r in stepped])
    after = torch.cat([r["after"] for r in stepped])
    squares = torch.cat([(after - before).square(), before.square()]).double()
    sums = torch.segment_reduce(squares, "sum", lengths=layout.lengths_for(2 * len(stepped)), unsafe=True)
    moved, size = sums.view(2, len(stepped), n).sqrt().unbind(0)
    ratios = iter((moved / size).unbind(0))
    # Rows picked in Python, not by a list index: that index would be copied to the device first.
    return torch.stack([next(ratios) if "after" in r else none for r in rows])


def _histograms(rows: list[dict[str, Any]], wanted: list[int], layout: Layout, lo: torch.Tensor,
                hi: torch.Tensor, n_finite: torch.Tensor, bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One histogram per parameter and wanted step over its sample's own finite range, all in one
    ``index_add_``; counts are scaled from the sample to the whole tensor."""
    h, n = len(wanted), layout.n
    x = torch.cat([rows[i]["x"] for i in wanted])
    pick = (lambda t: t) if h == len(rows) else (lambda t: torch.stack([t[i] for i in wanted]))  # noqa: E731
    lo, hi, valid = pick(lo).float(), pick(hi).float(), pick(n_finite) > 0  # [H, n]
    pad = torch.where(hi > lo, 0.0, torch.clamp(lo.abs() * 1e-3, min=1e-12))
    lo, hi = torch.where(valid, lo - pad, math.nan), torch.where(valid, hi + pad, math.nan)
    seg = layout.segments(h)
    lo_e, width_e = lo.reshape(-1).index_select(0, seg), (hi - lo).reshape(-1).index_select(0, seg)
    finite = (x - x).nan_to_num(1.0, 1.0, 1.0).neg_().add_(1.0)  # 1 where finite, else 0
    bin_of = ((x - lo_e) / width_e * bins).nan_to_num(0.0, 0.0, 0.0).floor_().clamp_(0, bins - 1).long()
    counts = torch.zeros(h * n * bins, device=layout.device).index_add_(0, seg * bins + bin_of, finite).view(h, n, bins)
    scale = (layout.numel / layout.k).float()
    return counts * scale[None, :, None], torch.stack([lo, hi], 2)


def norms_only(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """``raw`` with only the norms and update ratios: for a step whose other statistics the exact
    recomputation at exit replaces (its samples need no reduction)."""
    layout: Layout = rows[0]["layout"]
    raw = torch.full((len(rows), layout.n, len(RAW)), math.nan, dtype=torch.float64, device=layout.device)
    raw[:, :, COL["norm"]] = torch.stack([r["norm"] for r in rows])
    raw[:, :, COL["param_norm"]] = torch.stack([r["param_norm"] for r in rows])
    raw[:, :, COL["update_ratio"]] = _update_ratios(rows, layout)
    return {"raw": raw.float()}
