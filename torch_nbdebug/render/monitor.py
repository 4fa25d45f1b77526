"""Monitor views: a text summary, a static figure (a matplotlib PNG in plain HTML), the interactive
widget (``static/monitor.js``: smoothing, log scale, zoom, per-layer panels) and the live panels.

The static view must survive notebook sanitizers (GitHub, nbviewer, JupyterLab's untrusted
outputs), so it is an ``<img>`` with a ``data:`` PNG plus text: no inline SVG, no ``<style>``, and
nothing whose meaning depends on a ``style=`` attribute. The picture is drawn by
:mod:`torch_nbdebug.render.figures` (a palette PNG: a saved monitor output stays a few tens of KB).

Alerts are listed grouped (:func:`~torch_nbdebug.process.monitor.group_alerts`): one row per step and
kind, the worst layer named with a count, the per-layer rows folded; the first non-finite value first.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import traitlets

from torch_nbdebug.data.monitor import Alert, MonitorHistory
from torch_nbdebug.process.monitor import AlertGroup, flat_limits, group_alerts, smooth, thin
from torch_nbdebug.render.figures import img_tag, log_axis, png
from torch_nbdebug.render.html import esc
from torch_nbdebug.render.live import MAX_POINTS, Progress
from torch_nbdebug.render.widget import View, esm_path

ALERT_COLOURS = {"non-finite": "#cf222e", "spike": "#bc4c00", "plateau": "#9a6700", "vanishing": "#8250df",
                 "exploding": "#bc4c00"}
# Layer curves, told apart at a glance (Okabe-Ito's colour-blind-safe set, with black): the static
# figure and the widget (sent in its meta) draw with the same list.
LAYER_COLOURS = ("#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00", "#000000", "#8c8c8c")
SERIES_COLOUR = "#0969da"
_WIDGET_POINTS = 2000   # points per watched series sent to the widget
_FIGURE_POINTS = 5000   # points per line in the static figure
_LAYER_POINTS = 400     # steps of the per-layer arrays sent to the widget
_TEXT_ALERTS = 8        # alert rows (groups) listed in the text summary
_HTML_ALERTS = 20       # and in the static HTML
_FIGURE_WIDTH = 640     # CSS px of the static figure; each panel 150 px high
_FIGURE_LAYERS = 8      # layers drawn in the static figure (largest last norm first, flagged ones always)


def fmt(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    return f"{value:.4g}" if value == 0 or 1e-3 <= abs(value) < 1e5 else f"{value:.3e}"


def title(history: MonitorHistory) -> str:
    what = ", ".join(history.expressions)
    n = len(history)
    every = f", every {history.every} steps" if history.every > 1 else ""
    last = int(history.steps[-1]) if n else 0
    state = {"finished": "finished", "running": "running",
             "stopped": f"stopped at step {last}: what was recorded is kept",
             "failed": f"the cell raised at step {last}: what was recorded is kept"}[history.status]
    took = f", {history.times[-1]:.1f} s" if n else ""
    return f"%%monitor {what}: {n} step{'s' if n != 1 else ''} recorded{every}{took} ({state})"


def text(history: MonitorHistory, alerts: tuple[Alert, ...]) -> str:
    """Title, the last and best value of each series, the layers' extremes, alerts, errors, notes."""
    lines = [title(history)]
    if not len(history):
        lines.append("no optimizer step ran inside the cell: %%monitor records at optimizer.step()")
    for i, name in enumerate(history.expressions):
        series = history.values[:, i]
        finite = np.isfinite(series)
        if not finite.any():
            continue
        k = int(np.nanargmin(np.where(finite, series, np.nan)))
        lines.append(f"  {name}: last {fmt(float(series[-1]))}, min {fmt(float(series[k]))} at step {history.steps[k]}")
    lines += _layer_lines(history)
    groups = group_alerts(alerts)
    if groups:
        lines.append("alerts:")
        lines += [f"  {g.kind}: {g.message()}" for g in groups[:_TEXT_ALERTS]]
        if len(groups) > _TEXT_ALERTS:
            lines.append(f"  ... and {len(groups) - _TEXT_ALERTS} more (all of them in .alerts)")
    lines += [f"could not evaluate {name!r} ({why}); it is NaN in the history" for name, why in history.errors.items()]
    lines += [f"note: {n}" for n in history.notes]
    return "\n".join(lines)


def _layer_lines(history: MonitorHistory) -> list[str]:
    if not history.layers or not len(history):
        return []
    last = history.grad_norm[-1]
    present = [li for li in range(len(history.layers)) if last[li] >= 0 and math.isfinite(last[li])]
    if not present:
        return [f"  {len(history.layers)} layers, no finite gradient norm at the last step"]
    hi, lo = max(present, key=lambda li: last[li]), min(present, key=lambda li: last[li])
    ratio = history.update_ratio[-1]
    median_ratio = np.nanmedian(ratio) if np.isfinite(ratio).any() else math.nan
    return [f"  {len(history.layers)} layers at the last step: gradient norm from {fmt(float(last[lo]))} "
            f"({history.layers[lo]}) to {fmt(float(last[hi]))} ({history.layers[hi]}); median update/parameter "
            f"ratio {fmt(float(median_ratio))}"]


# -- static figure ---------------------------------------------------------------------------
def figure_png(history: MonitorHistory, alerts: tuple[Alert, ...], smoothing: float = 0.6) -> Optional[bytes]:
    """The curves as a PNG (None when nothing was recorded or matplotlib is missing)."""
    if not len(history):
        return None
    try:
        import matplotlib  # noqa: F401 - drawn through render.figures (no pyplot, the user's rcParams untouched)
    except ImportError:
        return None
    panels = list(range(min(len(history.expressions), 3)))
    has_layers = bool(history.layers) and (history.grad_norm > 0).any()
    keep = thin(len(history), _FIGURE_POINTS)  # alerts are marked from the full series
    steps = history.steps[keep]

    def draw(fig: Any) -> None:
        axes = fig.subplots(len(panels) + has_layers, 1, sharex=True, squeeze=False)[:, 0]
        for ax, i in zip(axes, panels):
            name, series = history.expressions[i], history.values[:, i]
            smoothed = smooth(series, smoothing)
            ax.plot(steps, series[keep], color=SERIES_COLOUR, alpha=0.3, linewidth=0.8)
            ax.plot(steps, smoothed[keep], color=SERIES_COLOUR, linewidth=1.5, label=f"smoothed ({smoothing:g})")
            _y_range(ax, series, smoothed)
            ax.set_ylabel(_short(name), fontsize=8)
            _mark(ax, [a for a in alerts if a.of == "value" and a.series == name])
        if has_layers:
            ax = axes[-1]
            for colour, li in zip(LAYER_COLOURS, _figure_layers(history, alerts)):
                column = history.grad_norm[keep, li]
                ax.plot(steps, np.where(column > 0, column, np.nan), linewidth=1, color=colour,
                        label=_short(history.layers[li]))
            log_axis(ax)
            ax.set_ylabel("grad norm per layer", fontsize=8)
            _mark(ax, [a for a in alerts if a.of == "layer"])
        axes[-1].set_xlabel("optimizer step", fontsize=8)
        for ax in axes:
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        fig.tight_layout(pad=0.4)

    return png(draw, _FIGURE_WIDTH, 150 * (len(panels) + int(has_layers)) + 20)


def _y_range(ax: Any, series: np.ndarray, smoothed: np.ndarray) -> None:
    """A log axis for positive series spanning over 100x; a flat one for a series constant within
    float noise (a fixed learning rate, smoothed); plain numbers on the ticks (no offset)."""
    flat = flat_limits(np.concatenate([series, smoothed]))
    if flat is not None:
        ax.set_ylim(*flat)
    else:
        _log_if_wide(ax, series)
    formatter = ax.yaxis.get_major_formatter()
    if hasattr(formatter, "set_useOffset"):
        formatter.set_useOffset(False)


def _short(name: str, limit: int = 28) -> str:
    return name if len(name) <= limit else name[:limit - 1] + "…"


def _log_if_wide(ax: Any, series: np.ndarray) -> None:
    finite = series[np.isfinite(series)]
    if len(finite) and (finite > 0).all() and finite.max() / finite.min() > 100:
        log_axis(ax)


def _mark(ax: Any, alerts: list[Alert]) -> None:
    """A dashed line at each alert's step (one per kind and step), named once per kind in the legend."""
    named: set[str] = set()
    for kind, step in dict.fromkeys((a.kind, a.step) for a in alerts):
        ax.axvline(step, color=ALERT_COLOURS[kind], linestyle="--", linewidth=1,
                   label=None if kind in named else f"{kind} (step {step})")
        named.add(kind)
    ax.legend(fontsize=6, loc="upper left", ncol=3)


def _figure_layers(history: MonitorHistory, alerts: tuple[Alert, ...]) -> list[int]:
    flagged = [history.layers.index(a.series) for a in alerts if a.series in history.layers]
    last = np.nan_to_num(history.grad_norm[-1], nan=np.inf)
    biggest = [int(li) for li in np.argsort(-last)]
    chosen = list(dict.fromkeys(flagged + biggest))[:max(_FIGURE_LAYERS, len(set(flagged)))]
    return sorted(chosen)


def html(history: MonitorHistory, alerts: tuple[Alert, ...]) -> str:
    """Plain HTML: title, the figure as an ``<img>``, the alerts as a list and the summary text."""
    png = figure_png(history, alerts)
    parts = [f'<div class="tnd tnd-monitor"><p><b>{esc(title(history))}</b></p>']
    if png is not None:
        alt = "training curves of " + ", ".join(history.expressions) + " by optimizer step"
        width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")  # PNG's IHDR
        parts.append(img_tag(png, alt, width, height))
    groups = group_alerts(alerts)
    if groups:
        more = f"<li>... and {len(groups) - _HTML_ALERTS} more (all of them in .alerts)</li>" \
            if len(groups) > _HTML_ALERTS else ""
        parts.append('<p><b>Alerts</b></p><ul class="tnd-alerts">' + "".join(
            _alert_item(g) for g in groups[:_HTML_ALERTS]) + more + "</ul>")
    parts.append(f"<pre>{esc(text(history, alerts))}</pre></div>")
    return "".join(parts)


def _alert_item(group: AlertGroup) -> str:
    """One row; a group of layers folds its per-layer rows under it (``<details>`` keeps sanitized)."""
    head = f"<b>{esc(group.kind)}</b>: {esc(group.message())}"
    if len(group.members) == 1:
        return f"<li>{head}</li>"
    rows = "".join(f"<li>{esc(a.message())}</li>" for a in group.members)
    return f"<li><details><summary>{head}</summary><ul>{rows}</ul></details></li>"


def _group_json(group: AlertGroup) -> dict[str, Any]:
    return {"kind": group.kind, "step": group.step, "series": group.worst.series, "message": group.message(),
            "count": len(group.members), "layers": [a.message() for a in group.members] if len(group.members) > 1 else []}


# -- widget ----------------------------------------------------------------------------------
class MonitorView(View):
    """Curves with smoothing, log scale and zoom; per-layer gradient norm and update ratio."""

    _esm = esm_path("monitor.js")
    _css = esm_path("base.css")  # the shared look
    meta = traitlets.Dict().tag(sync=True)
    values = traitlets.Bytes(b"").tag(sync=True)      # float32 [n, expressions]
    norms = traitlets.Bytes(b"").tag(sync=True)       # float32 [m, layers] (-1: no gradient)
    ratios = traitlets.Bytes(b"").tag(sync=True)      # float32 [m, layers]
    smoothing = traitlets.Float(0.6).tag(sync=True)
    log_scale = traitlets.Bool(False).tag(sync=True)
    zoom: traitlets.List[Any] = traitlets.List([]).tag(sync=True)          # [first step, last step] or [] for everything
    panel = traitlets.Unicode("norm").tag(sync=True)  # "norm" or "ratio"


def widget(history: MonitorHistory, alerts: tuple[Alert, ...]) -> MonitorView:
    view = MonitorView()
    fill(view, history, alerts)
    return view


def fill(view: MonitorView, history: MonitorHistory, alerts: tuple[Alert, ...]) -> None:
    """Put the history into the view's traits, in one comm message."""
    keep = thin(len(history), _WIDGET_POINTS)
    rows = thin(len(history), _LAYER_POINTS) if history.layers else np.arange(0)
    with view.hold_sync():
        view.meta = {
            "title": title(history), "status": history.status, "expressions": list(history.expressions),
            "steps": [int(s) for s in history.steps[keep]], "layer_steps": [int(s) for s in history.steps[rows]],
            "layers": list(history.layers),
            "alerts": [{"kind": a.kind, "step": a.step, "series": a.series, "message": a.message()} for a in alerts],
            "groups": [_group_json(g) for g in group_alerts(alerts)], "colours": list(LAYER_COLOURS),
            "errors": [f"could not evaluate {k!r}: {v}" for k, v in history.errors.items()],
            "notes": list(history.notes)}
        view.values = history.values[keep].astype(np.float32).tobytes()
        view.norms = history.grad_norm[rows].astype(np.float32).tobytes() if len(rows) else b""
        view.ratios = history.update_ratio[rows].astype(np.float32).tobytes() if len(rows) else b""


# -- live panels -----------------------------------------------------------------------------
def progress(history: MonitorHistory, alerts: tuple[Alert, ...]) -> Progress:
    """The live view's status line and panels: each series, the layers' gradient norms, the alerts."""
    n = len(history)
    keep = thin(n, MAX_POINTS)
    x = [float(s) for s in history.steps[keep]]
    panels: list[Any] = []
    for i, name in enumerate(history.expressions[:3]):
        series = history.values[keep, i]
        panels.append({"kind": "lines", "title": name, "x": x, "xlabel": "optimizer step",
                       "series": [{"name": name, "y": _json(series)}]})
    if history.layers and n:
        layers = _figure_layers(history, alerts)
        panels.append({"kind": "lines", "title": "gradient norm per layer", "x": x, "xlabel": "optimizer step",
                       "log": True, "series": [{"name": history.layers[li],
                                                "y": _json(np.where(history.grad_norm[keep, li] > 0,
                                                                    history.grad_norm[keep, li], np.nan))}
                                               for li in layers]})
    if alerts:
        panels.append({"kind": "table", "title": "alerts", "columns": ["step", "alert", "what"],
                       "rows": [[str(g.step), g.kind, g.message()] for g in group_alerts(alerts)]})
    last = ", ".join(f"{name} {fmt(history.last(name))}" for name in history.expressions) if n else "waiting for the first optimizer step"
    status = f"step {int(history.steps[-1]) if n else 0}: {last}" + (f" · {len(group_alerts(alerts))} alert(s)" if alerts else "")
    return Progress(status=status, panels=panels, alert=bool(alerts))


def _json(values: np.ndarray) -> list[Optional[float]]:
    return [float(v) if math.isfinite(v) else None for v in values]
