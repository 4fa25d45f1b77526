"""Pure functions over a :class:`GradTrace`: per-layer aggregates, flags with reasons, link targets.

Thresholds are explicit (:class:`Thresholds`) and every flag says the number that tripped it, so a
user can judge a borderline case instead of trusting a colour.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from torch_nbdebug.data.grads import ACT_FIELDS, FIELD, Flag, GradTrace


@dataclass(frozen=True)
class Thresholds:
    """When a layer is flagged (rms = norm / sqrt(number of elements with a gradient))."""

    vanishing_rms: float = 1e-8        # absolute: below this the update is lost in float32 rounding
    vanishing_rel: float = 1e-4        # relative to the median layer rms of the same step
    exploding_norm: float = 1e3        # absolute layer gradient norm
    exploding_rel: float = 1e3         # relative to the median layer rms of the same step
    exploding_growth: float = 1e2      # relative to the layer's median norm over earlier steps
    dead_units: float = 0.5            # fraction of output units / input features that are dead


def layer_arrays(trace: GradTrace) -> dict[str, np.ndarray]:
    """Per-layer aggregates for every step at once, each [steps, layers]: norm, rms, mean |g|,
    max |g|, update ratio and elements with a gradient (NaN where no parameter had a gradient)."""
    n_s, n_l = len(trace.steps), len(trace.layers)
    out = {k: np.full((n_s, n_l), np.nan) for k in ("norm", "rms", "mean_abs", "max_abs", "update_ratio", "numel")}
    filled = [li for li, layer in enumerate(trace.layers) if layer.params]
    if not n_s or not filled:
        return out
    # Every layer at once: the parameters of the layers laid end to end, each sum a segment sum.
    idx = [p for li in filled for p in trace.layers[li].params]
    starts = np.cumsum([0] + [len(trace.layers[li].params) for li in filled[:-1]])
    seg = lambda values, op=np.add: op.reduceat(values, starts, axis=1)  # noqa: E731
    st = trace.stats[:, idx]                                                 # [S, p]
    has = st[:, :, FIELD["has_grad"]] > 0
    numel = np.array([trace.params[p].numel for p in idx], dtype=np.float64) * has
    with np.errstate(invalid="ignore", divide="ignore"):
        total = seg(numel)
        some = total > 0
        take = lambda name: np.where(has, st[:, :, FIELD[name]], 0.0)  # noqa: E731
        norm = np.sqrt(seg(take("norm") ** 2))
        ratio, pn = st[:, :, FIELD["update_ratio"]], take("param_norm")
        known = seg(has & ~np.isnan(ratio), np.logical_or)
        # ‖Δw‖/‖w‖ of the whole layer: combine per-parameter ‖Δw‖ = ratio·‖w‖ (NaN ones left out).
        moved = np.where(has, (ratio * pn) ** 2, np.nan)
        delta = np.sqrt(seg(np.where(np.isnan(moved), 0.0, moved)))
        columns = {"numel": total, "norm": norm, "rms": norm / np.sqrt(total),
                   "mean_abs": seg(take("mean_abs") * numel) / total,
                   "max_abs": seg(np.where(has, st[:, :, FIELD["max_abs"]], -np.inf), np.maximum)}
        for key, values in columns.items():
            out[key][:, filled] = np.where(some, values, np.nan)
        out["update_ratio"][:, filled] = np.where(known, delta / np.maximum(np.sqrt(seg(pn ** 2)), 1e-30), np.nan)
    return out


def layer_table(trace: GradTrace, step: int = -1) -> dict[str, np.ndarray]:
    """Per-layer aggregates at one step (see :func:`layer_arrays`)."""
    arrays = layer_arrays(trace)
    if not trace.steps:
        return {k: np.full(len(trace.layers), np.nan) for k in arrays}
    return {k: v[step % len(trace.steps)] for k, v in arrays.items()}


def norm_heatmap(trace: GradTrace) -> np.ndarray:
    """Layers × steps gradient norm (NaN where a layer had no gradient)."""
    return layer_arrays(trace)["norm"].T


def step_flags(trace: GradTrace, step: int = -1, limits: Thresholds = Thresholds(),
               arrays: Optional[dict[str, np.ndarray]] = None) -> tuple[Flag, ...]:
    """Flags of every layer at one step, at most one per kind and layer, most serious first.

    ``arrays`` (:func:`layer_arrays`) may be passed in when flagging many steps, to compute it once.
    """
    if not trace.steps:
        return ()
    step = step % len(trace.steps)
    arrays = arrays if arrays is not None else layer_arrays(trace)
    table = {k: v[step] for k, v in arrays.items()}
    rms = table["rms"][np.isfinite(table["rms"])]
    median_rms = float(np.median(rms)) if len(rms) >= 3 else math.nan
    history = None  # per layer: (median norm over earlier steps, how many earlier steps had one)
    if step >= 3:
        past = arrays["norm"][:step]
        counts = np.isfinite(past).sum(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns: layers never with a gradient
            finite = np.isfinite(past)
            medians = np.median(past, 0) if finite.all() else np.nanmedian(np.where(finite, past, np.nan), 0)
            history = np.stack([medians, counts], 1)
    found: list[Flag] = []
    loud = _loud_params(trace, step, limits)
    for li in np.flatnonzero(_loud_layers(trace, loud, table, median_rms, history, limits)).tolist():
        for kind, reason, param in _layer_findings(trace, step, li, table, median_rms, history, limits, loud):
            found.append(Flag(kind, li, step, reason, param))
    return tuple(found)


def trace_flags(trace: GradTrace, limits: Thresholds = Thresholds()) -> tuple[Flag, ...]:
    """Flags of every step (the widget shows them as the step slider moves)."""
    arrays = layer_arrays(trace)
    return tuple(f for s in range(len(trace.steps)) for f in step_flags(trace, s, limits, arrays))


def _loud_params(trace: GradTrace, step: int, limits: Thresholds) -> np.ndarray:
    """The parameters :func:`_param_finding` may flag at ``step`` (a superset, for every parameter
    at once): the others are skipped without a call each."""
    s = trace.stats[step]
    units = np.array([info.units for info in trace.params], dtype=np.float64)
    norm, dead = s[:, FIELD["norm"]], s[:, FIELD["dead_units"]]
    with np.errstate(invalid="ignore"):
        return ((s[:, FIELD["has_grad"]] == 0) | (s[:, FIELD["nan"]] > 0) | (s[:, FIELD["inf"]] > 0) |
                ~(norm <= _FLOAT32_MAX) | (norm == 0) | ((units > 0) & (dead >= limits.dead_units * units)))


def _loud_layers(trace: GradTrace, loud: np.ndarray, table: dict[str, np.ndarray], median_rms: float,
                 history: Optional[np.ndarray], limits: Thresholds) -> np.ndarray:
    """The layers :func:`_layer_findings` may flag (a superset, for every layer at once): a loud
    parameter (a frozen layer's are), a size finding's condition, or activations to look at. The
    others are skipped without a call each."""
    n_l = len(trace.layers)
    if trace.activations is not None:
        return np.ones(n_l, bool)
    sizes = np.array([len(layer.params) for layer in trace.layers], np.int64)
    members = np.fromiter((p for layer in trace.layers for p in layer.params), np.int64, int(sizes.sum()))
    out = np.zeros(n_l, bool)
    out[np.repeat(np.arange(n_l), sizes)[loud[members]]] = True
    norm = table["norm"]
    with np.errstate(invalid="ignore"):
        size = np.zeros(n_l, bool)
        for _, test, _ in _SIZE_RULES:  # every layer at once
            size |= test(norm, table["rms"], median_rms, history.T if history is not None else None, limits)
    return out | (size & np.isfinite(norm))


def _layer_findings(trace: GradTrace, step: int, li: int, table: dict[str, np.ndarray], median_rms: float,
                    history: Optional[np.ndarray], limits: Thresholds, loud: Optional[np.ndarray] = None
                    ) -> list[tuple[str, str, Optional[int]]]:
    layer = trace.layers[li]
    s = trace.stats[step]
    out: list[tuple[str, str, Optional[int]]] = []
    for p in layer.params:
        found = _param_finding(trace, step, p, limits) if loud is None or loud[p] else None
        if found and all(kind != found[0] for kind, _, _ in out):
            out.append((*found, p))
    norm, rms = table["norm"][li], table["rms"][li]
    if np.isfinite(norm) and not any(k in ("non-finite", "exploding", "dead") for k, _, _ in out):
        out += _size_findings(norm, rms, median_rms, history[li] if history is not None else None, limits)
    act = _activation_finding(trace, step, li, limits)
    if act and all(kind != "dead" for kind, _, _ in out):
        out.append((*act, None))
    if layer.params and all(s[p, FIELD["has_grad"]] == 0 for p in layer.params) and \
            not any(k == "frozen" for k, _, _ in out):
        out.append(("frozen", "no parameter of this layer has a gradient", None))
    order = {k: i for i, k in enumerate(("non-finite", "exploding", "vanishing", "dead", "frozen"))}
    return sorted(out, key=lambda f: order[f[0]])


def _param_finding(trace: GradTrace, step: int, p: int, limits: Thresholds) -> Optional[tuple[str, str]]:
    info = trace.params[p]
    s = trace.stats[step, p]
    short = info.short
    if s[FIELD["has_grad"]] == 0:
        if not info.requires_grad:
            return "frozen", f"{short} has requires_grad=False: it is frozen, the optimizer cannot change it"
        return "frozen", f"{short} got no gradient: it did not take part in the loss (or backward was not run)"
    nan, inf, norm = s[FIELD["nan"]], s[FIELD["inf"]], s[FIELD["norm"]]
    if nan > 0 or inf > 0 or np.isnan(norm):
        approx = "" if trace.exact[step, p] else "about "
        return "non-finite", (f"{short} gradient has {approx}{_count(nan)} NaN and {_count(inf)} Inf values "
                              f"out of {info.numel}")
    if not norm <= _FLOAT32_MAX:  # every value finite (none counted), only the norm is out of range
        size = "overflows float64" if np.isinf(norm) else f"{norm:.3g}, beyond float32's {_FLOAT32_MAX:.3g}"
        return "exploding", (f"{short} gradient norm {size}: every value is finite, the largest |g| is "
                             f"{s[FIELD['max_abs']]:.3g}")
    if s[FIELD["norm"]] == 0:
        return "dead", (f"all {info.numel} gradient values of {short} are zero (dead units, e.g. a ReLU that "
                        "never fires, or an output that does not reach the loss)")
    dead, units = s[FIELD["dead_units"]], info.units
    # An embedding's all-zero rows are tokens absent from the batch, not dead units.
    sparse_rows = "Embedding" in trace.layers[info.layer].kind
    if units and not sparse_rows and np.isfinite(dead) and dead >= limits.dead_units * units:
        return "dead", f"{int(dead)} of {units} units of {short} (rows) have an all-zero gradient (dead ReLU units?)"
    return None


_FLOAT32_MAX = float(np.finfo(np.float32).max)  # a larger gradient norm is a float64 alone can hold


def _relative(median_rms: float) -> bool:
    return bool(np.isfinite(median_rms) and median_rms > 0)


def _grown(norm: Any, history: Optional[np.ndarray], limits: Thresholds) -> Any:
    if history is None:
        return False
    median, count = history[0], history[1]
    return (count >= 3) & (median > 0) & (norm >= limits.exploding_growth * median)


# The size findings, first match wins: (kind, test, message). A test takes a layer's (norm, rms) and the
# (median, count) of its earlier norms, or arrays of every layer's (``_loud_layers``): one rule for both.
_SIZE_RULES: tuple[tuple[str, Callable[..., Any], Callable[..., str]], ...] = (
    ("exploding", lambda norm, rms, mrms, hist, lim: norm >= lim.exploding_norm,
     lambda norm, rms, mrms, hist, lim: f"gradient norm {norm:.3g} ≥ {lim.exploding_norm:g}"),
    ("exploding", lambda norm, rms, mrms, hist, lim: _relative(mrms) and rms >= lim.exploding_rel * mrms,
     lambda norm, rms, mrms, hist, lim: f"gradient rms {rms:.3g} is {rms / mrms:.3g}× the median layer's"),
    ("exploding", lambda norm, rms, mrms, hist, lim: _grown(norm, hist, lim),
     lambda norm, rms, mrms, hist, lim: f"gradient norm {norm:.3g} is {norm / hist[0]:.3g}× its median over "
                                        "earlier steps"),
    ("vanishing", lambda norm, rms, mrms, hist, lim: rms < lim.vanishing_rms,
     lambda norm, rms, mrms, hist, lim: f"gradient rms {rms:.3g} < {lim.vanishing_rms:g}"),
    ("vanishing", lambda norm, rms, mrms, hist, lim: _relative(mrms) and rms <= lim.vanishing_rel * mrms,
     lambda norm, rms, mrms, hist, lim: f"gradient rms {rms:.3g} is {rms / mrms:.2g}× the median layer's"),
)


def _size_findings(norm: float, rms: float, median_rms: float, history: Optional[np.ndarray],  # (median, n)
                   limits: Thresholds) -> list[tuple[str, str, Optional[int]]]:
    for kind, test, message in _SIZE_RULES:
        if test(norm, rms, median_rms, history, limits):
            return [(kind, message(norm, rms, median_rms, history, limits), None)]
    return []


def _activation_finding(trace: GradTrace, step: int, li: int, limits: Thresholds) -> Optional[tuple[str, str]]:
    if trace.activations is None:
        return None
    row = dict(zip(ACT_FIELDS, trace.activations[step, li]))
    dead, feats = row["in_dead_features"], row["in_features"]
    if np.isfinite(dead) and np.isfinite(feats) and feats > 0 and dead >= limits.dead_units * feats:
        return "dead", (f"{int(dead)} of {int(feats)} input features are zero for every sample "
                        "(dead ReLU units before this layer)")
    if np.isfinite(row["out_zero_frac"]) and row["out_zero_frac"] >= 0.99:
        return "dead", f"{row['out_zero_frac']:.0%} of this layer's outputs are zero"
    return None


def _count(value: float) -> str:
    return str(int(value)) if np.isfinite(value) else "?"


def layer_for_module(trace: GradTrace, module: Optional[str]) -> Optional[int]:
    """The layer to open for a module path from another report (nanwatch's ``model.fc2``, say).

    The layer itself; else the layer containing it (``model.fc2.act``); else the first layer, in
    forward order, inside it (a block); None when the path is outside this model.
    """
    if not module or not trace.layers:
        return None
    if module != trace.model and not module.startswith(trace.model + "."):
        return None
    names = trace.layer_names
    if module in names:
        return names.index(module)
    holders = [i for i, n in enumerate(names) if module.startswith(n + ".")]
    if holders:
        return max(holders, key=lambda i: len(names[i]))
    inside = [i for i, n in enumerate(names) if n.startswith(module + ".") or module == trace.model]
    return inside[0] if inside else None


def flagged_layers(flags: tuple[Flag, ...]) -> dict[int, list[Flag]]:
    """Layer index → its flags (in the order given)."""
    out: dict[int, list[Flag]] = {}
    for f in flags:
        out.setdefault(f.layer, []).append(f)
    return out
