"""Gradient statistics of many parameters computed together, for :mod:`torch_nbdebug.record.grads`.

:func:`exact_rows` covers every element (a snapshot), :func:`sampled_exact_job` the sampled gradients of
the last recorded step (the rest of that step is exact in its sample). Each runs as a job
(:func:`exact_job`): a generator that hands over the device tensors it needs on the host and gets
them back copied, so a caller can join those copies with its own (the recorder copies its last
steps and this in one transfer). Two host synchronisations in all for finite gradients (the
per-parameter reductions, then the histograms that need their ranges), one more when some gradient
holds a NaN or an Inf, and one more when a finite gradient's float32 sums overflow (gradients of 1e20:
those few are summed again in float64, see :func:`fix_overflow`). The per-step path is
:mod:`torch_nbdebug.record.grads.steps`.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Generator, Optional, ParamSpec, Sequence, TypeVar

import numpy as np
import torch
from torch import nn

from torch_nbdebug.data.grads import FIELD, FIELDS
from torch_nbdebug.record.grads.cpu import binned, unit_sums
from torch_nbdebug.record.grads.steps import COL, RAW, float_norms, present_grads, reduce_rows, stacked
from torch_nbdebug.record.interrupts import no_grad_held

_FLOAT32_MAX = float(np.finfo(np.float32).max)
_LARGE = 1 << 20  # elements from which a gradient's non-zeros are counted by count_nonzero

# A job yields the device tensors it wants on the host and is sent their host copies back.
ExactJob = Generator[list[torch.Tensor], list[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]
_Result = TypeVar("_Result")


def usable(grad: Optional[torch.Tensor]) -> bool:
    """Dense real floating gradients are analysed; sparse, complex and integer ones are skipped."""
    return grad is not None and grad.layout == torch.strided and grad.is_floating_point() and grad.numel() > 0


def to_host(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """Copy device tensors to the host as float64 arrays: one transfer per device, not one per tensor."""
    out: list[Optional[np.ndarray]] = [None] * len(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for ids in by_device.values():
        flat = torch.cat([tensors[i].detach().reshape(-1).double() for i in ids]).cpu().numpy()
        start = 0
        for i in ids:
            size = tensors[i].numel()
            out[i] = flat[start:start + size].reshape(tuple(tensors[i].shape))
            start += size
    return out  # type: ignore[return-value]


def redo_dirty(groups: list[list[dict[str, Any]]], arrays: list[dict[str, np.ndarray]], bins: int) -> None:
    """Reduce again in full the captured rows a finite reduction (``reduce_rows(..., finite=True)``)
    found a NaN or an Inf in, and put their numbers in ``arrays``, the host copies of those reductions,
    one per group of rows: one more host copy, only when there is such a row."""
    redo = Redo(groups, arrays, bins)
    if redo.tensors:
        redo.put(to_host(redo.tensors))


class Redo:
    """The full reductions of the rows that finite reductions of ``groups`` found a NaN or an Inf in
    (their ``dirty`` flags, popped from ``arrays``, the host copies of those reductions; none after full
    reductions): queued on the device as ``tensors``, for the caller to copy with its own, then
    :meth:`put` in ``arrays``."""

    def __init__(self, groups: list[list[dict[str, Any]]], arrays: list[dict[str, np.ndarray]], bins: int) -> None:
        redo = [(g, [int(i) for i in np.flatnonzero(a.pop("dirty", ()))]) for g, a in zip(groups, arrays)]
        self.todo = [(g, a, rows) for (g, rows), a in zip(redo, arrays) if rows]
        with no_grad_held():  # their update ratios stand (they do not depend on the gradient)
            self.fixed = [reduce_rows([g[i] for i in rows], bins, ratios=False) for g, _, rows in self.todo]
        self.tensors = [t for out in self.fixed for t in out.values()]

    def put(self, copies: list[np.ndarray]) -> None:
        """Write the host ``copies`` of :attr:`tensors` over the dirty rows' numbers."""
        host = iter(copies)
        for (g, a, rows), out in zip(self.todo, self.fixed):
            new = {key: next(host) for key in out}
            new["raw"][:, :, COL["update_ratio"]] = a["raw"][rows, :, COL["update_ratio"]]
            a["raw"][rows] = new["raw"]
            if "hist" in new:  # histogram rows are numbered among the rows that want one
                hist_rows = [i for i, r in enumerate(g) if r.get("want_hist")]
                for j, i in enumerate(i for i in rows if g[i].get("want_hist")):
                    a["hist"][hist_rows.index(i)], a["range"][hist_rows.index(i)] = new["hist"][j], new["range"][j]


_SUMS = [COL["norm"], COL["sum"], COL["mean_abs"]]  # the raw columns a float32 sum may overflow


def fix_overflow(groups: list[list[dict[str, Any]]], arrays: list[dict[str, np.ndarray]]) -> set[int]:
    """Take again in float64 the norm, sum and mean |g| that came back Inf or NaN from float32 sums
    though every element was finite (finite min and max, no NaN or Inf counted): finite gradients
    of 1e20 square to 1e40, past float32's 3.4e38, though their norm (1e21, say) is a float32. From
    the kept samples, in the reductions' host copies ``arrays`` (one per group of rows, after
    :class:`Redo`): one more host copy, only when there is such a number. A parameter taken whole
    gets its exact numbers; a sampled one an estimate from its sample (its gradient is gone), its
    norm kept within what its largest |g| allows. Returns the steps holding such an estimate."""
    found: list[tuple[list[dict[str, Any]], np.ndarray, int, int]] = []
    for group, a in zip(groups, arrays):
        raw = a["raw"]
        odd = ~np.isfinite(raw[:, :, _SUMS]).all(2)
        if not odd.any():  # the common case: one test
            continue
        finite = (np.isfinite(raw[:, :, COL["min"]]) & np.isfinite(raw[:, :, COL["max"]]) &
                  (raw[:, :, COL["nan"]] == 0) & (raw[:, :, COL["inf"]] == 0))
        found += [(group, raw, int(s), int(j)) for s, j in np.argwhere(finite & odd)]
    if not found:
        return set()
    with no_grad_held():
        rows = {id(group): stacked(group) for group, _, _, _ in found}
        sums = wide_sums([group[0]["layout"].sample_of(rows[id(group)][s], j) for group, _, s, j in found])
    estimated: set[int] = set()
    for (group, raw, s, j), (squares, total, l1, _) in zip(found, sums):
        layout, row = group[0]["layout"], raw[s, j]
        k, numel = layout.lengths[j], layout.sizes[j]
        row[COL["mean_abs"]] = l1 / k  # over the sample: what this column always is
        wrong = [c for c in (COL["norm"], COL["sum"]) if not np.isfinite(row[c])]
        top = max(-row[COL["min"]], row[COL["max"]])
        fixed = {COL["norm"]: scaled_norm(squares, k, numel, top), COL["sum"]: total * numel / k}
        for c in wrong:
            row[c] = fixed[c]
        if wrong and k < numel:
            estimated.add(int(group[s]["step"]))
    return estimated


def wide_sums(samples: list[torch.Tensor]) -> np.ndarray:
    """Sum of squares, sum, sum of |x| and largest |x| of each of ``samples`` (kept gradient samples, float32),
    taken in float64 on the host copy: ``[len(samples), 4]``. One host copy; called only where a float32 sum
    overflowed (see :func:`fix_overflow`)."""
    wide = [x.double() for x in samples]
    (sums,) = to_host([torch.stack([torch.stack([x.square().sum(), x.sum(), x.abs().sum(), x.abs().max()])
                                    for x in wide])])
    return sums


def scaled_norm(squares: float, k: float, numel: float, top: float) -> float:
    """The L2 norm of a tensor of ``numel`` elements from the float64 sum of ``squares`` of ``k`` of them
    (exact when ``k == numel``: taken whole), kept within what its largest |x| ``top`` allows."""
    return float(np.clip(np.sqrt(squares * numel / k), top, top * math.sqrt(numel)))


def run_job(job: Generator[list[torch.Tensor], list[np.ndarray], _Result], first: Optional[list[np.ndarray]] = None,
            ride: Sequence[torch.Tensor] = ()) -> tuple[_Result, list[np.ndarray]]:
    """Drive a job: each of its requests is one host copy. ``first``: the host copy of its first
    request, when the caller took that request (``next(job)``) and copied it with its own tensors.
    ``ride``: the caller's tensors, copied with the job's next request (alone when it makes none).
    Returns the job's result and the host copies of ``ride``."""
    ride, riding = list(ride), []
    try:
        wanted = next(job) if first is None else job.send(first)
        while True:
            host = to_host(list(wanted) + ride)
            if ride:
                host, riding, ride = host[:len(wanted)], host[len(wanted):], []
            wanted = job.send(host)
    except StopIteration as stop:
        return stop.value, riding or (to_host(ride) if ride else [])


_P = ParamSpec("_P")
_Y = TypeVar("_Y")
_S = TypeVar("_S")
_R = TypeVar("_R")


def _without_grad(make: Callable[_P, Generator[_Y, _S, _R]]) -> Callable[_P, Generator[_Y, _S, _R]]:
    """A job made by ``make`` runs under ``no_grad`` one resumed part at a time, never across a
    ``yield``: a job left suspended (its caller failed between two copies, and the traceback a
    notebook keeps keeps the job alive) would otherwise leave gradients off in the user's next cells."""
    @functools.wraps(make)
    def job(*args: _P.args, **kwargs: _P.kwargs) -> Generator[_Y, _S, _R]:
        inner = make(*args, **kwargs)
        try:
            sent: Any = None
            while True:
                try:
                    with no_grad_held():
                        wanted = inner.send(sent)
                except StopIteration as stop:
                    return stop.value
                sent = yield wanted
        finally:
            inner.close()  # a job abandoned between copies drops the gradients it holds
    return job


def exact_rows(params: list[nn.Parameter], bins: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every statistic over every element (a snapshot): stats [P, F], hist [P, B], range [P, 2]."""
    return run_job(exact_job(params, bins))[0]


@_without_grad
def exact_job(params: list[nn.Parameter], bins: int) -> ExactJob:
    """:func:`exact_rows` as a job (see the module docstring)."""
    n_p = len(params)
    stats = np.full((n_p, len(FIELDS)), np.nan)
    hist, rng = np.zeros((n_p, bins)), np.full((n_p, 2), np.nan)
    stats[:, FIELD["has_grad"]] = [usable(p.grad) for p in params]
    present = [i for i, p in enumerate(params) if usable(p.grad)]
    norms = bool(params)
    wanted = [torch.stack(float_norms([p.detach() for p in params]))] if norms else []
    grads = [g.detach() for g in present_grads(params, present)]
    if grads:
        wanted += _first_columns(grads)
    host = yield wanted
    if norms:
        stats[:, FIELD["param_norm"]] = yield from _wide_norms([p.detach() for p in params], host.pop(0))
    if not present:
        return stats, hist, rng
    host[2] = _dead_units(grads, host[2])
    cols, counts, lo_hi = yield from _exact_columns(grads, bins, *host)
    for key, values in cols.items():
        stats[present, FIELD[key]] = values
    hist[present], rng[present] = counts, lo_hi
    return stats, hist, rng


# The last step made exact: columns, histograms and ranges of the sampled gradients then of the whole ones
# that needed it (their positions), and the dead units of the whole matrices.
LastJob = Generator[list[torch.Tensor], list[np.ndarray],
                    tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, list[int], np.ndarray]]
WHOLE_COLUMNS = ("norm", "nonzero", "sum", "l1", "min", "max")  # what the caller sends of the whole ones
_WHOLE = {name: i for i, name in enumerate(WHOLE_COLUMNS)}


@_without_grad
def sampled_exact_job(grads: list[torch.Tensor], known: torch.Tensor, whole: list[torch.Tensor],
                      bins: int) -> LastJob:
    """:func:`exact_job` for the last recorded step, most of whose statistics its sample has exactly.

    ``grads``: the gradients sampled at that step; ``known`` [len(grads), 4]: their norm, sum, min
    and max, measured exactly at the step (not measured again: four passes over the largest tensors
    saved). ``whole``: the gradients taken whole, exact in the sample but for their dead units; the
    caller appends their :data:`WHOLE_COLUMNS` ``[len(whole), 6]``, from the sample, to the first copy
    it sends back. Those with a NaN or an Inf (mean, std and range over their finite values) or nearly
    constant (the float64 variance) are measured again as :func:`exact_job` would: rare, so they cost
    nothing otherwise. Same copies as :func:`exact_job`: one, one for the histograms, one more with a
    NaN or an Inf."""
    matrices = [g for g in whole if g.dim() >= 2]
    wanted = [known, _unit_columns(matrices)[1] if matrices else known.new_zeros(0)]
    if grads:
        units, live = _unit_columns(grads)
        wanted += [_nonzeros(grads), live, torch.stack(float_norms(units, 1))]
    host = yield wanted
    own = host.pop()  # the whole gradients' columns, from the sample
    dead_whole = np.array([g.shape[0] for g in matrices], dtype=np.float64) - host[1]
    fixed = [int(j) for j in np.flatnonzero(_inexact_moments(own, np.array([g.numel() for g in whole], float)))]
    cols_of = [host[0][:, k] for k in range(4)]  # norm, sum, min, max
    nonzero, dead, l1 = (host[2], _dead_units(grads, host[3]), host[4]) if grads else (np.zeros(0),) * 3
    fix = {name: own[fixed, i] for name, i in _WHOLE.items()}
    columns = [np.concatenate(pair) for pair in (
        (cols_of[0], fix["norm"]), (nonzero, fix["nonzero"]), (dead, np.full(len(fixed), np.nan)),
        (cols_of[1], fix["sum"]), (l1, fix["l1"]), (cols_of[2], fix["min"]), (cols_of[3], fix["max"]))]
    redo = grads + [whole[j] for j in fixed]
    if not redo:
        return {}, np.zeros((0, bins)), np.zeros((0, 2)), fixed, dead_whole
    cols, counts, rng = yield from _exact_columns(redo, bins, *columns)
    return cols, counts, rng, fixed, dead_whole


def _inexact_moments(columns: np.ndarray, numel: np.ndarray) -> np.ndarray:
    """Whether the sample's mean and std of each whole gradient (its :data:`WHOLE_COLUMNS`, a row of
    ``columns``) differ from the exact path's: it holds a NaN or an Inf (the exact path takes them over
    the finite values), or it is nearly constant (the exact path takes the variance in float64: see
    :func:`_exact_columns`)."""
    norm, total = columns[:, _WHOLE["norm"]], columns[:, _WHOLE["sum"]]
    finite = np.isfinite(norm) & np.isfinite(total)
    with np.errstate(invalid="ignore", over="ignore"):
        return ~finite | _nearly_constant(numel, *_moments(norm, total, numel))


def _unit_columns(grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """|g| summed per unit (dim 0) of each gradient with units (a vector: its own |g|), and the number
    of live units of those with units. A unit is dead when its sum is 0 (NaN and Inf units are not)."""
    units = [unit_sums(g) if g.dim() >= 2 else g for g in grads]
    matrices = [u for u, g in zip(units, grads) if g.dim() >= 2]
    # one batched "0-norm" counts the live units (see _dead_units)
    live = torch.stack(float_norms(matrices, 0)) if matrices else grads[0].new_zeros(0, dtype=torch.float32)
    return units, live


def _first_columns(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-parameter reductions that need no decision on the host: norm, non-zeros, live units (of
    the gradients with units), and sum, L1 norm and min/max as they are for a finite gradient."""
    minmax = [torch.aminmax(g) for g in grads]
    # |g| summed per unit (dim 0), in float32: a unit is dead when its sum is 0, and the sums add up
    # to the L1 norm. One vectorised pass, where a != 0 mask and any() took two and a temporary.
    units, live = _unit_columns(grads)  # a vector's own |g| add up to its L1 norm
    same = len({g.dtype for g in grads}) == 1  # one stack, one cast: not one cast per parameter
    # float64: a float64 gradient's range may lie beyond float32's
    ends = [torch.stack([m.min for m in minmax]).double(), torch.stack([m.max for m in minmax]).double()] if same else \
        [torch.stack([m.min.double() for m in minmax]), torch.stack([m.max.double() for m in minmax])]
    return [torch.stack(float_norms(grads)), _nonzeros(grads),
            live,  # units that are not dead, of the gradients with units
            # float32 sums are pairwise (accurate enough for a mean) and much faster than float64 ones on CPU.
            torch.stack([g.sum(dtype=torch.float32) for g in grads]),
            torch.stack(float_norms(units, 1)), *ends]


def _dead_units(grads: list[torch.Tensor], live: np.ndarray) -> np.ndarray:
    """Units whose gradient is all zero, from the live units of the gradients with units (NaN for the others)."""
    dead = np.full(len(grads), np.nan)
    matrices = [j for j, g in enumerate(grads) if g.dim() >= 2]
    dead[matrices] = np.array([grads[j].shape[0] for j in matrices], dtype=np.float64) - live
    return dead


def _nonzeros(grads: list[torch.Tensor]) -> torch.Tensor:
    """Non-zero elements (NaN and Inf included) of each gradient: one batched "0-norm" for the small
    ones, ``count_nonzero`` for the large ones (a compare runs faster than the norm's loop, measured
    20% on a CPU, and a float32 count is exact only below 2**24)."""
    if all(g.numel() < _LARGE for g in grads):
        return torch.stack(float_norms(grads, 0))
    small = [g for g in grads if g.numel() < _LARGE]
    counts = iter(float_norms(small, 0) if small else ())
    return torch.stack([torch.count_nonzero(g).double() if g.numel() >= _LARGE else next(counts).double()
                        for g in grads])


def _exact_columns(grads: list[torch.Tensor], bins: int, norms: np.ndarray, nonzero: np.ndarray, dead: np.ndarray,
                   total: np.ndarray, l1: np.ndarray, lo: np.ndarray, hi: np.ndarray
                   ) -> Generator[list[torch.Tensor], list[np.ndarray], tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]]:
    """Columns and histograms from the first copy. A finite norm proves every element finite, so only
    gradients with a NaN/Inf (or an overflowing norm) pay for the masked reductions; the histograms of
    the others, the masked reductions and the float64 variances come back in one copy, and the
    histograms of the non-finite ones (whose ranges that copy gives) in one more, with those of the
    finite ones found to hold elements outside their range (rare, see :func:`cpu.binned`)."""
    numel = np.array([g.numel() for g in grads], float)
    # min and max are NaN or infinite when some element is: a finite gradient whose float32 sums did not
    # come back finite overflowed them (see fix_overflow); those few are summed again in float64
    sums = np.isfinite(norms) & np.isfinite(total) & np.isfinite(l1)
    over = np.flatnonzero(~sums & np.isfinite(lo) & np.isfinite(hi))
    if len(over):
        norms, total, l1 = norms.copy(), total.copy(), l1.copy()
        (wide,) = yield [torch.stack([torch.stack([torch.linalg.vector_norm(grads[i], dtype=torch.float64),
                                                   grads[i].sum(dtype=torch.float64),
                                                   torch.linalg.vector_norm(grads[i], 1, dtype=torch.float64)])
                                      for i in over])]
        norms[over], total[over], l1[over] = wide.T
    cols = {k: np.full(len(grads), np.nan) for k in ("mean", "std", "min", "max", "max_abs", "mean_abs")}
    cols.update(norm=norms, zeros=numel - nonzero, dead_units=dead, nan=np.zeros(len(grads)), inf=np.zeros(len(grads)))
    finite = np.isfinite(norms)  # every element is finite, and their sums too
    clean, dirty = np.flatnonzero(finite), np.flatnonzero(~finite)
    mean, var = _moments(norms[clean], total[clean], numel[clean])
    redo = [int(j) for j in np.flatnonzero(_nearly_constant(numel[clean], mean, var))]
    wanted = [torch.stack([torch.var(grads[clean[j]].double()) for j in redo])] if redo else []
    if len(dirty):
        wanted += _masked_columns([grads[i] for i in dirty])
    counts, rng = np.zeros((len(grads), bins)), np.full((len(grads), 2), np.nan)
    rows, hists = _histograms(grads, clean, lo, hi, bins, rng, within=True)
    host = (yield wanted + hists) if wanted or hists else []
    if hists:
        counts[rows] = host.pop()
    if redo:
        var[redo] = host.pop(0)
    _set(cols, clean, mean, var, lo[clean], hi[clean], l1[clean] / np.maximum(numel[clean], 1), numel[clean])
    if len(dirty):
        n_nan, n_inf, n, d_total, d_l1, d_lo, d_hi, d_var, d_nonzero = host
        cols["nan"][dirty], cols["inf"][dirty], cols["zeros"][dirty] = n_nan, n_inf, numel[dirty] - d_nonzero
        _set(cols, dirty, d_total / np.maximum(n, 1), d_var, d_lo, d_hi, d_l1 / np.maximum(n, 1), n)
    outside = [i for i in rows if np.isnan(counts[i, 0])]  # rows cpu.binned left NaN: histc's
    rows, hists = _histograms(grads, outside + list(dirty), cols["min"], cols["max"], bins, rng)
    if hists:
        (counts[rows],) = yield hists
    return cols, counts, rng


def _wide_norms(tensors: list[torch.Tensor], norms: np.ndarray
                ) -> Generator[list[torch.Tensor], list[np.ndarray], np.ndarray]:
    """``norms`` (float32 norms of ``tensors``) with those that came back Inf or NaN taken again in
    float64: right for a finite tensor whose squares overflowed float32 (one more copy, only then)."""
    odd = np.flatnonzero(~np.isfinite(norms))
    if not len(odd):
        return norms
    (wide,) = yield [torch.stack([torch.linalg.vector_norm(tensors[i], dtype=torch.float64) for i in odd])]
    norms = norms.copy()
    norms[odd] = wide
    return norms


def _moments(norms: np.ndarray, total: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean = total / np.maximum(n, 1)
    return mean, np.maximum(norms ** 2 - n * mean ** 2, 0) / np.maximum(n - 1, 1)


def _nearly_constant(n: np.ndarray, mean: np.ndarray, var: np.ndarray) -> np.ndarray:
    """Gradients of ``n`` elements whose variance from :func:`_moments` is not to be trusted: nearly
    constant ones cancel in norm² - n·mean², so their variance is taken again in float64."""
    return (n > 1) & (var <= 1e-4 * mean ** 2)


def _masked_columns(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """NaN/Inf counts and the statistics of the finite elements (NaN marks the others); the variance
    in float64 and two passes, as the nearly constant case needs; last, the non-zero elements (NaN and
    Inf included: the caller's count, from a sample reduced as finite, may have taken a NaN for a zero)."""
    masked = [torch.where(torch.isfinite(g), _wide(g), math.nan) for g in grads]
    n = [(~torch.isnan(m)).sum() for m in masked]
    means = [torch.nansum(m.double()) / c.clamp(min=1) for m, c in zip(masked, n)]
    return [torch.stack([torch.isnan(g).sum() for g in grads]), torch.stack([torch.isinf(g).sum() for g in grads]),
            torch.stack(n), torch.stack([torch.nansum(m) for m in masked]),
            torch.stack([torch.nansum(m.abs(), dtype=torch.float64) for m in masked]),
            torch.stack([torch.where(torch.isnan(m), math.inf, m).amin() for m in masked]),
            torch.stack([torch.where(torch.isnan(m), -math.inf, m).amax() for m in masked]),
            torch.stack([torch.nansum((m.double() - mu) ** 2) / (c - 1).clamp(min=1)
                         for m, mu, c in zip(masked, means, n)]),
            torch.stack([torch.count_nonzero(g) for g in grads])]


def _set(cols: dict[str, np.ndarray], rows: Any, mean: np.ndarray, var: np.ndarray, lo: np.ndarray, hi: np.ndarray,
         mean_abs: np.ndarray, n: np.ndarray) -> None:
    """mean/std/min/max/mean |g| over the finite elements; NaN where there are none."""
    some = n > 0
    for key, values in (("mean", mean), ("std", np.sqrt(var)), ("min", lo), ("max", hi),
                        ("max_abs", np.maximum(-lo, hi)), ("mean_abs", mean_abs)):
        cols[key][rows] = np.where(some, values, np.nan)


def _histograms(grads: list[torch.Tensor], candidates: Any, lo: np.ndarray, hi: np.ndarray, bins: int,
                rng: np.ndarray, within: bool = False) -> tuple[list[int], list[torch.Tensor]]:
    """The rows among ``candidates`` with a finite element, and their histograms over [lo, hi] (set in
    ``rng``) as one device tensor in a list (empty when there is no such row). ``within``: [lo, hi]
    is the range measured of those (finite) gradients: on a CPU :func:`cpu.binned` counts them, NaN rows
    where an element lies outside after all."""
    rows = [int(i) for i in candidates if not np.isnan(lo[i])]
    for i in rows:
        rng[i] = _widen(float(lo[i]), float(hi[i]))
    if not rows:
        return rows, []
    # cpu.binned counts in float32: not a float64 gradient's range beyond it
    if within and all(grads[i].device.type == "cpu" for i in rows) and np.abs(rng[rows]).max() < _FLOAT32_MAX:
        return rows, [binned([grads[i] for i in rows], bins, rng[rows])]
    # histc skips NaN and values outside [a, b] (the infinities), and puts b in the last bin.
    return rows, [torch.stack([torch.histc(_wide(grads[i]).reshape(-1), bins, *rng[i]).float() for i in rows])]


def _wide(grad: torch.Tensor) -> torch.Tensor:
    """float32 values of a gradient, float64 ones for a float64 gradient (beyond float32's range maybe)."""
    return grad if grad.dtype == torch.float64 else grad.float()


def _widen(lo: float, hi: float) -> tuple[float, float]:
    """A constant gradient (all zeros, say) still needs a bin range: centre it on the value."""
    if hi > lo:
        return lo, hi
    d = max(abs(lo) * 1e-3, 1e-12)
    return lo - d, hi + d


def whole_columns(raw: np.ndarray, numel: np.ndarray) -> np.ndarray:
    """The :data:`WHOLE_COLUMNS` of parameters taken whole, from their sampled ``raw`` rows (RAW order)."""
    finite = numel * (1 - raw[:, COL["nan"]] - raw[:, COL["inf"]])
    columns = {"norm": raw[:, COL["norm"]], "nonzero": numel - np.round(raw[:, COL["zeros"]] * numel),
               "sum": raw[:, COL["sum"]], "l1": raw[:, COL["mean_abs"]] * finite, "min": raw[:, COL["min"]],
               "max": raw[:, COL["max"]]}
    return np.stack([columns[name] for name in WHOLE_COLUMNS], 1)


_STATS_CHUNK = 1 << 16  # (step, parameter) rows turned into stats together: temporaries of about 25 MB


def raw_to_stats(raws: Sequence[np.ndarray], numel: np.ndarray, order: Sequence[int]) -> np.ndarray:
    """Host side of :func:`sampled_rows`: the stats ``[S, len(order), len(FIELDS)]`` of steps' ``raw``
    rows ``[P, len(RAW) + 1]`` (the last column: 1 where the parameter had a gradient), parameters in
    ``order``. Vectorised over a chunk of steps at a time: host memory of the result and one chunk."""
    stats = np.empty((len(raws), len(order), len(FIELDS)))
    step = max(1, _STATS_CHUNK // max(len(numel), 1))
    for start in range(0, len(raws), step):
        stats[start:start + step] = _step_stats(np.stack(raws[start:start + step])[:, order], numel[order])
    return stats


def _step_stats(raw: np.ndarray, numel: np.ndarray) -> np.ndarray:
    """:func:`raw_to_stats` of ``raw`` [S, P, len(RAW) + 1], ``numel`` [P]: fractions to counts, norm
    and sum to mean and std (NaN and has_grad 0 where there was no gradient)."""
    stats = np.full((*raw.shape[:2], len(FIELDS)), np.nan)
    r = {name: raw[:, :, i].astype(np.float64) for i, name in enumerate(RAW)}
    mean = r["sum"] / numel
    with np.errstate(invalid="ignore"):  # inf - inf: an Inf gradient's std is NaN
        var = np.maximum(r["norm"] ** 2 - numel * mean ** 2, 0) / np.maximum(numel - 1, 1)
    cols = {"norm": r["norm"], "mean": mean, "std": np.sqrt(var), "min": r["min"], "max": r["max"],
            "max_abs": np.maximum(-r["min"], r["max"]), "mean_abs": r["mean_abs"], "zeros": np.round(r["zeros"] * numel),
            "param_norm": r["param_norm"], "update_ratio": r["update_ratio"],
            # A NaN norm or sum proves a NaN exists even when the sample missed it.
            "nan": np.maximum(np.round(r["nan"] * numel), np.isnan(r["norm"]) | np.isnan(r["sum"])),
            "inf": np.maximum(np.round(r["inf"] * numel), np.isinf(r["min"]) | np.isinf(r["max"]))}
    has = raw[:, :, -1] == 1
    for key, values in cols.items():
        stats[:, :, FIELD[key]] = np.where(has, values, np.nan)
    stats[:, :, FIELD["has_grad"]] = has
    return stats


def activation_row(module: nn.Module, inputs: Any, output: Any) -> Optional[torch.Tensor]:
    """Output mean/std/zero fraction and input zero fraction/dead features, as one device tensor."""
    out = _first_tensor(output)
    inp = _first_tensor(inputs)
    if out is None or not out.is_floating_point() or out.numel() == 0:
        return None
    with no_grad_held():
        o = out.detach().float()
        std, mean = torch.std_mean(o) if o.numel() > 1 else (o.new_zeros(()), o.mean())
        row = [mean, std, (o == 0).float().mean()]
        if inp is not None and inp.is_floating_point() and inp.dim() >= 1 and inp.numel():
            feat = 1 if isinstance(module, (nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm)) and inp.dim() > 2 else -1
            x = inp.detach().movedim(feat, -1).reshape(-1, inp.shape[feat])
            row += [(x == 0).float().mean(), (x != 0).any(0).logical_not().sum().float(),
                    o.new_full((), float(inp.shape[feat]))]  # a fill, not a host copy
        else:
            row += [o.new_full((), math.nan)] * 3
        return torch.stack(row)


def _first_tensor(value: Any) -> Optional[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            found = _first_tensor(v)
            if found is not None:
                return found
    return None
