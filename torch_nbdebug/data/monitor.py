"""Data of ``%%monitor``: the watched values and per-layer gradient figures at each optimizer step.

Plain numbers only (numpy arrays, strings): a :class:`MonitorHistory` keeps no tensor, so keeping
the result of a long run costs a few kilobytes and never holds the model's memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Mapping, Optional

import numpy as np

from torch_nbdebug.errors import InputError

AlertKind = Literal["non-finite", "spike", "plateau", "vanishing", "exploding"]
Status = Literal["running", "finished", "stopped", "failed"]
ALERT_KINDS: tuple[AlertKind, ...] = ("non-finite", "spike", "plateau", "vanishing", "exploding")


@dataclass(frozen=True)
class Rules:
    """When an alert is raised. Every rule is checked on the recorded points (every ``every`` steps).

    - non-finite: a watched value or a layer's gradient norm is NaN or Inf (always on);
    - spike: a watched value is more than ``spike_factor`` times the median of its last
      ``spike_window`` points (in absolute value; of all earlier ones, at least five, in a run's first steps);
    - plateau: the first watched value (the loss) has not improved its best by more than
      ``plateau_tol`` (relative) over the last ``plateau_window`` points;
    - vanishing / exploding: a layer's gradient norm is below ``vanishing`` / above ``exploding``.
    """

    spike_factor: float = 10.0
    spike_window: int = 20
    plateau_window: int = 200
    plateau_tol: float = 1e-3
    vanishing: float = 1e-7
    exploding: float = 1e3

    def __post_init__(self) -> None:
        for name in ("spike_factor", "plateau_tol", "vanishing", "exploding"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise InputError(f"monitor rule {name} must be a positive number, got {value!r}")
        for name in ("spike_window", "plateau_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise InputError(f"monitor rule {name} must be a whole number of recorded points >= 2, got {value!r}")
        if self.spike_factor <= 1:
            raise InputError(f"monitor rule spike_factor must be above 1 (a factor over the median), "
                             f"got {self.spike_factor!r}")
        if self.plateau_tol >= 1:
            raise InputError(f"monitor rule plateau_tol is a relative improvement below 1 (e.g. 0.001), "
                             f"got {self.plateau_tol!r}")
        if self.vanishing >= self.exploding:
            raise InputError(f"monitor rules: vanishing ({self.vanishing!r}) must be below exploding "
                             f"({self.exploding!r})")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class Alert:
    """One rule that fired, at the first recorded step where it did (for its series)."""

    kind: AlertKind
    step: int            # optimizer step where it fired (steps completed before it, from 0)
    series: str          # the watched expression, or the layer for vanishing/exploding
    value: float         # the value that fired it
    reference: float     # what it was compared with: running median, best so far, threshold
    of: Literal["value", "layer"] = "value"   # a watched value, or a layer's gradient norm

    def message(self) -> str:
        if self.kind == "non-finite":
            what = f"the gradient norm of {self.series}" if self.of == "layer" else self.series
            return (f"step {self.step}: {what} is {self.value} — rerun the cell under %%nanwatch to "
                    f"find where it was born")
        if self.kind == "spike":
            return (f"step {self.step}: {self.series} jumped to {self.value:.4g}, "
                    f"{abs(self.value) / self.reference:.0f}x its running median {self.reference:.4g}")
        if self.kind == "plateau":
            return f"step {self.step}: {self.series} has not improved on its best {self.reference:.4g} since"
        word = "below" if self.kind == "vanishing" else "above"
        beyond = " (beyond float32's range: its elements may still be finite)" if math.isinf(self.value) else ""
        return (f"step {self.step}: gradient norm of {self.series} is {self.value:.3g}{beyond}, {word} "
                f"{self.reference:.3g} ({self.kind})")


def _frozen(array: np.ndarray) -> np.ndarray:
    array = np.ascontiguousarray(array)
    array.setflags(write=False)
    return array


@dataclass(frozen=True, eq=False)
class MonitorHistory:
    """What ``%%monitor`` recorded, one row per recorded optimizer step.

    ``steps`` numbers each step by the optimizer steps completed before it, from 0 (as ``GradTrace``).
    ``values[:, i]`` is ``expressions[i]`` (NaN where it could not be evaluated or read as a
    number); ``grad_norm`` and ``update_ratio`` are [steps, layers] (NaN where a layer had no
    gradient); ``times`` are seconds since the block started. ``history["loss"]`` is one series.
    """

    expressions: tuple[str, ...]
    steps: np.ndarray
    times: np.ndarray
    values: np.ndarray
    layers: tuple[str, ...] = ()
    grad_norm: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    update_ratio: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    errors: Mapping[str, str] = field(default_factory=dict)
    status: Status = "finished"
    every: int = 1
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.steps)
        for name in ("steps", "times", "values", "grad_norm", "update_ratio"):
            object.__setattr__(self, name, _frozen(np.asarray(getattr(self, name))))
        if self.values.shape != (n, len(self.expressions)):
            raise ValueError(f"values must be [{n}, {len(self.expressions)}], got {self.values.shape}")
        for name in ("grad_norm", "update_ratio"):
            shape = getattr(self, name).shape
            if n and shape != (n, len(self.layers)):
                raise ValueError(f"{name} must be [{n}, {len(self.layers)}], got {shape}")

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, name: str) -> np.ndarray:
        """One watched series by its expression (``history["loss"]``) or a layer's gradient norm."""
        if name in self.expressions:
            return self.values[:, self.expressions.index(name)]
        if name in self.layers and len(self.grad_norm):
            return self.grad_norm[:, self.layers.index(name)]
        known = ", ".join(repr(e) for e in self.expressions) or "nothing"
        raise KeyError(f"{name!r} was not monitored; the series are {known} (and the layers in .layers)")

    def last(self, name: Optional[str] = None) -> float:
        """The latest value of a series (default: the first expression); NaN before any step."""
        series = self[name or self.expressions[0]]
        return float(series[-1]) if len(series) else math.nan

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: ``{"step": [...], "time": [...], expression: [...]}`` (NaN as None)."""
        clean = lambda a: [None if not math.isfinite(v) else float(v) for v in a]  # noqa: E731
        out: dict[str, Any] = {"step": [int(s) for s in self.steps], "time": clean(self.times)}
        for i, expression in enumerate(self.expressions):
            out[expression] = clean(self.values[:, i])
        return out
