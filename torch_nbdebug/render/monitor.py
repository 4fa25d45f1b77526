"""Monitor views: a text summary, a static figure (a matplotlib PNG in plain HTML), the interactive
widget (``static/monitor.js``: smoothing, log scale, zoom, per-layer panels) and the live panels.

The static view must survive notebook sanitizers (GitHub, nbviewer, JupyterLab's untrusted
outputs), so it is an ``<img>`` with a ``data:`` PNG plus text: no inline SVG, no ``<style>``, and
nothing whose meaning depends on a ``style=`` attribute.
"""
from __future__ import annotations

import io
import math
from typing import Any, Optional

import numpy as np
import traitlets

from torch_nbdebug.data.monitor import Alert, MonitorHistory
from torch_nbdebug.process.monitor import smooth, thin
from torch_nbdebug.render.figures import img_tag
from torch_nbdebug.render.html import esc
from torch_nbdebug.render.live import MAX_POINTS, Progress
from torch_nbdebug.render.widget import View, esm_path

ALERT_COLOURS = {"non-finite": "#cf222e", "spike": "#bc4c00", "plateau": "#9a6700", "vanishing": "#8250df",
                 "exploding": "#bc4c00"}
_WIDGET_POINTS = 2000   # points per watched series sent to the widget
_FIGURE_POINTS = 5000   # points per line in the static figure
_LAYER_POINTS = 400     # steps of the per-layer arrays sent to the widget
_TEXT_ALERTS = 8        # alerts listed in the text summary
_HTML_ALERTS = 20       # and in the static HTML
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
    if alerts:
        lines.append("alerts:")
        lines += [f"  {a.kind}: {a.message()}" for a in alerts[:_TEXT_ALERTS]]
        if len(alerts) > _TEXT_ALERTS:
            lines.append(f"  ... and {len(alerts) - _TEXT_ALERTS} more (all of them in .alerts)")
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
        from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend
    except ImportError:
        return None
    panels = list(range(min(len(history.expressions), 3)))
    has_layers = bool(history.layers) and (history.grad_norm > 0).any()
    fig = Figure(figsize=(7.5, 1.9 * (len(panels) + has_layers) + 0.3), dpi=90)
    axes = fig.subplots(len(panels) + has_layers, 1, sharex=True, squeeze=False)[:, 0]
    keep = thin(len(history), _FIGURE_POINTS)  # alerts are marked from the full series
    steps = history.steps[keep]
    for ax, i in zip(axes, panels):
        name, series = history.expressions[i], history.values[:, i]
        ax.plot(steps, series[keep], color="#0969da", alpha=0.3, linewidth=0.8)
        ax.plot(steps, smooth(series, smoothing)[keep], color="#0969da", linewidth=1.5,
                label=f"smoothed ({smoothing:g})")
        _log_if_wide(ax, series)
        ax.set_ylabel(_short(name), fontsize=8)
        _mark(ax, [a for a in alerts if a.of == "value" and a.series == name])
    if has_layers:
        ax = axes[-1]
        for li in _figure_layers(history, alerts):
            column = history.grad_norm[keep, li]
            norms = np.where(column > 0, column, np.nan)
            ax.plot(steps, norms, linewidth=1, label=_short(history.layers[li]))
        ax.set_yscale("log")
        ax.set_ylabel("grad norm per layer", fontsize=8)
        _mark(ax, [a for a in alerts if a.of == "layer"])
    axes[-1].set_xlabel("optimizer step", fontsize=8)
    for ax in axes:
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _short(name: str, limit: int = 28) -> str:
    return name if len(name) <= limit else name[:limit - 1] + "…"


def _log_if_wide(ax: Any, series: np.ndarray) -> None:
    finite = series[np.isfinite(series)]
    if len(finite) and (finite > 0).all() and finite.max() / finite.min() > 100:
        ax.set_yscale("log")


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
    if alerts:
        more = f"<li>... and {len(alerts) - _HTML_ALERTS} more (all of them in .alerts)</li>" \
            if len(alerts) > _HTML_ALERTS else ""
        parts.append("<p><b>Alerts</b></p><ul>" + "".join(
            f"<li><b>{esc(a.kind)}</b>: {esc(a.message())}</li>" for a in alerts[:_HTML_ALERTS]) + more + "</ul>")
    parts.append(f"<pre>{esc(text(history, alerts))}</pre></div>")
    return "".join(parts)


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
    zoom = traitlets.List([]).tag(sync=True)          # [first step, last step] or [] for everything
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
                       "rows": [[str(a.step), a.kind, a.message()] for a in alerts]})
    last = ", ".join(f"{name} {fmt(history.last(name))}" for name in history.expressions) if n else "waiting for the first optimizer step"
    status = f"step {int(history.steps[-1]) if n else 0}: {last}" + (f" · {len(alerts)} alert(s)" if alerts else "")
    return Progress(status=status, panels=panels, alert=bool(alerts))


def _json(values: np.ndarray) -> list[Optional[float]]:
    return [float(v) if math.isfinite(v) else None for v in values]
