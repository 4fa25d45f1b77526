"""Summary statistics of one tensor, kept instead of the tensor itself."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Optional


@dataclass(frozen=True)
class TensorStats:
    """What a debugger needs to know about a tensor, without keeping it alive.

    ``min``/``max``/``mean``/``std`` are over the finite elements only (None when there are none
    or when the dtype has no order, e.g. complex); ``nan``/``inf`` count non-finite elements
    (``inf`` counts both signs, ``neg_inf`` the negative ones).
    """

    shape: tuple[int, ...]
    dtype: str
    device: str
    numel: int
    min: Optional[float] = None
    max: Optional[float] = None
    mean: Optional[float] = None
    std: Optional[float] = None
    nan: int = 0
    inf: int = 0
    neg_inf: int = 0
    zeros: int = 0
    note: str = ""

    @property
    def finite(self) -> bool:
        return self.nan == 0 and self.inf == 0

    @property
    def nonfinite(self) -> int:
        return self.nan + self.inf

    def brief(self) -> str:
        """One line, e.g. ``float32[4, 8] min=-1.2 max=3.4 nan=2``."""
        shape = ", ".join(str(s) for s in self.shape)
        text = f"{self.dtype}[{shape}]"
        if self.note:
            return f"{text} ({self.note})"
        if self.min is not None and self.max is not None:
            text += f" min={_fmt(self.min)} max={_fmt(self.max)}"
        if self.nan:
            text += f" nan={self.nan}"
        if self.inf:
            text += f" inf={self.inf}"
        return text

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["shape"] = list(self.shape)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TensorStats":
        known = {f.name for f in fields(cls)}
        return cls(**dict({k: v for k, v in data.items() if k in known}, shape=tuple(data["shape"])))


def fmt_number(value: float, digits: int = 4) -> str:
    """The one way every view writes a statistic: plain from 1e-3 up to 1e5 (``digits`` significant
    digits: ``0.001234``, ``12340``), with an exponent outside (``8.125e+19``, ``-5.136e+21``, ``1.5e-07``)."""
    if not math.isfinite(value):
        return str(value)  # nan, inf, -inf
    rounded = float(f"{value:.{digits}g}")
    if value == 0 or 1e-3 <= abs(rounded) < 1e5:
        return f"{rounded:g}"
    mantissa, exponent = f"{value:.{digits - 1}e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{exponent}"


def _fmt(value: float) -> str:
    return fmt_number(value)
