"""Pure functions over a :class:`MonitorHistory`: the alerts, smoothing and thinning for the plots.

Each rule is one function of the arrays, used by the live view, the final view, the text summary
and the TensorBoard export alike (a rule lives in one place).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np

from torch_nbdebug.data.monitor import Alert, MonitorHistory, Rules


def alerts(history: MonitorHistory, rules: Rules = Rules(), *, start: int = 0,
           before: tuple[Alert, ...] = ()) -> tuple[Alert, ...]:
    """Every alert, at most one per (kind, series): the first step where it fires, in step order.

    ``before`` are the alerts of the first ``start`` rows (an earlier call on a shorter history of
    the same run): only the rows from ``start`` on are then scanned (with the spike window before
    them), so a live view checks each row once however long the run. The plateau is the state of
    the whole series, recomputed each time (one min over it).
    """
    found = [a for a in before if a.kind != "plateau"]
    seen = {(a.kind, a.series) for a in found}
    steps, new = history.steps, []
    context = max(start - rules.spike_window, 0)
    for i, name in enumerate(history.expressions):
        series = history.values[:, i]
        if name not in history.errors:  # NaN there means "could not evaluate", said in the errors
            new += nonfinite(steps[start:], series[start:], name)
        new += spike(steps[context:], series[context:], name, rules)
        if i == 0:
            new += plateau(steps, series, name, rules)
    if history.layers and len(history.grad_norm):
        new += layer_alerts(steps[start:], history.grad_norm[start:], history.layers, rules)
    found += [a for a in new if a.kind == "plateau" or (a.kind, a.series) not in seen]
    return tuple(sorted(found, key=lambda a: (a.step, a.kind)))


def nonfinite(steps: np.ndarray, series: np.ndarray, name: str) -> list[Alert]:
    """The first NaN or Inf. A value that could not be evaluated is also NaN in the series, but the
    recorder keeps those apart (``history.errors``), so only values that really were NaN/Inf count."""
    bad = np.flatnonzero(np.isinf(series) | np.isnan(series))
    if not len(bad):
        return []
    k = int(bad[0])
    return [Alert("non-finite", int(steps[k]), name, float(series[k]), math.nan)]


SPIKE_WARMUP = 5  # finite points a spike is measured against, at least (fewer: no median yet)


def running_median(series: np.ndarray, window: int) -> np.ndarray:
    """Median of |value| over the ``window`` points before each point, or over all earlier points while
    there are fewer (from ``SPIKE_WARMUP`` finite ones on: a spike at step 8 of a short run counts too);
    NaN before that. Non-finite points are left out so one NaN does not hide a later spike."""
    out = np.full(len(series), np.nan)
    mags = np.abs(series.astype(np.float64))
    mags[~np.isfinite(mags)] = np.nan
    least = min(SPIKE_WARMUP, max(window // 2, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN windows: NaN, as wanted
        for j in range(1, min(window, len(series))):  # the first points: every earlier one
            if np.sum(np.isfinite(mags[:j])) >= least:
                out[j] = np.nanmedian(mags[:j])
        if len(series) > window:
            past = np.lib.stride_tricks.sliding_window_view(mags, window)[:-1]  # past[j] precedes point j + window
            enough = np.sum(np.isfinite(past), axis=1) >= max(window // 2, 1)
            out[window:] = np.where(enough, np.nanmedian(past, axis=1), np.nan)
    return out


def spike(steps: np.ndarray, series: np.ndarray, name: str, rules: Rules) -> list[Alert]:
    """The first finite value more than ``spike_factor`` times its running median (in magnitude)."""
    median = running_median(series, rules.spike_window)
    with np.errstate(invalid="ignore"):
        hit = np.isfinite(series) & (median > 0) & (np.abs(series) > rules.spike_factor * median)
    idx = np.flatnonzero(hit)
    if not len(idx):
        return []
    k = int(idx[0])
    return [Alert("spike", int(steps[k]), name, float(series[k]), float(median[k]))]


def plateau(steps: np.ndarray, series: np.ndarray, name: str, rules: Rules) -> list[Alert]:
    """The loss has not beaten its best by more than ``plateau_tol`` for the last ``plateau_window``
    points: reported at the start of that stretch (where it stopped improving)."""
    window = rules.plateau_window
    finite = np.isfinite(series)
    if len(series) <= window or not finite[:-window].any() or not finite.all():
        return []  # a non-finite run is reported as such, not as a plateau
    best = float(np.min(series[:-window]))
    recent = float(np.min(series[-window:]))
    if recent < best - rules.plateau_tol * abs(best):
        return []
    k = len(series) - window
    return [Alert("plateau", int(steps[k]), name, recent, best)]


def layer_alerts(steps: np.ndarray, norms: np.ndarray, layers: tuple[str, ...], rules: Rules) -> list[Alert]:
    """Per layer (a column of ``norms``), the first NaN, vanishing (below the rule) and exploding
    (above it, or inf) gradient norm; all layers checked at once."""
    out: list[Alert] = []
    present = _present(norms)
    # An infinite norm is exploding, not non-finite: float32 squares overflow from |g| ~ 1e19 while
    # every element is still finite. A NaN norm means a NaN (or +inf and -inf) in the gradient.
    with np.errstate(invalid="ignore"):
        checks = (("non-finite", np.isnan(norms), math.nan),
                  ("vanishing", np.isfinite(norms) & (norms < rules.vanishing), rules.vanishing),
                  ("exploding", norms > rules.exploding, rules.exploding))
    for kind, hit, reference in checks:
        hit = hit & present
        for li in np.flatnonzero(hit.any(axis=0)):
            k = int(np.argmax(hit[:, li]))
            out.append(Alert(kind, int(steps[k]), layers[li], float(norms[k, li]), reference,  # type: ignore[arg-type]
                             of="layer"))
    return out


def _present(norms: np.ndarray) -> np.ndarray:
    """Points where the layer had a gradient: the recorder stores -1 for "no gradient this step"
    (NaN means a NaN gradient), so a frozen layer is neither vanishing nor non-finite."""
    return ~(norms < 0)


@dataclass(frozen=True)
class AlertGroup:
    """The alerts of one kind at one step: a watched value's alone, or every layer's at once (a
    divergence sets off most layers in the same step), led by the worst of them."""

    worst: Alert
    members: tuple[Alert, ...]

    @property
    def kind(self) -> str:
        return self.worst.kind

    @property
    def step(self) -> int:
        return self.worst.step

    def message(self) -> str:
        more = len(self.members) - 1
        return self.worst.message() + (f" (and {more} more layer{'s' if more > 1 else ''})" if more else "")


def group_alerts(found: tuple[Alert, ...]) -> tuple[AlertGroup, ...]:
    """One group per (step, kind) of the layer alerts, each value alert its own; the first
    non-finite watched value leads (the line a diverged run is about), the rest in step order."""
    layers: dict[tuple[int, str], list[Alert]] = {}
    groups: list[AlertGroup] = []
    for a in found:
        if a.of == "layer":
            layers.setdefault((a.step, a.kind), []).append(a)
        else:
            groups.append(AlertGroup(a, (a,)))
    groups += [AlertGroup(_worst(members), tuple(members)) for members in layers.values()]
    groups.sort(key=lambda g: (g.step, g.worst.of != "value", g.kind))
    lead = next((g for g in groups if g.kind == "non-finite" and g.worst.of == "value"), None)
    return tuple([lead] + [g for g in groups if g is not lead]) if lead is not None else tuple(groups)


def _worst(members: list[Alert]) -> Alert:
    """The largest norm (exploding), the smallest (vanishing), else the first layer."""
    if members[0].kind == "exploding":
        return max(members, key=lambda a: a.value)
    if members[0].kind == "vanishing":
        return min(members, key=lambda a: a.value)
    return members[0]


def smooth(series: np.ndarray, weight: float) -> np.ndarray:
    """TensorBoard-style exponential moving average, debiased, skipping non-finite points."""
    if not 0 <= weight < 1:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    out = np.full(len(series), np.nan)
    last, n = 0.0, 0
    for k, value in enumerate(series.astype(np.float64)):
        if not math.isfinite(value):
            continue
        last, n = last * weight + (1 - weight) * value, n + 1
        out[k] = last / (1 - weight ** n)
    return out


FLAT_TOL = 1e-9  # a series whose spread is below this fraction of its size is drawn flat


def flat_limits(values: np.ndarray) -> "tuple[float, float] | None":
    """The y range to draw a series that is constant within :data:`FLAT_TOL` (relative): smoothing
    leaves float noise of ~1e-18 on a fixed learning rate, which an axis fitted to the data would
    blow up into a zig-zag across the chart. 10% either side of the value (1 at zero); None when the
    series really varies (or has no finite value)."""
    finite = values[np.isfinite(values)]
    if not len(finite):
        return None
    lo, hi = float(finite.min()), float(finite.max())
    size = max(abs(lo), abs(hi))
    if hi - lo > FLAT_TOL * size:
        return None
    mid = (lo + hi) / 2
    pad = 0.1 * abs(mid) if mid else 1.0
    return mid - pad, mid + pad


def thin(n: int, limit: int) -> np.ndarray:
    """Indices of at most ``limit`` evenly spread points out of ``n``, always keeping the last."""
    if n <= limit:
        return np.arange(n)
    idx = np.unique(np.linspace(0, n - 1, limit).round().astype(np.int64))
    return idx
