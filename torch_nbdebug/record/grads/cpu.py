"""The exact last step's two costly passes over CPU gradients, in cache-sized pieces: |g| summed per
unit (the per-unit L1) and histc's histogram counted by ``bincount``. Both give what the plain torch
call gives (:mod:`record.grads.stats` sends everything else there), about three times faster.
"""
from __future__ import annotations

import math

import numpy as np
import torch

PIECE = 1 << 18  # elements a CPU pass of binned or unit_sums takes at once: its 1 MB temporaries stay in the cache


def binned(grads: list[torch.Tensor], bins: int, ranges: np.ndarray) -> torch.Tensor:
    """``torch.histc(g.float(), bins, lo, hi)`` of CPU gradients over their range ``[lo, hi]`` (a row
    of ``ranges``), as ``[len(grads), bins]``: the same counts three times faster. histc's bin
    ``(x - lo) * bins / (hi - lo)`` in float32, truncated (``bins`` itself, for ``hi``, folded into
    the last bin), by a few vectorised ops and a ``bincount`` per cache-sized piece, where histc runs
    a scalar loop with a division per element. The rows :func:`_histc_rows` names go to histc; a row
    with an element outside its range or a NaN (histc skips those) comes back NaN: a write through
    ``.data`` after the range was measured puts some there, rarely, and the caller then asks histc for
    those rows in its next copy (telling them apart here would take a host read per piece)."""
    edges = ranges.astype(np.float32)  # histc's edges, in float32
    counts = torch.zeros(len(grads), bins + 1, dtype=torch.int64, device="cpu")
    size = min(PIECE, max(g.numel() for g in grads))
    spread = torch.empty(size, dtype=torch.float32, device="cpu")
    buffers = spread, torch.empty(size, dtype=torch.int32, device="cpu")
    yes = torch.ones((), dtype=torch.bool, device="cpu")
    inside = []  # one bool tensor per row, stacked once
    for row, (grad, direct) in enumerate(zip(grads, _histc_rows(edges, bins))):
        flat = grad.detach().reshape(-1).float()
        if direct:
            counts[row, :bins] = torch.histc(flat, bins, *ranges[row]).long()
        inside.append(yes if direct else _bin_pieces(flat, bins, edges[row], counts[row], buffers))
    counts[:, bins - 1] += counts[:, bins]
    return torch.where(torch.stack(inside)[:, None], counts[:, :bins].float(), math.nan)


def _histc_rows(edges: np.ndarray, bins: int) -> np.ndarray:
    """The rows of float32 ``edges`` left to histc: their ``(x - lo) * bins`` may overflow, or their
    width is below the smallest normal float32 (under ``torch.set_flush_denormal(True)`` an ``x - lo``
    that small reads 0, and 0 / 0 gives no bin)."""
    with np.errstate(over="ignore"):
        widths = edges[:, 1] - edges[:, 0]  # their difference, in float32 too
        return ~np.isfinite(widths * np.float32(bins)) | (widths < np.finfo(np.float32).tiny)


def _bin_pieces(flat: torch.Tensor, bins: int, edges: np.ndarray, counts: torch.Tensor,
                buffers: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Add the bins of ``flat``'s elements over ``edges`` to ``counts`` (``bins + 1`` slots, the last
    for the top), one piece at a time, through ``buffers`` (float32 and int32, a piece long). Returns
    whether every element lay within ``edges`` (a bool tensor: no host read); where one did not, or
    was NaN, ``counts`` is wrong (its bin, clamped, is only kept in range for ``bincount``)."""
    lo, hi = float(edges[0]), float(edges[1])
    multiply, divisor = _bin_scale(float(edges[1] - edges[0]), bins)  # the width in float32, as histc's
    spread, index = buffers
    lows, highs = [], []
    for start in range(0, flat.numel(), PIECE):
        piece = flat[start:start + PIECE]
        low, high = torch.aminmax(piece)  # NaN when the piece holds one
        lows.append(low)
        highs.append(high)
        k = piece.numel()
        scaled = torch.sub(piece, lo, out=spread[:k])
        (scaled.mul_(bins) if multiply else scaled).div_(divisor)
        index[:k].copy_(scaled).clamp_(0, bins)  # the copy truncates
        counts += torch.bincount(index[:k], minlength=bins + 1)
    if len(lows) > 1:  # most gradients fit in one piece: no stack, no reduction of one value
        low, high = torch.stack(lows).amin(), torch.stack(highs).amax()
    return (low >= lo) & (high <= hi)


def _bin_scale(width: float, bins: int) -> tuple[bool, float]:
    """Whether ``x - lo`` is multiplied by ``bins`` before it is divided, and by what: histc's
    ``(x - lo) * bins / width``, or ``(x - lo) / (width / bins)`` (one pass fewer) when that rounds
    the same: ``bins`` a power of two and ``width / bins`` a normal float32, both scalings exact."""
    if bins & (bins - 1) == 0 and width / bins >= np.finfo(np.float32).tiny:
        return False, width / bins
    return True, width


def unit_sums(grad: torch.Tensor) -> torch.Tensor:
    """|g| summed per unit (dim 0), in float32 (float64 for a float64 gradient). A float32 gradient on
    a CPU by cache-sized slices of units, |g| of each written into one buffer: three times faster
    than ``vector_norm`` along a dimension there."""
    rows = grad.reshape(grad.shape[0], -1)
    if grad.device.type != "cpu" or grad.dtype != torch.float32:
        return torch.linalg.vector_norm(rows, 1, dim=1, dtype=None if grad.dtype == torch.float64 else torch.float32)
    step = max(1, PIECE // max(rows.shape[1], 1))
    buffer = torch.empty(min(len(rows), step) * rows.shape[1], dtype=torch.float32, device=grad.device)
    out = torch.empty(len(rows), dtype=torch.float32, device=grad.device)
    for start in range(0, len(rows), step):
        part = rows[start:start + step]
        torch.sum(torch.abs(part, out=buffer[:part.numel()].view(part.shape)), 1, out=out[start:start + step])
    return out
