"""Gradient views: a text table, static HTML (inline SVG flow plot, PNG heatmap, SVG histograms) and
the stepper widget (``static/grads.js``).

The static view is what a notebook opened without a kernel shows, so it carries both overview
images and the opened layer's histograms; the widget carries the numbers as float32 bytes and
draws everything in the browser.
"""
from __future__ import annotations

import base64
import warnings
import math
import struct
import zlib
from typing import Any, Optional

import numpy as np
import traitlets

from torch_nbdebug.data.grads import ACT_FIELDS, FIELDS, Flag, GradTrace, Histogram
from torch_nbdebug.process.grads import flagged_layers, layer_arrays, layer_table, norm_heatmap
from torch_nbdebug.render.html import esc, stylesheet
from torch_nbdebug.render.widget import View, esm_path

FLAG_COLOURS = {"non-finite": "#cf222e", "exploding": "#bc4c00", "vanishing": "#8250df", "dead": "#57606a",
                "frozen": "#0969da"}
_HEAT_MAX_COLS = 400


def fmt_count(value: Optional[float], approx: bool = False) -> str:
    """Counts (zeros, NaN, Inf) as whole numbers: ``1,024`` rather than ``1.02e+03``."""
    if value is None or not math.isfinite(value):
        return "—"
    return ("≈" if approx else "") + f"{int(round(value)):,}"


def fmt(value: Optional[float], approx: bool = False) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    text = f"{value:.3g}" if abs(value) >= 1e-3 or value == 0 or not math.isfinite(value) else f"{value:.2e}"
    return ("≈" if approx else "") + text


def _title(trace: GradTrace, step: int) -> str:
    if not trace.steps:
        return f"gradients of {trace.model}: nothing recorded (no backward pass ran inside the block)"
    what = {"snapshot": "current .grad", "optimizer": "optimizer steps", "backward": "backward passes"}[trace.step_kind]
    where = f"step {trace.steps[step]} ({step + 1} of {len(trace.steps)} {what})" if trace.step_kind != "snapshot" else what
    return f"gradients of {trace.model}: {len(trace.layers)} layers in {trace.order} order, {where}"


def text(trace: GradTrace, flags: tuple[Flag, ...], step: int = -1) -> str:
    """A table of layers with the flags and their reasons."""
    step = step % len(trace.steps) if trace.steps else 0
    lines = [_title(trace, step)]
    if not trace.steps:
        return lines[0]
    table = layer_table(trace, step)
    by_layer = flagged_layers(tuple(f for f in flags if f.step == step))
    width = max([len(n) for n in trace.layer_names] + [5])
    lines.append(f"{'layer':<{width}}  {'type':<12} {'norm':>9} {'mean|g|':>9} {'max|g|':>9} {'‖Δw‖/‖w‖':>9}  flags")
    for li, layer in enumerate(trace.layers):
        kinds = ",".join(f.kind for f in by_layer.get(li, []))
        lines.append(f"{layer.name:<{width}}  {layer.kind[:12]:<12} {fmt(table['norm'][li]):>9} "
                     f"{fmt(table['mean_abs'][li]):>9} {fmt(table['max_abs'][li]):>9} "
                     f"{fmt(table['update_ratio'][li]):>9}  {kinds}")
    for li, found in by_layer.items():
        for f in found:
            lines.append(f"  {f.kind}: {trace.layers[li].name}: {f.reason}")
    lines += [f"note: {n}" for n in trace.notes]
    return "\n".join(lines)


# -- static images ------------------------------------------------------------------------------
def flow_svg(trace: GradTrace, step: int, flags: tuple[Flag, ...], width: Optional[int] = None) -> str:
    """Gradient flow: max |g| (light bar) and mean |g| (dark bar) per layer on a log scale."""
    width = width or max(8, min(40, 640 // max(len(trace.layers), 1)))
    table = layer_table(trace, step)
    mean, peak = table["mean_abs"], table["max_abs"]
    vals = np.concatenate([mean, peak])
    vals = vals[np.isfinite(vals) & (vals > 0)]
    lo, hi = (math.floor(math.log10(vals.min())), math.ceil(math.log10(vals.max()))) if len(vals) else (-8, 0)
    hi = max(hi, lo + 1)
    n, h, left = len(trace.layers), 160, 58
    w = left + n * width + 10
    bottom = 44  # layer numbers and the axis title under the bars
    y = lambda v: h - (math.log10(v) - lo) / (hi - lo) * h + 8 if v > 0 and math.isfinite(v) else h + 8  # noqa: E731
    by_layer = flagged_layers(tuple(f for f in flags if f.step == step))
    parts = [f'<svg class="tnd-flow" style="background:#fff" xmlns="http://www.w3.org/2000/svg" width="{max(w, 260)}" height="{h + bottom}" '
             f'role="img" aria-label="gradient flow" font-family="sans-serif">',
             f'<text x="11" y="{h / 2 + 8:.0f}" font-size="10" text-anchor="middle" fill="#57606a" '
             f'transform="rotate(-90 11 {h / 2 + 8:.0f})">|gradient| (log scale)</text>',
             f'<text x="{left + n * width / 2:.0f}" y="{h + bottom - 4}" font-size="10" text-anchor="middle" '
             f'fill="#57606a">layer # (as in the table)</text>']
    for e in range(lo, hi + 1):
        parts.append(f'<line x1="{left}" x2="{w}" y1="{y(10.0 ** e):.1f}" y2="{y(10.0 ** e):.1f}" stroke="#eaeef2"/>'
                     f'<text x="{left - 4}" y="{y(10.0 ** e) + 4:.1f}" font-size="10" text-anchor="end" fill="#57606a">1e{e}</text>')
    for li, layer in enumerate(trace.layers):
        x = left + li * width
        colour = FLAG_COLOURS[by_layer[li][0].kind] if li in by_layer else "#1f6feb"
        tip = esc(f"{layer.name} ({layer.kind}): mean |g| {fmt(mean[li])}, max |g| {fmt(peak[li])}"
                  + "".join(f"; {f.kind}: {f.reason}" for f in by_layer.get(li, [])))
        if not (np.isfinite(mean[li]) and np.isfinite(peak[li])):  # nothing to draw: say why, in red
            parts.append(f'<rect x="{x + 2}" y="8" width="{width - 4}" height="{h}" fill="#cf222e" opacity="0.12">'
                         f'<title>{tip}</title></rect><text x="{x + width / 2:.1f}" y="{h / 2 + 8:.1f}" font-size="9" '
                         f'text-anchor="middle" fill="#cf222e" transform="rotate(-90 {x + width / 2:.1f} {h / 2 + 8:.1f})">'
                         f'NaN/Inf</text>')
        for v, opacity in ((peak[li], 0.35), (mean[li], 1.0)):
            if np.isfinite(v) and v > 0:
                parts.append(f'<rect x="{x + 2}" y="{y(v):.1f}" width="{width - 4}" height="{h + 8 - y(v):.1f}" '
                             f'fill="{colour}" fill-opacity="{opacity}"><title>{tip}</title></rect>')
        if n <= 40 or li % max(1, n // 20) == 0:
            parts.append(f'<text x="{x + width / 2:.1f}" y="{h + 20}" font-size="9" text-anchor="middle" '
                         f'fill="#57606a">{li}</text>')
        if li in by_layer:
            parts.append(f'<text x="{x + width / 2:.1f}" y="{h + 30}" font-size="10" font-weight="bold" '
                         f'text-anchor="middle" fill="{colour}">!</text>')
    parts.append("</svg>")
    return "".join(parts)


def heatmap_png(grid: np.ndarray, scale: int = 4, bad: Optional[np.ndarray] = None) -> str:
    """Layers × steps of log10 norm as a base64 PNG (one pixel per cell, scaled by CSS).

    ``bad`` (same shape, bool) marks cells whose gradient had NaN/Inf: drawn red, not blank.
    """
    if grid.shape[1] > _HEAT_MAX_COLS:  # average log-norms over buckets of steps
        edges = np.linspace(0, grid.shape[1], _HEAT_MAX_COLS + 1).astype(int)
        buckets = list(zip(edges[:-1], edges[1:]))
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN bucket is fine: it stays blank
            grid = np.stack([np.nanmean(grid[:, a:b], axis=1) for a, b in buckets], axis=1)
        if bad is not None:
            bad = np.stack([bad[:, a:b].any(axis=1) for a, b in buckets], axis=1)
    logs = np.log10(np.where(grid > 0, grid, np.nan))
    finite = logs[np.isfinite(logs)]
    lo, hi = (finite.min(), finite.max()) if finite.size else (0.0, 1.0)
    t = np.clip((logs - lo) / max(hi - lo, 1e-12), 0, 1)
    rgb = _viridis(np.nan_to_num(t))
    rgb[~np.isfinite(logs)] = (255, 255, 255)
    rgb[np.isposinf(logs)] = (207, 34, 46)  # an infinite norm overflowed: as loud as NaN
    if bad is not None:
        rgb[bad] = (207, 34, 46)
    return base64.b64encode(_png(rgb)).decode("ascii")


def _viridis(t: np.ndarray) -> np.ndarray:
    stops = np.array([[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]], dtype=float)
    pos = t * (len(stops) - 1)
    i = np.clip(pos.astype(int), 0, len(stops) - 2)
    f = (pos - i)[..., None]
    return (stops[i] * (1 - f) + stops[i + 1] * f).astype(np.uint8)


def _png(rgb: np.ndarray) -> bytes:
    """A minimal RGB PNG encoder (no image library needed for a few hundred pixels)."""
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[r].tobytes() for r in range(h))
    chunk = lambda tag, data: (struct.pack(">I", len(data)) + tag + data  # noqa: E731
                               + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def hist_svg(hist: Histogram, log: bool = False, width: int = 256, height: int = 80) -> str:
    counts = np.array(hist.counts)
    shown = np.log10(counts + 1) if log else counts
    top = max(float(shown.max()), 1e-12)
    bw = width / len(counts)
    bars = "".join(f'<rect x="{i * bw:.1f}" y="{height - v / top * height:.1f}" width="{max(bw - 0.5, 0.5):.1f}" '
                   f'height="{v / top * height:.1f}" fill="#1f6feb"/>' for i, v in enumerate(shown) if v > 0)
    zero = ""
    if hist.lo < 0 < hist.hi:  # where zero falls: a gradient centred off zero is worth seeing
        zx = (0 - hist.lo) / (hist.hi - hist.lo) * width
        zero = (f'<line x1="{zx:.1f}" x2="{zx:.1f}" y1="0" y2="{height}" stroke="#57606a" stroke-dasharray="2 2"/>'
                f'<text x="{zx:.1f}" y="{height + 12}" font-size="10" text-anchor="middle" fill="#57606a">0</text>')
    return (f'<svg class="tnd-hist" style="background:#fff" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height + 14}" '
            f'font-family="sans-serif">{bars}<line x1="0" x2="{width}" y1="{height}" y2="{height}" stroke="#8c959f"/>{zero}'
            f'<text x="0" y="{height + 12}" font-size="10" fill="#57606a">{esc(fmt(hist.lo))}</text>'
            f'<text x="{width}" y="{height + 12}" font-size="10" text-anchor="end" fill="#57606a">{esc(fmt(hist.hi))}</text></svg>')


# -- static HTML -----------------------------------------------------------------------------------
def html(trace: GradTrace, flags: tuple[Flag, ...], layer: int = 0, step: int = -1) -> str:
    step = step % len(trace.steps) if trace.steps else 0
    parts = [stylesheet(), '<div class="tnd tnd-grads">', f"<h3>{esc(_title(trace, step))}</h3>"]
    if trace.steps:
        parts.append('<div><b>gradient flow</b> <span class="muted">per layer at this step: <b>dark bar</b> = mean |g|, '
                     '<b>light bar</b> = max |g|, log scale; ! = flagged (see the table)</span></div>'
                     '<div style="overflow-x:auto">' + flow_svg(trace, step, flags) + "</div>")
        if len(trace.steps) > 1:
            parts.append(_heatmap_block(trace, flags))
        parts.append(_layer_table_html(trace, flags, step, layer))
        parts.append(_layer_detail_html(trace, layer, step, flags))
    parts += [f'<p class="muted">{esc(n)}</p>' for n in trace.notes]
    parts.append("</div>")
    return "".join(parts)


def _heatmap_block(trace: GradTrace, flags: tuple[Flag, ...] = ()) -> str:
    grid = norm_heatmap(trace)
    n_l, n_s = grid.shape
    bad = np.zeros(grid.shape, bool)
    for f in flags:
        if f.kind == "non-finite" and 0 <= f.layer < n_l and 0 <= f.step < n_s:
            bad[f.layer, f.step] = True
    logs = np.log10(grid[np.isfinite(grid) & (grid > 0)])
    px = max(2, min(40, 640 // max(min(n_s, _HEAT_MAX_COLS), 1)))
    py = max(4, min(20, 240 // max(n_l, 1)))
    img = (f'<img class="tnd-heatmap" alt="gradient norm, layers by steps" src="data:image/png;base64,'
           f'{heatmap_png(grid, bad=bad)}" style="image-rendering:pixelated;width:{min(n_s, _HEAT_MAX_COLS) * px}px;'
           f'height:{n_l * py}px;border:1px solid #d0d7de">')
    scale = ""
    if logs.size:
        stops = ", ".join(f"rgb{tuple(int(c) for c in v)}" for v in _viridis(np.linspace(0, 1, 5)))
        scale = (f'<div class="legend muted" style="margin-top:2px">‖g‖ colour: <span class="mono">{fmt(10 ** logs.min())}</span> '
                 f'<span style="display:inline-block;width:120px;height:10px;vertical-align:-1px;'
                 f'background:linear-gradient(to right, {stops})"></span> <span class="mono">{fmt(10 ** logs.max())}</span>'
                 f' (log) &nbsp; <span class="swatch" style="background:#cf222e"></span>NaN/Inf &nbsp; '
                 f'<span class="swatch" style="background:#fff"></span>no gradient</div>')
    return (f'<div style="margin-top:8px"><b>gradient norm, layers × steps</b> <span class="muted">(rows = layers in '
            f'{esc(trace.order)} order, #0 {esc(trace.layers[0].name)} at the top; columns = steps '
            f'{trace.steps[0]}…{trace.steps[-1]}, left to right)</span><br>{img}{scale}</div>')


def _layer_table_html(trace: GradTrace, flags: tuple[Flag, ...], step: int, current: int) -> str:
    table = layer_table(trace, step)
    by_layer = flagged_layers(tuple(f for f in flags if f.step == step))
    rows = ["<table><tr><th class='num'>#</th><th>layer</th><th>type</th><th class='num'>‖g‖</th>"
            "<th class='num'>mean |g|</th><th class='num'>max |g|</th>"
            "<th class='num' title='size of the last update relative to the weights'>‖Δw‖/‖w‖</th><th>flags</th></tr>"]
    for li, layer in enumerate(trace.layers):
        cls = ' class="sel"' if li == current else ""
        why = "<br>".join(f'<span style="color:{FLAG_COLOURS[f.kind]}">{esc(f.kind)}</span>: {esc(f.reason)}'
                          for f in by_layer.get(li, []))
        rows.append(f"<tr{cls}><td class='num'>{li}</td><td class=\"mono nowrap\">{esc(layer.name)}</td><td>{esc(layer.kind)}</td>"
                    f"<td class='num'>{fmt(table['norm'][li])}</td><td class='num'>{fmt(table['mean_abs'][li])}</td>"
                    f"<td class='num'>{fmt(table['max_abs'][li])}</td><td class='num'>{fmt(table['update_ratio'][li])}</td>"
                    f"<td>{why}</td></tr>")
    return "".join(rows) + "</table>"


def _layer_detail_html(trace: GradTrace, layer: int, step: int, flags: tuple[Flag, ...] = ()) -> str:
    lg = trace.layer(layer, step)
    mine = [f for f in flags if f.step == step and f.layer == layer]
    cls = "card" if any(f.kind == "non-finite" for f in mine) else "card caution" if mine else "card info"
    parts = [f'<div class="{cls}"><b class="mono">{esc(lg.name)}</b> ({esc(lg.info.kind)}) '
             f'<span class="muted">— layer #{layer}, the one marked in the table</span>']
    parts += [f'<div style="color:{FLAG_COLOURS[f.kind]}">{esc(f.kind)}: {esc(f.reason)}</div>' for f in mine]
    head = ("<tr><th>parameter</th><th>shape</th><th class='num'>‖g‖</th><th class='num'>mean</th><th class='num'>std</th>"
            "<th class='num'>max |g|</th><th class='num'>zeros</th><th class='num'>NaN</th><th class='num'>Inf</th>"
            "<th class='num'>‖w‖</th><th class='num'>‖Δw‖/‖w‖</th></tr>")
    rows, hists = [], []
    for p in lg.params:
        approx = not p.exact
        cells = (fmt(p.norm), fmt(p.mean), fmt(p.std), fmt(p.max_abs), fmt_count(p.zeros, approx),
                 fmt_count(p.nan, approx), fmt_count(p.inf, approx), fmt(p.param_norm), fmt(p.update_ratio, approx))
        rows.append(f"<tr><td class='mono'>{esc(p.info.short)}</td><td class='mono nowrap'>{esc(list(p.info.shape))}</td>"
                    + "".join(f"<td class='num'>{c}</td>" for c in cells) + "</tr>")
        if p.hist is not None:
            hists.append(f'<div style="display:inline-block;margin-right:16px"><div class="muted">'
                         f'<span class="mono">{esc(p.info.short)}</span>.grad values (histogram)</div>{hist_svg(p.hist)}</div>')
    parts.append(f"<table>{head}{''.join(rows)}</table>" + "".join(hists))
    if lg.activation:
        parts.append("<div>activations: " + esc(", ".join(f"{k} {fmt(v)}" for k, v in lg.activation.items())) + "</div>")
    return "".join(parts) + "</div>"


# -- widget ----------------------------------------------------------------------------------------
class GradsView(View):
    """The stepper: overview (flow plot, heatmap) plus per-layer detail; ``layer``/``step`` sync both ways."""

    _esm = esm_path("grads.js")
    _css = esm_path("base.css")  # the shared look, also in the live view
    meta = traitlets.Dict().tag(sync=True)
    stats = traitlets.Bytes(b"").tag(sync=True)       # float32 [S, P, F]
    flow = traitlets.Bytes(b"").tag(sync=True)        # float32 [S, L, 4]: norm, mean|g|, max|g|, update ratio
    hist = traitlets.Bytes(b"").tag(sync=True)        # float32 [H, P, B]
    hist_range = traitlets.Bytes(b"").tag(sync=True)  # float32 [H, P, 2]
    acts = traitlets.Bytes(b"").tag(sync=True)        # float32 [S, L, A]
    layer = traitlets.Int(0).tag(sync=True)
    step = traitlets.Int(0).tag(sync=True)
    log_scale = traitlets.Bool(False).tag(sync=True)


def widget(trace: GradTrace, flags: tuple[Flag, ...], layer: int = 0, step: int = -1) -> GradsView:
    n_s = len(trace.steps)
    arrays = layer_arrays(trace)
    flow = np.stack([arrays[k] for k in ("norm", "mean_abs", "max_abs", "update_ratio")], 2) if n_s \
        else np.zeros((0, 0, 4))
    meta: dict[str, Any] = {
        "model": trace.model, "step_kind": trace.step_kind, "order": trace.order, "notes": list(trace.notes),
        "steps": list(trace.steps), "fields": list(FIELDS), "act_fields": list(ACT_FIELDS),
        "bins": int(trace.hist.shape[2]) if trace.hist.ndim == 3 else 0, "hist_rows": list(trace.hist_rows),
        "exact": trace.exact.astype(int).tolist(), "colours": FLAG_COLOURS,
        "layers": [{"name": lay.name, "kind": lay.kind, "params": list(lay.params)} for lay in trace.layers],
        "params": [{"name": p.name, "short": p.short, "shape": list(p.shape), "numel": p.numel, "dtype": p.dtype,
                    "requires_grad": p.requires_grad} for p in trace.params],
        "flags": [[f.kind, f.layer, f.step, f.reason] for f in flags],
    }
    return GradsView(meta=meta, stats=_f32(trace.stats), flow=_f32(flow), hist=_f32(trace.hist),
                     hist_range=_f32(trace.hist_range),
                     acts=_f32(trace.activations) if trace.activations is not None else b"",
                     layer=layer, step=step % n_s if n_s else 0)


def _f32(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, dtype="<f4").tobytes()


__all__ = ["text", "html", "widget", "GradsView", "flow_svg", "heatmap_png", "hist_svg", "fmt", "FLAG_COLOURS"]
