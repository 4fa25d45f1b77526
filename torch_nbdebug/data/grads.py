"""Per-layer gradient statistics over training steps, as plain data (no live tensors).

A :class:`GradTrace` is columnar: ``stats[step, param, field]`` (float64, NaN where unknown) and
``hist[row, param, bin]`` for the steps that kept a histogram. Columns keep a 1000-step trace of a
150-parameter model small and cheap to ship to the widget as bytes; :meth:`GradTrace.layer` builds
friendly :class:`LayerGrads` / :class:`ParamGrad` views on demand.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence, Union

import numpy as np

# Columns of ``GradTrace.stats``. Counts (zeros/nan/inf) are estimates scaled from a random sample
# where ``exact`` is False; ``dead_units`` (slices along dim 0 whose gradient is all zero) is only
# known on exact rows; ``update_ratio`` only on optimizer steps.
FIELDS: tuple[str, ...] = ("has_grad", "norm", "mean", "std", "min", "max", "max_abs", "mean_abs",
                           "zeros", "nan", "inf", "param_norm", "update_ratio", "dead_units")
FIELD = {name: i for i, name in enumerate(FIELDS)}
# Activation columns (forward hooks, ``activations=True``): the layer's output and its input.
ACT_FIELDS: tuple[str, ...] = ("out_mean", "out_std", "out_zero_frac", "in_zero_frac", "in_dead_features",
                               "in_features")

FLAG_KINDS: tuple[str, ...] = ("non-finite", "exploding", "vanishing", "dead", "frozen")


@dataclass(frozen=True)
class ParamInfo:
    """What does not change across steps: the parameter's path, layer, shape and trainability."""

    name: str              # "model.fc1.weight"
    layer: int             # index into GradTrace.layers
    shape: tuple[int, ...]
    dtype: str
    numel: int
    requires_grad: bool

    @property
    def short(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    @property
    def units(self) -> int:
        """Output units (rows/channels): the size of dim 0 for matrices and kernels, else 0."""
        return self.shape[0] if len(self.shape) >= 2 else 0


@dataclass(frozen=True)
class LayerInfo:
    """A module that owns parameters directly: ``model.blocks.0.attn.qkv`` (a Linear)."""

    name: str
    kind: str
    params: tuple[int, ...]  # indices into GradTrace.params


@dataclass(frozen=True)
class Flag:
    """One finding with a one-line reason, e.g. ``dead``: "all 512 gradient values are zero"."""

    kind: str             # one of FLAG_KINDS
    layer: int
    step: int             # row in GradTrace.steps
    reason: str
    param: Optional[int] = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Histogram:
    """Gradient values binned over ``[lo, hi]``; counts are scaled estimates when ``exact`` is False."""

    lo: float
    hi: float
    counts: tuple[float, ...]
    exact: bool

    @property
    def edges(self) -> tuple[float, ...]:
        n = len(self.counts)
        return tuple(self.lo + (self.hi - self.lo) * i / n for i in range(n + 1))


@dataclass(frozen=True)
class ParamGrad:
    """One parameter's gradient statistics at one step (None where unknown)."""

    info: ParamInfo
    has_grad: bool
    norm: Optional[float]
    mean: Optional[float]
    std: Optional[float]
    max_abs: Optional[float]
    mean_abs: Optional[float]
    zeros: Optional[float]
    nan: Optional[float]
    inf: Optional[float]
    param_norm: Optional[float]
    update_ratio: Optional[float]
    dead_units: Optional[float]
    exact: bool
    hist: Optional[Histogram]

    @property
    def name(self) -> str:
        return self.info.name


@dataclass(frozen=True)
class LayerGrads:
    """A layer at one step: its parameters' gradients plus optional activation statistics."""

    info: LayerInfo
    step: int
    params: tuple[ParamGrad, ...]
    activation: Optional[dict[str, float]] = None

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def norm(self) -> Optional[float]:
        """L2 norm over all the layer's gradients (None when none has a gradient)."""
        norms = [p.norm for p in self.params if p.norm is not None]
        return math.sqrt(sum(n * n for n in norms)) if norms else None

    def param(self, short: str) -> ParamGrad:
        for p in self.params:
            if p.info.short == short:
                return p
        raise KeyError(f"{self.name} has no parameter {short!r}; it has {[p.info.short for p in self.params]}")


@dataclass(frozen=True, eq=False)
class GradTrace:
    """Gradient statistics of one model's layers (forward order) over recorded steps.

    ``steps[i]`` is the step number of row ``i`` (optimizer steps, or backward passes when no
    optimizer stepped, or a single ``snapshot``). ``exact[i, p]`` says whether counts and the
    histogram of parameter ``p`` at row ``i`` cover every element (else a fixed random sample).
    ``hist_rows[j]`` is the stats row that ``hist[j]`` belongs to; ``hist_range[j, p]`` = (lo, hi).
    """

    model: str
    params: tuple[ParamInfo, ...]
    layers: tuple[LayerInfo, ...]
    steps: tuple[int, ...]
    stats: np.ndarray          # [S, P, len(FIELDS)] float64
    exact: np.ndarray          # [S, P] bool
    hist_rows: tuple[int, ...]
    hist: np.ndarray           # [H, P, B] float64
    hist_range: np.ndarray     # [H, P, 2] float64
    step_kind: str = "snapshot"          # "optimizer" | "backward" | "snapshot"
    order: str = "registration"          # "forward" | "registration"
    sample: Optional[int] = None
    activations: Optional[np.ndarray] = None   # [S, L, len(ACT_FIELDS)] float64
    notes: tuple[str, ...] = field(default=())

    # -- access ---------------------------------------------------------------------------
    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(layer.name for layer in self.layers)

    def layer_index(self, layer: Union[int, str]) -> int:
        """Index of a layer given as index, full path ``model.fc1`` or path without the model name."""
        if isinstance(layer, int):
            if not -len(self.layers) <= layer < len(self.layers):
                raise IndexError(f"layer {layer} out of range: {self.model} has {len(self.layers)} layers")
            return layer % len(self.layers)
        names = self.layer_names
        for candidate in (layer, f"{self.model}.{layer}"):
            if candidate in names:
                return names.index(candidate)
        raise KeyError(f"no layer {layer!r} in {self.model}; layers are {', '.join(names[:8])}"
                       + (" ..." if len(names) > 8 else ""))

    def value(self, step: int, param: int, name: str) -> Optional[float]:
        v = float(self.stats[step, param, FIELD[name]])
        return None if math.isnan(v) else v

    def histogram(self, step: int, param: int) -> Optional[Histogram]:
        """The histogram kept for row ``step`` (None when that step kept none)."""
        step = step % len(self.steps)
        if step not in self.hist_rows:
            return None
        j = self.hist_rows.index(step)
        lo, hi = (float(v) for v in self.hist_range[j, param])
        if math.isnan(lo):
            return None
        return Histogram(lo, hi, tuple(float(c) for c in self.hist[j, param]), bool(self.exact[step, param]))

    def param_grad(self, step: int, param: int) -> ParamGrad:
        get = lambda name: self.value(step, param, name)  # noqa: E731 - local shorthand
        return ParamGrad(self.params[param], bool(self.stats[step, param, FIELD["has_grad"]] > 0),
                         get("norm"), get("mean"), get("std"), get("max_abs"), get("mean_abs"), get("zeros"),
                         get("nan"), get("inf"), get("param_norm"), get("update_ratio"), get("dead_units"),
                         bool(self.exact[step, param]), self.histogram(step, param))

    def layer(self, layer: Union[int, str], step: int = -1) -> LayerGrads:
        """The layer ``layer`` (index or name) at row ``step`` (default: the last one)."""
        li = self.layer_index(layer)
        step = step % len(self.steps)
        info = self.layers[li]
        act = None
        if self.activations is not None:
            row = self.activations[step, li]
            act = {k: float(v) for k, v in zip(ACT_FIELDS, row) if not math.isnan(v)} or None
        return LayerGrads(info, step, tuple(self.param_grad(step, p) for p in info.params), act)

    # -- serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "step_kind": self.step_kind, "order": self.order, "sample": self.sample,
            "notes": list(self.notes), "steps": list(self.steps), "fields": list(FIELDS),
            "params": [dict(asdict(p), shape=list(p.shape)) for p in self.params],
            "layers": [dict(asdict(layer), params=list(layer.params)) for layer in self.layers],
            "stats": _nan_to_none(self.stats), "exact": self.exact.astype(bool).tolist(),
            "hist_rows": list(self.hist_rows), "hist": self.hist.tolist(), "hist_range": _nan_to_none(self.hist_range),
            "activations": None if self.activations is None else _nan_to_none(self.activations),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GradTrace":
        if list(d.get("fields", FIELDS)) != list(FIELDS):
            raise ValueError("this GradTrace was saved by another version of torch_nbdebug (fields differ)")
        params = tuple(ParamInfo(**dict(p, shape=tuple(p["shape"]))) for p in d["params"])
        layers = tuple(LayerInfo(**dict(layer, params=tuple(layer["params"]))) for layer in d["layers"])
        n_p, bins = len(params), (len(d["hist"][0][0]) if d["hist"] and d["hist"][0] else 0)
        acts = d.get("activations")
        return cls(
            model=d["model"], params=params, layers=layers, steps=tuple(d["steps"]),
            stats=_array(d["stats"], (len(d["steps"]), n_p, len(FIELDS))),
            exact=np.array(d["exact"], dtype=bool).reshape(len(d["steps"]), n_p),
            hist_rows=tuple(d["hist_rows"]), hist=_array(d["hist"], (len(d["hist_rows"]), n_p, bins)),
            hist_range=_array(d["hist_range"], (len(d["hist_rows"]), n_p, 2)),
            step_kind=d["step_kind"], order=d["order"], sample=d["sample"],
            activations=None if acts is None else _array(acts, (len(d["steps"]), len(layers), len(ACT_FIELDS))),
            notes=tuple(d["notes"]))

    @classmethod
    def from_json(cls, text: str) -> "GradTrace":
        return cls.from_dict(json.loads(text))


def _nan_to_none(a: np.ndarray) -> Any:
    if not a.size:
        return a.tolist()
    out = a.astype(object)
    out[np.isnan(a)] = None
    return out.tolist()


def _array(values: Sequence[Any], shape: tuple[int, ...]) -> np.ndarray:
    return np.array(values, dtype=np.float64).reshape(shape) if values else np.zeros(shape)
