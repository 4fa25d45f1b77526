"""Magnitudes judged against the dtype: when a square, a product or a sum of values this large passes the
largest number of the dtype the op computes in. Every hint that reasons about magnitudes asks here, so a
hint never calls 5e21 "zero variance" in float32 (whose squares overflow from about 1.8e19).
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

from torch_nbdebug.data.nanwatch import ROUNDS_TO_ZERO
from torch_nbdebug.data.stats import TensorStats

LARGEST = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38,
           "float64": 1.7976931348623157e308}
SMALLEST = ROUNDS_TO_ZERO  # below these a constant rounds to 0
HALF = ("float16", "bfloat16")


def largest(dtype: str) -> Optional[float]:
    return LARGEST.get(dtype)


def magnitude(s: Optional[TensorStats]) -> Optional[float]:
    """The largest absolute finite value (None when the statistics have none)."""
    if s is None or s.min is None or s.max is None:
        return None
    return max(abs(s.min), abs(s.max))


def fused_limit(s: TensorStats) -> Optional[float]:
    """The largest number of the dtype a fused reduction (layer/group/batch norm, var, norm) computes
    in: float32 for a half input (it accumulates in float32), else the input's own dtype."""
    return largest("float32" if s.dtype in HALF else s.dtype)


def squares_overflow(stats: Iterable[TensorStats], fused: bool = True) -> Optional[TensorStats]:
    """The first input whose squares pass the largest number (sqrt(finfo.max): 1.8e19 in float32, 256 in
    float16); ``fused``: computed as a fused reduction does (see :func:`fused_limit`)."""
    for s in stats:
        m, limit = magnitude(s), fused_limit(s) if fused else largest(s.dtype)
        if m is not None and limit is not None and m > math.sqrt(limit):
            return s
    return None


def sum_overflows(s: Optional[TensorStats], dtype: Optional[str] = None) -> bool:
    """Whether adding up ``s``'s values can pass the largest number of ``dtype`` (default: its own)."""
    m = magnitude(s)
    limit = largest(dtype or (s.dtype if s is not None else ""))
    return s is not None and m is not None and limit is not None and m * max(s.numel, 1) > limit


def limit_words(s: TensorStats, fused: bool = True) -> str:
    """``float32's largest number (3.403e+38), whose square root is 1.845e+19`` for a hint."""
    dtype = "float32" if fused and s.dtype in HALF else s.dtype
    limit = LARGEST[dtype]
    return f"{dtype}'s largest number ({limit:.4g}) is the square of {math.sqrt(limit):.4g}"
