"""Per-step gradient statistics in two halves, for :mod:`torch_nbdebug.record.grads`.

:func:`sampled_rows` runs at each step and only captures: the fixed sample of every gradient
(parameters of at most ``sample`` elements whole) gathered into one flat tensor of a few dense
blocks (:class:`Layout`), the exact L2 norms of gradients and parameters (one batched
``_foreach_norm``), and the exact sum/min/max of the few parameters too large to be taken whole.
A handful of op calls whatever the number of parameters, and no host synchronisation.

:func:`reduce_rows` turns many captured steps into statistics at once, when the recorder flushes
(every ``_FLUSH`` steps, when the kept samples reach their memory bound, or at the end): counts,
sums and ranges per parameter are reductions along the rows of each block, over all steps'
samples together, and the histograms one ``index_add_`` per block for every parameter of every
step. The results are the numbers a per-step, per-parameter path gives (counts exact, sums
pairwise in float32, as the exact path takes them), so the views keep their precision; what moved
is when, and how many Python calls and passes over memory it takes.
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
    wide = {i for i, t in enumerate(tensors) if t.dtype == torch.float64}  # cannot accumulate in float32
    if not wide:
        return compat.foreach_norm(tensors, ord, dtype=torch.float32)
    narrow = [i for i in range(len(tensors)) if i not in wide]
    out: list[torch.Tensor] = [torch.empty(0)] * len(tensors)
    if narrow:
        for i, norm in zip(narrow, compat.foreach_norm([tensors[i] for i in narrow], ord, dtype=torch.float32)):
            out[i] = norm
    for i, norm in zip(sorted(wide), compat.foreach_norm([tensors[i] for i in sorted(wide)], ord)):
        out[i] = norm.float()
    return out


class Bucket:
    """Parameters whose samples are padded to one ``width`` (a power of two, at least ``_MIN_WIDTH``),
    laid out as a dense ``[len(positions), width]`` block of a captured sample from ``start`` on."""

    def __init__(self, positions: list[int], k: torch.Tensor, width: int, start: int) -> None:
        self.positions, self.width, self.start = positions, width, start
        self.stop = start + len(positions) * width
        inside = torch.arange(width, device=k.device)[None, :] < k[:, None]  # [g, width]; k: the rows' lengths
        self.fill = torch.where(inside, 0.0, -math.inf)  # added before a max: padding never wins
        self.offsets: dict[int, torch.Tensor] = {}  # first histogram bin of each (step, parameter) row

    def block(self, x: torch.Tensor) -> torch.Tensor:
        """This bucket's ``[S, g, width]`` view of captured samples ``x`` [S, size]."""
        return x[:, self.start:self.stop].view(len(x), len(self.positions), self.width)

    def bin_offsets(self, rows: int, bins: int) -> torch.Tensor:
        if rows not in self.offsets:
            if len(self.offsets) >= 4:  # a few sizes kept: the number of steps per flush rarely changes
                self.offsets.clear()
            n = len(self.positions)
            self.offsets[rows] = (torch.arange(rows * n, device=self.fill.device) * bins).view(rows, n, 1)
        return self.offsets[rows]


_MIN_WIDTH = 256  # narrower samples share one bucket: a few wasted elements cost less than more ops


class Layout:
    """Device constants of one set of parameters with a gradient (``present``), built once.

    A captured sample is one flat tensor made of a few dense blocks (:class:`Bucket`): parameters
    with samples of similar length, each row zero padded to a common power-of-two width. Every
    statistic is then a reduction along the last dimension of a block: a handful of vectorised ops
    per block, where a ragged layout needed a segment number for every element (and the padding is
    at most the sample itself). ``lengths``: elements of each parameter in the sample; ``big``:
    positions (within ``present``) of the parameters sampled rather than taken whole;
    ``k``/``numel``: sample and tensor sizes; ``unorder`` puts the blocks' rows back in ``present`` order.
    """

    def __init__(self, sampler: "Sampler", present: tuple[int, ...], device: torch.device) -> None:
        self.present, self.device, self.n = present, device, len(present)
        self.lengths = [int(sampler.count[i]) for i in present]
        self.big = [j for j, i in enumerate(present) if not sampler.exact[i]]
        self.same_device = all(sampler.devices[i] == device for i in present)
        widths: dict[int, list[int]] = {}
        for j, length in enumerate(self.lengths):
            widths.setdefault(max(_MIN_WIDTH, 1 << (length - 1).bit_length()), []).append(j)
        self.order = [j for _, positions in sorted(widths.items(), reverse=True) for j in positions]  # gather order
        n = self.n
        # Two host-to-device copies in all (each one waits for the device on a GPU), sliced on the device.
        floats = torch.tensor(self.lengths + [float(sampler.numel[i]) for i in present] +
                              [float(self.lengths[j]) for j in self.order], dtype=torch.float64).to(device)
        ints = torch.tensor(np.concatenate([np.argsort(self.order), self.order, self.big]).astype(np.int64)).to(device)
        self.k, self.numel, k_ordered = floats[:n], floats[n:2 * n], floats[2 * n:]
        self.unorder, order_index, self.big_index = ints[:n], ints[n:2 * n], ints[2 * n:]
        self.buckets: list[Bucket] = []
        start = row = 0
        for width, positions in sorted(widths.items(), reverse=True):
            self.buckets.append(Bucket(positions, k_ordered[row:row + len(positions)], width, start))
            start, row = self.buckets[-1].stop, row + len(positions)
        self.size = start  # elements of one captured sample, padding included
        self.order_index = None if self.order == list(range(n)) else order_index
        self.pad = torch.zeros(max(b.width for b in self.buckets), device=device)  # sliced, never written

    def release(self) -> None:
        """Drop the cached histogram offsets (the rest is a few constants per parameter)."""
        for bucket in self.buckets:
            bucket.offsets.clear()


def sample_indices(numel: int, k: int) -> np.ndarray:
    """``k`` sorted random element indices of a tensor of ``numel`` elements, from a private numpy
    generator seeded by the size: the same elements every time, the user's RNG state untouched."""
    # Drawn anew per recording, never cached at module level: a tool's tensor left alive after it ends
    # would show in the user's memory views (and hold device memory). Drawn and sorted by numpy: a CPU
    # torch sort of a few thousand indices takes ten times longer.
    return np.sort(np.random.default_rng(0x5EED + numel).integers(0, numel, k, dtype=np.int64))


class Sampler:
    """Fixed random element indices per parameter; parameters with at most ``k`` elements are taken whole."""

    def __init__(self, params: list[torch.nn.Parameter], k: int) -> None:
        self.index: list[Optional[torch.Tensor]] = []
        self.count = np.zeros(len(params))
        self.numel = np.array([p.numel() for p in params], dtype=np.float64)
        self.devices = [p.device for p in params]
        drawn: dict[torch.device, list[tuple[int, np.ndarray]]] = {}
        for i, p in enumerate(params):
            n = p.numel()
            whole = n <= k
            self.index.append(None)
            if not whole:
                drawn.setdefault(p.device, []).append((i, sample_indices(n, k)))
            self.count[i] = n if whole else k
        for device, indices in drawn.items():  # one host-to-device copy per device, sliced there
            flat = torch.from_numpy(np.concatenate([ix for _, ix in indices])).to(device)
            for j, (i, _) in enumerate(indices):
                self.index[i] = flat[j * k:(j + 1) * k]
        self.exact = self.count >= self.numel
        self._layouts: dict[tuple[tuple[int, ...], torch.device], Layout] = {}

    def layout(self, present: tuple[int, ...], device: torch.device) -> Layout:
        key = (present, device)
        if key not in self._layouts:
            self._layouts[key] = Layout(self, present, device)
        return self._layouts[key]

    def release(self) -> None:
        """Drop the cached histogram offsets (one per step and parameter) once recording is over."""
        for layout in self._layouts.values():
            layout.release()

    def gather(self, tensors: list[torch.Tensor], layout: Layout) -> torch.Tensor:
        """The samples of ``tensors`` (one per ``layout.present``) as one flat float32 tensor in the
        layout's blocks, each row zero padded: one ``cat`` whatever the number of parameters."""
        index, pad = self.index, layout.pad
        parts: list[torch.Tensor] = []
        for bucket in layout.buckets:
            for j in bucket.positions:
                flat = tensors[j].detach().reshape(-1)
                i = layout.present[j]
                parts.append(flat if index[i] is None else flat.index_select(0, index[i]))
                if layout.lengths[j] < bucket.width:
                    parts.append(pad[:bucket.width - layout.lengths[j]])
        if not layout.same_device:
            parts = [p.to(layout.device) for p in parts]
        x = torch.cat(parts)
        return x if x.dtype == torch.float32 else x.float()


def sampled_rows(params: list[torch.nn.Parameter], present: tuple[int, ...], sampler: Sampler
                 ) -> dict[str, Any]:
    """Capture one step on the device, no host synchronisation: see the module docstring."""
    grads = [params[i].grad.detach() for i in present]
    layout = sampler.layout(present, grads[0].device)
    # Gradient and parameter norms in one batched call (one kernel launch on a GPU).
    norms = torch.stack(float_norms(grads + [params[i].detach() for i in present])).to(layout.device)
    captured: dict[str, Any] = {"layout": layout, "x": sampler.gather(grads, layout),
                                "norm": norms[:layout.n], "param_norm": norms[layout.n:]}
    if layout.big:  # exact even though their other statistics come from the sample
        big = [grads[j] for j in layout.big]
        minmax = [torch.aminmax(g) for g in big]
        columns = [[g.sum(dtype=torch.float32) for g in big], [m.min for m in minmax], [m.max for m in minmax]]
        if not layout.same_device:
            columns = [[t.to(layout.device) for t in column] for column in columns]
        captured["big"] = torch.stack([torch.stack(column).float() for column in columns], 1)  # [B, 3]
    return captured


def reduce_rows(rows: list[dict[str, Any]], bins: Optional[int]) -> dict[str, torch.Tensor]:
    """Statistics of captured steps sharing one layout: ``raw`` [S, n, len(RAW)] and, for the rows
    with ``want_hist``, ``hist`` [H, n, bins] (estimates of whole-tensor counts) and ``range`` [H, n, 2]."""
    layout: Layout = rows[0]["layout"]
    x = torch.stack([r["x"] for r in rows])  # [S, size]: the blocks of every step
    blocks = [_block_sums(b.block(x), b.fill) for b in layout.buckets]
    cols = torch.cat(blocks, 1).index_select(1, layout.unorder).double()  # [S, n, 8] in present order
    abs_sum, nonzero, n_pos, n_neg, n_nan, total, lo, hi = (*cols.unbind(2)[:6], -cols[:, :, 6], cols[:, :, 7])
    zeros = layout.k - nonzero - n_pos - n_neg - n_nan
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
        out["hist"], out["range"] = _histograms(x, wanted, layout, lo, hi, n_finite, bins)
    return out


def _block_sums(x: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """Per row of a block ``[S, g, width]`` (zero padded): sum of finite |x|, finite non-zeros, +Inf,
    -Inf, NaN, sum of x, -min and max of the finite elements, as ``[S, g, 8]``. Arithmetic and
    float32 sums, not comparisons and float64 casts: on a CPU these vectorise and those do not;
    float32 counts are exact below 2**24 elements, float32 sums are pairwise."""
    wide = torch.float64 if x.shape[-1] >= 1 << 24 else torch.float32
    finite = x.nan_to_num(0.0, 0.0, 0.0)  # NaN and ±Inf -> 0; the padding is 0 and counts nowhere
    odd = x - finite  # 0 where finite, else the NaN or the infinity itself
    sums = [t.sum(-1, dtype=wide).float() for t in (
        finite.abs(), finite.sign().abs_(), odd.nan_to_num(0.0, 1.0, 0.0), odd.nan_to_num(0.0, 0.0, 1.0),
        odd.nan_to_num(1.0, 0.0, 0.0), x)]
    # The finite range: the largest of x and of -x, non-finite values and the padding at -inf.
    ends = [(t.nan_to_num(-math.inf, -math.inf, -math.inf) + fill).amax(-1) for t in (-x, x)]
    return torch.stack(sums + ends, 2)


def _update_ratios(rows: list[dict[str, Any]], layout: Layout) -> torch.Tensor:
    """‖Δw‖/‖w‖ per parameter from the samples of w before and after the step (NaN without a step)."""
    s, n = len(rows), layout.n
    stepped = [r for r in rows if "after" in r]
    none = torch.full((n,), math.nan, dtype=torch.float64, device=layout.device)
    if not stepped:
        return none.expand(s, n)
    before = torch.stack([r["before"] for r in stepped])  # [T, size]; padding 0 in both
    after = torch.stack([r["after"] for r in stepped])
    squares = torch.stack([(after - before).square_(), before.square()])  # [2, T, size]
    sums = torch.cat([b.block(squares.view(-1, layout.size)).sum(-1) for b in layout.buckets], 1)  # float32: pairwise
    moved, size = sums.index_select(1, layout.unorder).double().sqrt_().view(2, len(stepped), n).unbind(0)
    ratios = iter((moved / size).unbind(0))
    # Rows picked in Python, not by a list index: that index would be copied to the device first.
    return torch.stack([next(ratios) if "after" in r else none for r in rows])


def _histograms(x: torch.Tensor, wanted: list[int], layout: Layout, lo: torch.Tensor,
                hi: torch.Tensor, n_finite: torch.Tensor, bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One histogram per parameter and wanted step over its sample's own finite range, one
    ``index_add_`` per block; counts are scaled from the sample to the whole tensor."""
    h = len(wanted)
    pick = (lambda t: t) if h == len(x) else (lambda t: torch.stack([t[i] for i in wanted]))  # noqa: E731
    x, lo, hi, valid = pick(x), pick(lo).float(), pick(hi).float(), pick(n_finite) > 0  # [H, size], [H, n]
    pad = torch.where(hi > lo, 0.0, torch.clamp(lo.abs() * 1e-3, min=1e-12))
    lo, hi = torch.where(valid, lo - pad, math.nan), torch.where(valid, hi + pad, math.nan)
    order = layout.order_index
    lo_b, width_b = (lo, hi - lo) if order is None else (lo.index_select(1, order), (hi - lo).index_select(1, order))
    counts: list[torch.Tensor] = []
    start = 0
    for b in layout.buckets:
        g = len(b.positions)
        counts.append(_block_counts(b.block(x), b, lo_b[:, start:start + g], width_b[:, start:start + g], bins))
        start += g
    scale = (layout.numel / layout.k).float()
    hist = torch.cat(counts, 1) if order is None else torch.cat(counts, 1).index_select(1, layout.unorder)
    return hist * scale[None, :, None], torch.stack([lo, hi], 2)


def _block_counts(x: torch.Tensor, bucket: Bucket, lo: torch.Tensor, width: torch.Tensor, bins: int) -> torch.Tensor:
    """Histograms ``[H, g, bins]`` of a block's rows over [lo, lo + width], the bin of a value
    ``floor((x - lo) / width * bins)``. Two spare bins past the last of each row: ``bins`` takes the values
    equal to the top (folded into the last bin, as ``histc`` does), ``bins + 1`` the non-finite
    values and the padding (at -inf); no clamp, no mask."""
    h, g = x.shape[0], x.shape[1]
    spread = ((x + bucket.fill - lo[..., None]) / width[..., None] * bins).nan_to_num_(bins + 1, bins + 1, bins + 1)
    index = (spread.floor_().long() + bucket.bin_offsets(h, bins + 2)).view(-1)
    ones = torch.ones((), device=x.device).expand(index.shape)
    counts = torch.zeros(h * g * (bins + 2), device=x.device).index_add_(0, index, ones).view(h, g, bins + 2)
    return torch.cat([counts[:, :, :bins - 1], counts[:, :, bins - 1:bins + 1].sum(2, keepdim=True)], 2)


def norms_only(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """``raw`` with only the norms and update ratios: for a step whose other statistics the exact
    recomputation at exit replaces (its samples need no reduction)."""
    layout: Layout = rows[0]["layout"]
    raw = torch.full((len(rows), layout.n, len(RAW)), math.nan, dtype=torch.float64, device=layout.device)
    raw[:, :, COL["norm"]] = torch.stack([r["norm"] for r in rows])
    raw[:, :, COL["param_norm"]] = torch.stack([r["param_norm"] for r in rows])
    raw[:, :, COL["update_ratio"]] = _update_ratios(rows, layout)
    return {"raw": raw.float()}
