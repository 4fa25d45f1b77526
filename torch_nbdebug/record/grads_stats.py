"""Gradient statistics of many parameters computed together, for :mod:`torch_nbdebug.record.grads`.

Two paths. :func:`exact_rows` covers every element (a snapshot, and the last recorded step): a few
host synchronisations in all. :func:`sampled_rows` is the per-step path: exact norms, sums and
min/max per parameter, everything else from a fixed random sample gathered into one flat tensor, and
no host synchronisation at all — results stay device tensors until the recorder copies many steps
at once. Device-side constants (segment ids, index tensors) are built once per set of parameters,
because creating a tensor from Python values on a GPU waits for the queue to drain.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch
from torch import nn

from torch_nbdebug.data.grads import FIELD, FIELDS, ParamInfo
from torch_nbdebug.record import compat

RAW = ("norm", "sum", "min", "max", "mean_abs", "zeros", "nan", "inf", "param_norm", "update_ratio")


def float_norms(tensors: list[torch.Tensor], ord: float = 2) -> list[torch.Tensor]:
    """Batched float32 norms: a half-precision norm above 65504 would read as a false Inf."""
    if all(t.dtype == torch.float32 for t in tensors):
        return compat.foreach_norm(tensors, ord)
    return compat.foreach_norm(tensors, ord, dtype=torch.float32)


def usable(grad: Optional[torch.Tensor]) -> bool:
    """Dense real floating gradients are analysed; sparse, complex and integer ones are skipped."""
    return grad is not None and grad.layout == torch.strided and grad.is_floating_point() and grad.numel() > 0


def exact_rows(params: list[nn.Parameter], bins: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every statistic over every element (a snapshot): stats [P, F], hist [P, B], range [P, 2].

    Two host synchronisations in all (not one per parameter): the per-parameter reductions are
    stacked first; the histogram ranges are then read once to call ``histc``.
    """
    n_p = len(params)
    stats = np.full((n_p, len(FIELDS)), np.nan)
    hist, rng = np.zeros((n_p, bins)), np.full((n_p, 2), np.nan)
    with torch.no_grad():
        stats[:, FIELD["param_norm"]] = _stack(float_norms([p.detach() for p in params])) if params else []
        stats[:, FIELD["has_grad"]] = [usable(p.grad) for p in params]
        present = [i for i, p in enumerate(params) if usable(p.grad)]
        if not present:
            return stats, hist, rng
        grads = [params[i].grad.detach() for i in present]
        cols = _exact_columns(grads)
        for key, values in cols.items():
            stats[present, FIELD[key]] = values
        counts, lo_hi = _exact_hists(grads, cols["min"], cols["max"], bins)
        hist[present], rng[present] = counts, lo_hi
    return stats, hist, rng


def _exact_columns(grads: list[torch.Tensor]) -> dict[str, np.ndarray]:
    """Per-parameter reductions; a finite norm proves every element finite, so only gradients with
    a NaN/Inf (or an overflowing norm) pay for the masked copies."""
    norms = _stack(float_norms(grads))
    cols = {k: np.full(len(grads), np.nan) for k in ("mean", "std", "min", "max", "max_abs", "mean_abs")}
    cols["norm"] = norms
    cols["zeros"] = np.array([g.numel() for g in grads], float) - _stack([torch.count_nonzero(g) for g in grads])
    cols["dead_units"] = _stack([(g.reshape(g.shape[0], -1) != 0).any(1).logical_not().sum() if g.dim() >= 2
                                 else g.new_tensor(math.nan) for g in grads])
    finite = np.isfinite(norms)
    cols["nan"] = np.zeros(len(grads))
    cols["inf"] = np.zeros(len(grads))
    clean = [i for i in range(len(grads)) if finite[i]]
    dirty = [i for i in range(len(grads)) if not finite[i]]
    if clean:
        _finite_columns(cols, clean, [grads[i] for i in clean], norms[clean])
    if dirty:
        cols["nan"][dirty] = _stack([torch.isnan(grads[i]).sum() for i in dirty])
        cols["inf"][dirty] = _stack([torch.isinf(grads[i]).sum() for i in dirty])
        masked = [torch.where(torch.isfinite(grads[i]), grads[i].float(), math.nan) for i in dirty]
        fsq = _stack([torch.nansum(m.double() ** 2) for m in masked])
        _finite_columns(cols, dirty, masked, np.sqrt(fsq), nan_aware=True)
    return cols


def _finite_columns(cols: dict[str, np.ndarray], rows: list[int], grads: list[torch.Tensor], norms: np.ndarray,
                    nan_aware: bool = False) -> None:
    """mean/std/min/max/mean |g| over the finite elements (NaN marks the others when ``nan_aware``)."""
    n = _stack([(~torch.isnan(g)).sum() for g in grads]) if nan_aware else np.array([g.numel() for g in grads], float)
    # float32 sums are pairwise (accurate enough for a mean) and much faster than float64 ones on CPU.
    total = _stack([torch.nansum(g.float()) if nan_aware else g.sum(dtype=torch.float32) for g in grads])
    l1 = _stack([torch.nansum(g.abs(), dtype=torch.float64) for g in grads]) if nan_aware else \
        _stack(float_norms(grads, 1))
    if nan_aware:
        lo = _stack([torch.where(torch.isnan(g), math.inf, g).amin() for g in grads])
        hi = _stack([torch.where(torch.isnan(g), -math.inf, g).amax() for g in grads])
    else:
        mm = [torch.aminmax(g) for g in grads]
        lo, hi = _stack([m.min for m in mm]), _stack([m.max for m in mm])
    mean = total / np.maximum(n, 1)
    var = np.maximum(norms ** 2 - n * mean ** 2, 0) / np.maximum(n - 1, 1)
    # Nearly constant gradients cancel in norm² - n·mean²: recompute those few in float64.
    redo = [i for i in range(len(grads)) if n[i] > 1 and var[i] <= 1e-4 * mean[i] ** 2]
    for i in redo:
        g = grads[i].double()
        var[i] = float(torch.var(g[~torch.isnan(g)] if nan_aware else g))
    some = n > 0
    for key, values in (("mean", mean), ("std", np.sqrt(var)), ("min", lo), ("max", hi),
                        ("max_abs", np.maximum(-lo, hi)), ("mean_abs", l1 / np.maximum(n, 1))):
        cols[key][rows] = np.where(some, values, np.nan)


def _exact_hists(grads: list[torch.Tensor], lo: np.ndarray, hi: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    counts = np.zeros((len(grads), bins))
    rng = np.full((len(grads), 2), np.nan)
    for i, g in enumerate(grads):
        if np.isnan(lo[i]):
            continue
        a, b = _widen(float(lo[i]), float(hi[i]))
        rng[i] = (a, b)
        # histc skips NaN and values outside [a, b] (the infinities), and puts b in the last bin.
        counts[i] = torch.histc(g.detach().float().reshape(-1), bins, a, b).double().cpu().numpy()
    return counts, rng


def _widen(lo: float, hi: float) -> tuple[float, float]:
    """A constant gradient (all zeros, say) still needs a bin range: centre it on the value."""
    if hi > lo:
        return lo, hi
    d = max(abs(lo) * 1e-3, 1e-12)
    return lo - d, hi + d


def _stack(values: list[torch.Tensor]) -> np.ndarray:
    if not values:
        return np.zeros(0)
    return torch.stack([v.detach().to(torch.float64).reshape(()) for v in values]).cpu().numpy()


class Sampler:
    """Fixed random element indices per parameter, drawn once from a private generator.

    The user's RNG state is never touched; parameters with at most ``k`` elements are taken whole.
    """

    def __init__(self, params: list[nn.Parameter], k: int) -> None:
        gen = torch.Generator().manual_seed(0x5EED)
        self.index: list[torch.Tensor] = []
        self.count = np.zeros(len(params))
        for i, p in enumerate(params):
            n = p.numel()
            idx = torch.arange(n) if n <= k else torch.randint(0, n, (k,), generator=gen).sort().values
            self.index.append(idx.to(p.device))
            self.count[i] = idx.numel()
        self.numel = np.array([p.numel() for p in params], dtype=np.float64)
        self.exact = self.count >= self.numel
        self._consts: dict[tuple[tuple[int, ...], str], dict[str, torch.Tensor]] = {}

    def consts(self, present: tuple[int, ...], device: torch.device) -> dict[str, torch.Tensor]:
        """Device constants for this set of parameters with a gradient, built once.

        ``seg``: which parameter (position in ``present``) each gathered element belongs to;
        ``index``: ``present`` itself; ``k``/``numel``: sample and tensor sizes.
        """
        key = (present, str(device))
        if key not in self._consts:
            rows = list(present)
            lengths = torch.tensor([int(self.count[i]) for i in rows])
            self._consts[key] = {
                "seg": torch.repeat_interleave(torch.arange(len(rows)), lengths).to(device),
                "index": torch.tensor(rows).to(device),
                "k": torch.from_numpy(self.count[rows]).float().to(device),
                "numel": torch.tensor([float(self.numel[i]) for i in rows]).to(device),
            }
        return self._consts[key]

    def seg(self, present: tuple[int, ...], device: torch.device) -> torch.Tensor:
        return self.consts(present, device)["seg"]

    def gather(self, tensors: list[torch.Tensor], present: tuple[int, ...], device: torch.device) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).index_select(0, self.index[i]).to(device, torch.float32)
                          for t, i in zip(tensors, present)])


def sampled_rows(params: list[nn.Parameter], present: tuple[int, ...], sampler: "Sampler", bins: Optional[int],
                 before: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
    """Device tensors for one step, no host synchronisation: raw [len(present), len(RAW)] etc."""
    grads = [params[i].grad for i in present]
    dev = grads[0].device
    consts = sampler.consts(present, dev)
    seg, k = consts["seg"], consts["k"]
    n = len(present)
    x = sampler.gather(grads, present, dev)
    finite = torch.isfinite(x)
    xf = torch.where(finite, x, 0)
    per = lambda v: torch.zeros(n, device=dev).index_add_(0, seg, v.float())  # noqa: E731 - segment sum
    n_finite = per(finite)
    minmax = [torch.aminmax(g.detach()) for g in grads]
    raw = [
        torch.stack(float_norms([g.detach() for g in grads])).to(dev),
        torch.stack([g.detach().sum(dtype=torch.float32) for g in grads]).to(dev),
        torch.stack([m.min.float() for m in minmax]).to(dev), torch.stack([m.max.float() for m in minmax]).to(dev),
        per(xf.abs()) / n_finite.clamp(min=1), per(x == 0) / k, per(torch.isnan(x)) / k, per(torch.isinf(x)) / k,
        torch.stack(float_norms([params[i].detach() for i in present])).to(dev),
        torch.full((n,), math.nan, device=dev),
    ]
    out = {"raw": torch.stack(raw, 1)}
    if bins:
        counts, out["range"] = _sample_hist(x, finite, seg, n, bins)
        out["hist"] = counts * (consts["numel"] / k)[:, None]  # estimates of whole-tensor counts
    return out


def _sample_hist(x: torch.Tensor, finite: torch.Tensor, seg: torch.Tensor, n: int, bins: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """One histogram per parameter over its sample's own finite range, all in one ``index_add_``."""
    dev = x.device
    lo = torch.full((n,), math.inf, device=dev).scatter_reduce(0, seg, torch.where(finite, x, math.inf), "amin")
    hi = torch.full((n,), -math.inf, device=dev).scatter_reduce(0, seg, torch.where(finite, x, -math.inf), "amax")
    valid = hi >= lo
    pad = torch.where(hi > lo, 0.0, torch.clamp(lo.abs() * 1e-3, min=1e-12))
    lo, hi = torch.where(valid, lo - pad, math.nan), torch.where(valid, hi + pad, math.nan)
    pos = (x - lo[seg]) / (hi - lo)[seg] * bins
    b = torch.where(finite, pos, 0).nan_to_num(0).floor().clamp(0, bins - 1).long()
    counts = torch.zeros(n * bins, device=dev).index_add_(0, seg * bins + b, finite.float())
    return counts.view(n, bins), torch.stack([lo, hi], 1)


def raw_to_stats(raw: np.ndarray, infos: tuple[ParamInfo, ...], present: list[int], n_params: int) -> np.ndarray:
    """Host side of :func:`sampled_rows`: fractions to counts, norm and sum to mean and std."""
    stats = np.full((n_params, len(FIELDS)), np.nan)
    stats[:, FIELD["has_grad"]] = 0
    if not present:
        return stats
    r = {name: raw[:, i].astype(np.float64) for i, name in enumerate(RAW)}
    numel = np.array([infos[i].numel for i in present], dtype=np.float64)
    mean = r["sum"] / numel
    var = np.maximum(r["norm"] ** 2 - numel * mean ** 2, 0) / np.maximum(numel - 1, 1)
    cols = {"has_grad": 1.0, "norm": r["norm"], "mean": mean, "std": np.sqrt(var), "min": r["min"], "max": r["max"],
            "max_abs": np.maximum(-r["min"], r["max"]), "mean_abs": r["mean_abs"], "zeros": np.round(r["zeros"] * numel),
            "param_norm": r["param_norm"], "update_ratio": r["update_ratio"],
            # A NaN norm or sum proves a NaN exists even when the sample missed it.
            "nan": np.maximum(np.round(r["nan"] * numel), np.isnan(r["norm"]) | np.isnan(r["sum"])),
            "inf": np.maximum(np.round(r["inf"] * numel), np.isinf(r["min"]) | np.isinf(r["max"]))}
    for key, values in cols.items():
        stats[present, FIELD[key]] = values
    return stats


def activation_row(module: nn.Module, inputs: Any, output: Any) -> Optional[torch.Tensor]:
    """Output mean/std/zero fraction and input zero fraction/dead features, as one device tensor."""
    out = _first_tensor(output)
    inp = _first_tensor(inputs)
    if out is None or not out.is_floating_point() or out.numel() == 0:
        return None
    with torch.no_grad():
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
