"""Compute :class:`TensorStats` from a live tensor, safely for every kind of tensor."""
from __future__ import annotations

from typing import TypedDict

import torch

from torch_nbdebug.data.stats import TensorStats
from torch_nbdebug.record import compat

class _Described(TypedDict):
    """What every :class:`TensorStats` says, whatever the tensor holds."""
    shape: tuple[int, ...]
    dtype: str
    device: str
    numel: int


_SKIP_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def summarize(t: torch.Tensor) -> TensorStats:
    """Statistics of ``t``; never raises for meta, fake, sparse, empty, complex or integer tensors.

    Runs under ``no_grad`` and on a detached view, so it adds nothing to the user's graph.
    """
    shape = tuple(int(s) for s in t.shape)
    base = _Described(shape=shape, dtype=str(t.dtype).replace("torch.", ""), device=str(t.device), numel=t.numel())
    if t.layout in _SKIP_LAYOUTS:
        return TensorStats(**base, note="sparse")
    if t.device.type == "meta" or _is_fake(t):
        return TensorStats(**base, note="no data (meta/fake)")
    if t.numel() == 0:
        return TensorStats(**base, note="empty")
    with torch.no_grad():
        x = t.detach()
        if x.is_complex():
            x = torch.view_as_real(x)
        if x.dtype == torch.bool:
            return TensorStats(**base, zeros=int((~x).sum()))
        if not x.is_floating_point():
            x64 = x.to(torch.float64)
            return TensorStats(**base, min=float(x64.min()), max=float(x64.max()), mean=float(x64.mean()),
                               std=float(x64.std()) if x.numel() > 1 else 0.0, zeros=int((x == 0).sum()))
        return _float_stats(x, base)


def _float_stats(x: torch.Tensor, base: _Described) -> TensorStats:
    # Work in float32 at least: half types overflow when summed.
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    nan_mask = torch.isnan(xf)
    inf_mask = torch.isinf(xf)
    nan = int(nan_mask.sum())
    inf = int(inf_mask.sum())
    neg_inf = int((inf_mask & (xf < 0)).sum()) if inf else 0
    zeros = int((xf == 0).sum())
    finite = xf[~(nan_mask | inf_mask)] if (nan or inf) else xf.reshape(-1)
    if finite.numel() == 0:
        return TensorStats(**base, nan=nan, inf=inf, neg_inf=neg_inf, zeros=zeros)
    f64 = finite.double()
    return TensorStats(**base, min=float(f64.min()), max=float(f64.max()), mean=float(f64.mean()),
                       std=float(f64.std()) if f64.numel() > 1 else 0.0,
                       nan=nan, inf=inf, neg_inf=neg_inf, zeros=zeros)


def _is_fake(t: torch.Tensor) -> bool:
    return compat.is_fake(t)
