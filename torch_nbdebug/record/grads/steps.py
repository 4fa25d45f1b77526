"""Per-step gradient statistics in two halves, for :mod:`torch_nbdebug.record.grads`.

:func:`sampled_rows` runs at each step and only captures: the fixed sample of every gradient
(parameters of at most ``sample`` elements whole) gathered into one flat tensor of a few dense
blocks (:class:`Layout`), the exact L2 norms of gradients and parameters (one batched
``_foreach_norm``), and the exact sum/min/max of the few parameters too large to be taken whole.
A handful of op calls whatever the number of parameters, and no host synchronisation.

:func:`reduce_rows` turns many captured steps into statistics at once, when the recorder flushes
(every ``_FLUSH`` steps, when the kept samples reach their memory bound, or at the end): counts,
sums and ranges per parameter are reductions along the rows of each block, over all steps'
samples together, and the histograms one count (:func:`_count`) per block for every parameter of every
step. The results are the numbers a per-step, per-parameter path gives (counts exact, sums
pairwise in float32, as the exact path takes them), so the views keep their precision; what moved
is when, and how many Python calls and passes over memory it takes.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional

import numpy as np
import torch

from torch_nbdebug.record import compat

RAW = ("norm", "sum", "min", "max", "mean_abs", "zeros", "nan", "inf", "param_norm", "update_ratio")
COL = {name: i for i, name in enumerate(RAW)}


def present_grads(params: list[torch.nn.Parameter], present: "tuple[int, ...] | list[int]") -> list[torch.Tensor]:
    """The gradients of the parameters at ``present``: those found holding one when the step began."""
    grads: list[torch.Tensor] = []
    for i in present:
        grad = params[i].grad
        if grad is None:
            raise RuntimeError(f"parameter {i} lost its gradient while the step was being recorded")
        grads.append(grad)
    return grads


def float_norms(tensors: list[torch.Tensor], ord: float = 2) -> list[torch.Tensor]:
    """Batched float32 norms: a half-precision norm above 65504 would read as a false Inf. float64 ones
    where some tensor is float64 (its norm may lie beyond float32's range), every one of them then."""
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
        out[i] = norm
    return [t.double() for t in out]


class Bucket:
    """Parameters whose samples are padded to one ``width`` (a power of two, at least ``_MIN_WIDTH``),
    laid out as a dense ``[len(positions), width]`` block of a captured sample from ``start`` on."""

    def __init__(self, positions: list[int], k: torch.Tensor, width: int, start: int, padded: bool = True) -> None:
        self.positions, self.width, self.start = positions, width, start
        self.padded = padded  # False: every row is ``width`` long, ``fill`` all zeros
        self.stop = start + len(positions) * width
        # added before a max: padding never wins (float32 whatever the default dtype, as the samples); without
        # padding, zeros all along: one zero seen as the block's shape (building a block's worth costs more
        # than the step it is built at)
        if padded:
            inside = torch.arange(width, dtype=k.dtype, device=k.device)[None, :] < k[:, None]  # k: rows' lengths
            self.fill = torch.zeros(inside.shape, dtype=torch.float32, device=k.device).masked_fill_(~inside, -math.inf)
        else:
            self.fill = torch.zeros((), dtype=torch.float32, device=k.device).expand(len(positions), width)
        self.offsets: dict[int, torch.Tensor] = {}  # first histogram bin of each (step, parameter) row

    def block(self, x: torch.Tensor) -> torch.Tensor:
        """This bucket's ``[S, g, width]`` view of captured samples ``x`` [S, size]."""
        return x[:, self.start:self.stop].view(len(x), len(self.positions), self.width)

    def bin_offsets(self, rows: int, bins: int) -> torch.Tensor:
        if rows not in self.offsets:
            if len(self.offsets) >= 4:  # a few sizes kept: the number of steps per flush rarely changes
                self.offsets.clear()
            n = len(self.positions)
            # int32 (see _count) while every slot's number fits in it
            dtype = torch.int32 if rows * n * bins < _INT32_SLOTS else torch.int64
            first = torch.arange(rows * n, dtype=dtype, device=self.fill.device)
            self.offsets[rows] = (first * bins).view(rows, n, 1)
        return self.offsets[rows]


_INT32_SLOTS = 1 << 31  # histogram slots of a block numbered in int32 below this, in int64 from it


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
        self.sizes = [float(sampler.numel[i]) for i in present]  # elements of each tensor, on the host
        self.big = [j for j, i in enumerate(present) if not sampler.exact[i]]
        # float64 samples where a gradient is float64: float32 would make its values past 3.4e38 Inf
        self.dtype = torch.float64 if any(sampler.wide[i] for i in present) else torch.float32
        self.same_device = all(sampler.devices[i] == device for i in present)
        widths: dict[int, list[int]] = {}
        for j, length in enumerate(self.lengths):
            widths.setdefault(max(_MIN_WIDTH, 1 << (length - 1).bit_length()), []).append(j)
        self.order = [j for _, positions in sorted(widths.items(), reverse=True) for j in positions]  # gather order
        n = self.n
        # Two host-to-device copies in all (each one waits for the device on a GPU), sliced on the device.
        # (numpy arrays, not Python lists: torch.tensor reads a list's numbers one by one)
        lengths = np.array(self.lengths, dtype=np.float64)
        floats = torch.from_numpy(np.concatenate([lengths, self.sizes, lengths[self.order]])).to(device)
        ints = torch.from_numpy(np.concatenate([np.argsort(self.order), self.order, self.big]).astype(np.int64)).to(device)
        self.k, self.numel, k_ordered = floats[:n], floats[n:2 * n], floats[2 * n:]
        self.unorder, order_index, self.big_index = ints[:n], ints[n:2 * n], ints[2 * n:]
        self.buckets: list[Bucket] = []
        start = row = 0
        for width, positions in sorted(widths.items(), reverse=True):
            padded = any(self.lengths[j] < width for j in positions)
            self.buckets.append(Bucket(positions, k_ordered[row:row + len(positions)], width, start, padded))
            start, row = self.buckets[-1].stop, row + len(positions)
        self.size = start  # elements of one captured sample, padding included
        self.order_index = None if self.order == list(range(n)) else order_index
        pad = torch.zeros(max(b.width for b in self.buckets), dtype=torch.float32, device=device)  # sliced, not written
        pads = {m: pad[:m] for m in {b.width - self.lengths[j] for b in self.buckets for j in b.positions} if m}
        # What a gather appends, in order: each parameter then its row's padding (sliced once per length, here).
        self.plan = [(j, present[j], pads.get(b.width - self.lengths[j])) for b in self.buckets for j in b.positions]

    def sample_of(self, x: torch.Tensor, j: int) -> torch.Tensor:
        """The sample of the parameter at position ``j`` (within ``present``) in a captured row ``x``."""
        for bucket in self.buckets:
            if j in bucket.positions:
                start = bucket.start + bucket.positions.index(j) * bucket.width
                return x[start:start + self.lengths[j]]
        raise ValueError(f"position {j} is not in this layout")

    def release(self) -> None:
        """Drop the cached histogram offsets (the rest is a few constants per parameter)."""
        for bucket in self.buckets:
            bucket.offsets.clear()


def sample_indices(numel: int, k: int) -> np.ndarray:
    """``k`` sorted random element indices of a tensor of ``numel`` elements, from a private numpy
    generator seeded by the size: the same elements every time, the user's RNG state untouched."""
    # Kept on the host only (a few, small: see _cached_indices), never as tensors at module level: a
    # tool's tensor left alive after it ends would show in the user's memory views (and hold device
    # memory). Drawn and sorted by numpy: a CPU torch sort of a few thousand indices takes ten times longer.
    if k <= _CACHED_K:
        return _cached_indices(numel, k)
    return _draw_indices(numel, k)


_CACHED_K = 1 << 16  # samples up to 512 KB of indices are remembered between recordings, 64 of them at most


def _draw_indices(numel: int, k: int) -> np.ndarray:
    return np.sort(np.random.default_rng(0x5EED + numel).integers(0, numel, k, dtype=np.int64))


@functools.lru_cache(maxsize=64)
def _cached_indices(numel: int, k: int) -> np.ndarray:
    """Drawing costs tens of microseconds per parameter at every recording's start: drawn once per size."""
    drawn = _draw_indices(numel, k)
    drawn.flags.writeable = False  # shared by every recording of that size
    return drawn


class Sampler:
    """Fixed random element indices per parameter; parameters with at most ``k`` elements are taken whole."""

    def __init__(self, params: list[torch.nn.Parameter], k: int) -> None:
        self.index: list[Optional[torch.Tensor]] = []
        self.count = np.zeros(len(params))
        self.numel = np.array([p.numel() for p in params], dtype=np.float64)
        self.devices = [p.device for p in params]
        self.wide = [p.dtype == torch.float64 for p in params]
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

    def gather(self, tensors: list[torch.Tensor], layout: Layout, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The samples of ``tensors`` (one per ``layout.present``) as one flat tensor (``layout.dtype``) in the
        layout's blocks, each row zero padded: one ``cat`` whatever the number of parameters, written
        into ``out`` when given (a row of a :class:`Chunk`). Called under ``no_grad`` (no ``detach``
        per tensor: each one costs a tensor object per step)."""
        index = self.index
        parts: list[torch.Tensor] = []
        # A vector is flat already (a view per tensor is an op call each). A sampled tensor is read through
        # its flat view by ``index_select``: a view and a plain 1-D gather cost a CPU half what ``take``'s
        # strided indexing does (measured on the 2-layer GPT's weights: 8 + 2 µs against 21 µs); ``take``
        # only for a tensor with no flat view.
        for j, i, pad in layout.plan:
            tensor, picked = tensors[j], index[i]
            if picked is not None:
                parts.append(tensor.view(-1).index_select(0, picked) if tensor.is_contiguous()
                             else torch.take(tensor, picked))
            else:
                parts.append(tensor if tensor.dim() == 1 else tensor.reshape(-1))
            if pad is not None:
                parts.append(pad)
        if not layout.same_device:
            parts = [p.to(layout.device) for p in parts]
        if out is not None:
            return torch.cat(parts, out=out)  # cast to float32 on the way, as .float() would
        x = torch.cat(parts)
        return x if x.dtype == layout.dtype else x.to(layout.dtype)


class Chunk:
    """Rows allocated ahead for the samples of steps sharing one layout: a step's gradient sample is
    written into a row of ``x``, the weights' before and after the step into the two rows of ``w``
    (reused at every step: :func:`update_squares` reduces them as soon as the step is over). A flush
    then reduces a slice of ``x`` rather than a stack of per-step copies, and a long recording writes
    into the same memory again (a flushed chunk is reused) rather than allocating a sample per step,
    whose fresh pages a CPU faults in one by one (a few microseconds each). float32 whatever the
    default dtype, float64 for a layout with a float64 gradient (:attr:`Layout.dtype`): ``cat(out=)``
    casts the samples to the buffer's dtype."""

    def __init__(self, layout: Layout, capacity: int) -> None:
        self.layout, self.capacity, self.used = layout, capacity, 0
        self.x = torch.empty(capacity, layout.size, dtype=layout.dtype, device=layout.device)
        self.w: Optional[torch.Tensor] = None  # [2, size]: allocated at the first optimizer step
        # What the recorder's memory bound counts: x and two weight rows per step, as when every step
        # kept its weights' samples (the recorder flushes at the same steps; w holds fewer since).
        self.elements = 3 * capacity * layout.size * (layout.dtype.itemsize // 4)  # float32 elements

    def take(self) -> int:
        """The next free row (the caller checks ``used < capacity``)."""
        self.used += 1
        return self.used - 1

    def weights(self) -> torch.Tensor:
        if self.w is None:
            self.w = torch.empty(2, self.layout.size, dtype=self.layout.dtype, device=self.layout.device)
        return self.w


class Chunks:
    """Where the steps' samples are written, and the memory that takes.

    A row goes to the current chunk while it has room and the parameter set stays, else to a chunk of
    that set with room (a set seen again in the window fills its own chunk), else to a new chunk. The
    first chunk has ``rows(layout)`` rows; a new one has one row when the set changed (mixture-of-experts
    routing or LayerDrop change it at every step: a window's worth of rows per set would stay nearly
    empty), and twice the rows of the one just filled while the set stays (``rows(layout)`` at most): a
    steady set soon writes into one chunk, a changing one into chunks about as long as the runs of
    steps it stays the same. A new chunk first takes the memory of the chunks holding no row (free since
    the last flush); :meth:`over` tells the recorder when it must flush first to keep the chunks, with
    their weights' rows, within its bound."""

    def __init__(self, rows: Callable[[Layout], int]) -> None:
        self.rows = rows
        self.chunks: list[Chunk] = []  # every chunk held, with rows or free
        self.current: Optional[Chunk] = None
        self.previous: Optional[Layout] = None  # the layout of the last row written

    def over(self, layout: Layout, limit: int) -> bool:
        """Whether a row of ``layout`` needs a new chunk that, with the chunks holding rows, exceeds
        ``limit`` elements (then flush first: every chunk is free again)."""
        if self._room(layout) is not None:
            return False
        busy = sum(c.elements for c in self.chunks if c.used)
        return busy + 3 * self._new_rows(layout) * layout.size > limit

    def row_for(self, layout: Layout) -> tuple[Chunk, int]:
        chunk = self._room(layout)
        if chunk is None:
            self.chunks = [c for c in self.chunks if c.used]  # the free ones (of other sets) go first
            chunk = Chunk(layout, self._new_rows(layout))
            self.chunks.append(chunk)
        self.current, self.previous = chunk, layout
        return chunk, chunk.take()

    def _room(self, layout: Layout) -> Optional[Chunk]:
        """The chunk a row of ``layout`` is written into without allocating, if any."""
        chunk = self.current
        if chunk is not None and chunk.layout is layout and chunk.used < chunk.capacity:
            return chunk
        fits = [c for c in self.chunks if c.layout is layout and c.used < c.capacity]
        return max(fits, key=lambda c: c.capacity - c.used) if fits else None

    def _new_rows(self, layout: Layout) -> int:
        full, last = self.rows(layout), self.current  # the chunk of the previous row, if not flushed since
        if self.previous is None:
            return full
        if layout is not self.previous:
            return 1
        return full if last is None else min(full, 2 * last.capacity)

    def recycle(self) -> None:
        """Every row has been flushed (reduced and copied to the host): later steps write over them.
        A chunk the window left mostly empty (the first chunk of a set that then changed) is dropped:
        the next window would leave it as empty."""
        self.chunks = [c for c in self.chunks if 2 * c.used >= c.capacity]
        for chunk in self.chunks:
            chunk.used = 0
        self.current = None

    def release(self) -> None:
        self.chunks, self.current, self.previous = [], None, None


def stacked(rows: list[dict[str, Any]]) -> torch.Tensor:
    """The rows' gradient samples as one ``[S, size]`` tensor: a slice of their chunk when they are
    its consecutive rows (no copy), else a stack."""
    chunk, slot = rows[0].get("chunk"), rows[0].get("slot", 0)
    if chunk is not None and all(r.get("chunk") is chunk and r.get("slot") == slot + k for k, r in enumerate(rows)):
        return chunk.x[slot:slot + len(rows)]
    return torch.stack([r["x"] for r in rows])


def update_squares(layout: Layout, weights: torch.Tensor) -> torch.Tensor:
    """``[2, n]`` (block order): ‖w‖² and ‖Δw‖² of each parameter's sample, from ``weights``
    ``[2, size]``, the samples before and after a step (overwritten). Right after the step: its
    two rows are then free for the next step, and a flush reduces ``n`` numbers per step, not two samples."""
    weights[1].sub_(weights[0])
    weights.square_()  # padding 0 in both
    return torch.cat([b.block(weights).sum(-1) for b in layout.buckets], 1)  # float32: pairwise


def sampled_rows(params: list[torch.nn.Parameter], grads: list[torch.Tensor], layout: Layout, sampler: Sampler,
                 chunk: Chunk, slot: int) -> dict[str, Any]:
    """Capture one step on the device, no host synchronisation: see the module docstring. The
    gradients ``grads`` of ``layout.present`` (:func:`present_grads`), sampled into row ``slot`` of
    ``chunk``. Called under ``no_grad``, as :meth:`Sampler.gather`."""
    # Gradient and parameter norms in one batched call (one kernel launch on a GPU).
    norms = torch.stack(float_norms(grads + [params[i] for i in layout.present])).to(layout.device)
    captured: dict[str, Any] = {"layout": layout, "chunk": chunk, "slot": slot,
                                "x": sampler.gather(grads, layout, chunk.x[slot]),
                                "norm": norms[:layout.n], "param_norm": norms[layout.n:]}
    if layout.big:  # exact even though their other statistics come from the sample
        big = [grads[j] for j in layout.big]
        minmax = [torch.aminmax(g) for g in big]
        columns = [[g.sum(dtype=layout.dtype) for g in big], [m.min for m in minmax], [m.max for m in minmax]]
        if not layout.same_device:
            columns = [[t.to(layout.device) for t in column] for column in columns]
        captured["big"] = torch.stack([torch.stack(column).to(layout.dtype) for column in columns], 1)  # [B, 3]
    return captured


def reduce_rows(rows: list[dict[str, Any]], bins: Optional[int], finite: bool = False,
                ratios: bool = True) -> dict[str, torch.Tensor]:
    """Statistics of captured steps sharing one layout: ``raw`` [S, n, len(RAW)] and, for the rows
    with ``want_hist``, ``hist`` [H, n, bins] (estimates of whole-tensor counts) and ``range`` [H, n, 2].

    ``finite``: take every sample as finite (a third of the passes, see :func:`_finite_sums`) and
    add ``dirty`` [S] (1 for a row that holds a NaN or an Inf after all): the caller reduces those
    rows again without ``finite``, their numbers here being wrong. ``ratios=False``: no update ratios
    (NaN), for rows whose ratios are known already (and whose weights' samples are spent)."""
    layout: Layout = rows[0]["layout"]
    x = stacked(rows)  # [S, size]: the blocks of every step
    blocks = [_finite_sums(b.block(x), b.fill if b.padded else None) if finite else _block_sums(b.block(x), b.fill)
              for b in layout.buckets]
    cols = torch.cat(blocks, 1).index_select(1, layout.unorder).double()  # [S, n, 8] in present order
    abs_sum, nonzero, n_pos, n_neg, n_nan, total, lo, hi = (*cols.unbind(2)[:6], -cols[:, :, 6], cols[:, :, 7])
    zeros = layout.k - nonzero - n_pos - n_neg - n_nan
    n_finite = layout.k - n_nan - n_pos - n_neg
    lowest = torch.where(n_nan > 0, math.nan, torch.where(n_neg > 0, -math.inf, lo))  # what aminmax gives
    highest = torch.where(n_nan > 0, math.nan, torch.where(n_pos > 0, math.inf, hi))
    raw = torch.stack([torch.stack([r["norm"] for r in rows]).double(), total, lowest, highest,
                       abs_sum / n_finite.clamp(min=1), zeros / layout.k, n_nan / layout.k,
                       (n_pos + n_neg) / layout.k, torch.stack([r["param_norm"] for r in rows]).double(),
                       _update_ratios(rows, layout) if ratios else _no_ratios(len(rows), layout)], 2)
    if layout.big:  # sum, min and max of sampled parameters were taken exactly at the step
        big = torch.stack([r["big"] for r in rows]).double()  # [S, B, 3]
        raw[:, layout.big_index, COL["sum"]:COL["max"] + 1] = big
    out = {"raw": raw.to(layout.dtype)}  # float32 (half the copy) unless a gradient is float64
    if finite:  # |x| summed: non-finite exactly when some element is (or the sum overflows: redone too)
        out["dirty"] = (~torch.isfinite(abs_sum)).any(1).float()
    wanted = [i for i, r in enumerate(rows) if r.get("want_hist")]
    if bins and wanted:
        out["hist"], out["range"] = _histograms(x, wanted, layout, lo, hi, n_finite, bins)
    return out


def _block_sums(x: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """Per row of a block ``[S, g, width]`` (zero padded): sum of finite |x|, finite non-zeros, +Inf,
    -Inf, NaN, sum of x, -min and max of the finite elements, as ``[S, g, 8]``. Arithmetic and
    float32 sums, not comparisons and float64 casts: on a CPU these vectorise and those do not;
    float32 counts are exact below 2**24 elements, float32 sums are pairwise. Three temporaries of
    the block's size, each pass writing into one of them: a fresh allocation per pass costs a CPU
    more than the pass (its pages are faulted in anew)."""
    wide, keep = _sum_dtypes(x)
    finite = x.nan_to_num(0.0, 0.0, 0.0)  # NaN and ±Inf -> 0; the padding is 0 and counts nowhere
    odd = torch.sub(x, finite)  # 0 where finite, else the NaN or the infinity itself
    tmp = torch.empty_like(x)

    def total(t: torch.Tensor) -> torch.Tensor:
        return t.sum(-1, dtype=wide).to(keep)

    sums = [total(torch.abs(finite, out=tmp)), total(torch.sign(finite, out=tmp).abs_()),
            total(torch.nan_to_num(odd, 0.0, 1.0, 0.0, out=tmp)), total(torch.nan_to_num(odd, 0.0, 0.0, 1.0, out=tmp)),
            total(torch.nan_to_num(odd, 1.0, 0.0, 0.0, out=tmp)), total(x)]
    # The finite range: the largest of -x and of x, non-finite values and the padding at -inf.
    ends = [torch.nan_to_num(t, -math.inf, -math.inf, -math.inf, out=out).add_(fill).amax(-1)
            for t, out in ((torch.neg(x, out=tmp), tmp), (x, odd))]  # odd's last use was above
    return torch.stack(sums + ends, 2)


def _finite_sums(x: torch.Tensor, fill: Optional[torch.Tensor]) -> torch.Tensor:
    """:func:`_block_sums` of a block known to be finite (no NaN or Inf counts to take, no value to
    set aside before the range): seven passes over it instead of about twenty, five without padding
    (``fill`` None: every row fills its block, so its range is the rows' own ``amin`` and ``amax``,
    two reading passes where the fill took two writing ones more; measured 5x faster on a CPU, where a
    reduction along rows is also several times faster than ``aminmax`` along them)."""
    wide, keep = _sum_dtypes(x)
    tmp = torch.empty_like(x)
    sums = [torch.abs(x, out=tmp).sum(-1, dtype=wide).to(keep), tmp.sign_().sum(-1, dtype=wide).to(keep)]
    zero = torch.zeros_like(sums[0])
    if fill is None:
        # -min, max; adding 0 makes a zero +0.0, as the fill's sums give it
        ends = [x.amin(-1).neg_().add_(0.0), x.amax(-1).add_(0.0)]
    else:
        ends = [torch.sub(fill, x, out=tmp).amax(-1), torch.add(x, fill, out=tmp).amax(-1)]
    return torch.stack(sums + [zero, zero, zero, x.sum(-1, dtype=wide).to(keep)] + ends, 2)


def _sum_dtypes(x: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """What a block's sums accumulate in (float64 for a float64 block, or rows of 2**24 elements and
    more, whose float32 counts would stop being exact) and are kept in (the block's dtype)."""
    wide = torch.float64 if x.dtype == torch.float64 or x.shape[-1] >= 1 << 24 else torch.float32
    return wide, x.dtype


def _no_ratios(steps: int, layout: Layout) -> torch.Tensor:
    """NaN update ratios ``[steps, n]``: no step taken, or ratios not asked for."""
    return torch.full((1, layout.n), math.nan, dtype=torch.float64, device=layout.device).expand(steps, layout.n)


def _update_ratios(rows: list[dict[str, Any]], layout: Layout) -> torch.Tensor:
    """‖Δw‖/‖w‖ per parameter from the samples of w before and after the step (NaN without a step),
    their squares summed at the step (:func:`update_squares`)."""
    stepped = [r["squares"] for r in rows if "squares" in r]
    if not stepped:
        return _no_ratios(len(rows), layout)
    none = _no_ratios(1, layout)[0]
    size, moved = torch.stack(stepped, 1).index_select(2, layout.unorder).double().sqrt_().unbind(0)
    ratios = iter((moved / size).unbind(0))
    # Rows picked in Python, not by a list index: that index would be copied to the device first.
    return torch.stack([next(ratios) if "squares" in r else none for r in rows])


def _histograms(x: torch.Tensor, wanted: list[int], layout: Layout, lo: torch.Tensor,
                hi: torch.Tensor, n_finite: torch.Tensor, bins: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One histogram per parameter and wanted step over its sample's own finite range, one
    count (:func:`_count`) per block; counts are scaled from the sample to the whole tensor."""
    h = len(wanted)
    pick = (lambda t: t) if h == len(x) else (lambda t: torch.stack([t[i] for i in wanted]))  # noqa: E731
    x, lo, hi, valid = pick(x), pick(lo).to(x.dtype), pick(hi).to(x.dtype), pick(n_finite) > 0  # [H, size], [H, n]
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
    # in place: see _block_sums; the padding (if any) at -inf, in the spare bin
    shifted = torch.add(x, bucket.fill).sub_(lo[..., None]) if bucket.padded else torch.sub(x, lo[..., None])
    spread = shifted.div_(width[..., None]).mul_(bins)
    offsets = bucket.bin_offsets(h, bins + 2)
    # No floor: every finite spread is >= 0 (lo is at most the row's least finite value, width >= 0),
    # and the cast truncates it as floor would.
    index = spread.nan_to_num_(bins + 1, bins + 1, bins + 1).to(offsets.dtype).add_(offsets).view(-1)
    counts = _count(index, h * g * (bins + 2)).view(h, g, bins + 2)
    return torch.cat([counts[:, :, :bins - 1], counts[:, :, bins - 1:bins + 1].sum(2, keepdim=True)], 2)


def _count(index: torch.Tensor, size: int) -> torch.Tensor:
    """How many times each of ``size`` slots occurs in ``index`` (every one in range), in float32
    whatever the default dtype (a float16 count stops at 2048), exact below 2**24. A CPU counts with
    ``bincount`` (twice as fast as ``index_add_`` there), of int32 indices where they fit (see
    :meth:`Bucket.bin_offsets`); a GPU with ``index_add_`` (its ``bincount`` reads the largest index
    on the host first)."""
    if index.device.type == "cpu":
        return torch.bincount(index, minlength=size).float()
    ones = torch.ones((), dtype=torch.float32, device=index.device).expand(index.shape)
    return torch.zeros(size, dtype=torch.float32, device=index.device).index_add_(0, index, ones)
