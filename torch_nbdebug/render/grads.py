"""Gradient views: a text table, static HTML (PNG pictures: flow chart, heatmap, histograms) and
the stepper widget (``static/grads.js``).

The static view is what a notebook opened without a kernel shows, so it carries both overview
images and the opened layer's histograms; the widget carries the numbers as float32 bytes and
draws everything in the browser (float64 bytes for an array holding a number beyond float32's range,
a norm of float64 gradients past 3.4e38 say, which float32 would turn into inf: ``meta["wide"]`` names them).
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
from torch_nbdebug.data.stats import fmt_number
from torch_nbdebug.process.grads import flagged_layers, layer_arrays, layer_table, norm_heatmap
from torch_nbdebug.render.html import esc, muted, table
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
    """A statistic as every view writes it (:func:`fmt_number`: plain from 1e-3 up to 1e5, an exponent
    outside); ``—`` for no value (a layer without a gradient), ``≈`` before an estimate."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    return ("≈" if approx else "") + fmt_number(float(value))


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
    kind_w = max([len(layer.kind) for layer in trace.layers] + [4])  # whole class names (MultiheadAttention)
    lines.append(f"{'layer':<{width}}  {'type':<{kind_w}} {'norm':>10} {'mean|g|':>10} {'max|g|':>10} {'‖Δw‖/‖w‖':>10}  "
                 "flags")
    for li, layer in enumerate(trace.layers):
        kinds = ",".join(f.kind for f in by_layer.get(li, []))
        lines.append(f"{layer.name:<{width}}  {layer.kind:<{kind_w}} {fmt(table['norm'][li]):>10} "
                     f"{fmt(table['mean_abs'][li]):>10} {fmt(table['max_abs'][li]):>10} "
                     f"{fmt(table['update_ratio'][li]):>10}  {kinds}")
    for li, found in by_layer.items():
        for f in found:
            lines.append(f"  {f.kind}: {trace.layers[li].name}: {f.reason}")
    lines += [f"note: {n}" for n in trace.notes]
    return "\n".join(lines)


# -- static images ------------------------------------------------------------------------------
FLOW_H = 230


def flow_alt(trace: GradTrace, step: int, flags: tuple[Flag, ...]) -> str:
    """What the flow chart shows, in words (its alt text)."""
    table = layer_table(trace, step)
    mean = np.asarray(table["mean_abs"], dtype=float)
    ok = np.isfinite(mean) & (mean > 0)
    span = (f"mean |g| from {fmt(float(mean[ok].min()))} to {fmt(float(mean[ok].max()))}" if ok.any()
            else "no finite non-zero gradient")
    marked = flagged_layers(tuple(f for f in flags if f.step == step))
    flagged = "; flagged: " + ", ".join(f"#{li} {trace.layers[li].name} ({', '.join(f.kind for f in fs)})"
                                        for li, fs in sorted(marked.items())) if marked else ""
    return f"gradient flow: mean and max |gradient| of {len(trace.layers)} layers, log scale; {span}{flagged}"


def flow_width(trace: GradTrace) -> int:
    return max(360, min(900, 90 + 22 * len(trace.layers)))


def flow_png(trace: GradTrace, step: int, flags: tuple[Flag, ...]) -> bytes:
    """Gradient flow: max |g| (light bar) and mean |g| (dark bar) per layer on a log scale."""
    from torch_nbdebug.render.figures import png

    return png(lambda fig: _draw_flow(fig, trace, step, flags), flow_width(trace), FLOW_H)


def _draw_flow(fig: Any, trace: GradTrace, step: int, flags: tuple[Flag, ...]) -> None:
    from torch_nbdebug.render.figures import log_axis

    table = layer_table(trace, step)
    mean, peak = np.asarray(table["mean_abs"], dtype=float), np.asarray(table["max_abs"], dtype=float)
    vals = np.concatenate([mean, peak])
    vals = vals[np.isfinite(vals) & (vals > 0)]
    lo, hi = (math.floor(math.log10(vals.min())), math.ceil(math.log10(vals.max()))) if len(vals) else (-8, 0)
    hi = max(hi, lo + 1)
    by_layer = flagged_layers(tuple(f for f in flags if f.step == step))
    n = len(trace.layers)
    ax = fig.add_axes((70 / flow_width(trace), 0.26, 1 - 85 / flow_width(trace), 0.66))
    xs = np.arange(n)
    colours = [FLAG_COLOURS[by_layer[i][0].kind] if i in by_layer else "#1f6feb" for i in range(n)]
    ax.bar(xs, np.where(np.isfinite(peak) & (peak > 0), peak, np.nan), width=0.8, color=colours, alpha=0.35,
           bottom=10.0 ** lo, label="max |g|")
    ax.bar(xs, np.where(np.isfinite(mean) & (mean > 0), mean, np.nan), width=0.8, color=colours,
           bottom=10.0 ** lo, label="mean |g|")
    log_axis(ax)  # plain tick numbers: no mathtext parser to build on the first picture
    ax.set_ylim(10.0 ** lo, 10.0 ** hi)
    for i in range(n):
        if not (np.isfinite(mean[i]) and np.isfinite(peak[i])):  # nothing to draw: say why, in red
            ax.axvspan(i - 0.4, i + 0.4, color="#cf222e", alpha=0.12)
            ax.text(i, 10.0 ** ((lo + hi) / 2), "NaN/Inf", rotation=90, ha="center", va="center", color="#cf222e",
                    fontsize=8)
        if i in by_layer:
            ax.annotate("!", (i, 10.0 ** lo), xytext=(0, -22), textcoords="offset points", ha="center",
                        color=colours[i], fontweight="bold", annotation_clip=False)
    every = 1 if n <= 40 else max(1, n // 20)
    ax.set_xticks(xs[::every], [str(i) for i in xs[::every]])
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_xlabel("layer # (from 0, as in the table)" + ("; ! = flagged" if by_layer else ""), labelpad=10 if by_layer else 4)
    ax.set_ylabel("|gradient| (log)")
    ax.grid(axis="y", color="#eaeef2", linewidth=0.8)
    ax.set_axisbelow(True)
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(loc="upper right", ncol=2, fontsize=7.5, bbox_to_anchor=(1, 1.14))


def heatmap_rgb(grid: np.ndarray, bad: Optional[np.ndarray] = None) -> tuple[np.ndarray, float, float]:
    """Layers × steps of log10 norm as RGB (viridis; white = no gradient, red = NaN/Inf) and its log range.

    More than a few hundred steps are averaged (in log space) into buckets. ``bad`` (same shape,
    bool) marks cells whose gradient had NaN/Inf: drawn red, not blank.
    """
    if grid.shape[1] > _HEAT_MAX_COLS:  # average log-norms over buckets of steps
        edges = np.linspace(0, grid.shape[1], _HEAT_MAX_COLS + 1).astype(int)
        buckets = list(zip(edges[:-1], edges[1:]))
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN bucket is fine: it stays blank
            grid = np.stack([np.nanmean(grid[:, a:b], axis=1) for a, b in buckets], axis=1)
        if bad is not None:
            bad = np.stack([bad[:, a:b].any(axis=1) for a, b in buckets], axis=1)
    with np.errstate(all="ignore"):
        logs = np.log10(np.where(grid > 0, grid, np.nan))
    finite = logs[np.isfinite(logs)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    t = np.clip((logs - lo) / max(hi - lo, 1e-12), 0, 1)
    rgb = _viridis(np.nan_to_num(t))
    rgb[~np.isfinite(logs)] = (255, 255, 255)
    rgb[np.isposinf(logs)] = (207, 34, 46)  # an infinite norm overflowed: as loud as NaN
    if bad is not None:
        rgb[bad] = (207, 34, 46)
    return rgb, lo, hi


def heatmap_png(grid: np.ndarray, bad: Optional[np.ndarray] = None) -> str:
    """Layers × steps of log10 norm as a base64 PNG, one pixel per cell (see :func:`heatmap_rgb`)."""
    return base64.b64encode(_png(heatmap_rgb(grid, bad)[0])).decode("ascii")


def heatmap_figure(trace: GradTrace, flags: tuple[Flag, ...] = ()) -> str:
    """The layers × steps heatmap as an ``<img>``: rows = layers, columns = steps, a colour bar."""
    from torch_nbdebug.render.figures import picture

    grid = norm_heatmap(trace)
    n_l, n_s = grid.shape
    bad = np.zeros(grid.shape, bool)
    for f in flags:
        if f.kind == "non-finite" and 0 <= f.layer < n_l and 0 <= f.step < n_s:
            bad[f.layer, f.step] = True
    rgb, lo, hi = heatmap_rgb(grid, bad)
    height = max(150, min(420, 70 + 14 * n_l))
    alt = (f"gradient norm heatmap: {n_l} layers (rows, #0 {trace.layers[0].name} at the top) by {n_s} steps "
           f"(columns {trace.steps[0]}…{trace.steps[-1]}); ‖g‖ from {fmt(10 ** lo)} to {fmt(10 ** hi)}, log colour"
           + ("; red = NaN/Inf" if bad.any() else ""))
    return picture(lambda fig: _draw_heatmap(fig, trace, rgb, lo, hi, height), 640, height, alt,
                   "tnd-figure tnd-heatmap")


def _draw_heatmap(fig: Any, trace: GradTrace, rgb: np.ndarray, lo: float, hi: float, height: int) -> None:
    from matplotlib.colors import ListedColormap, LogNorm
    from matplotlib.cm import ScalarMappable
    from matplotlib.ticker import NullFormatter

    ax = fig.add_axes((0.1, 48 / height, 0.7, 1 - 60 / height))
    n_l = rgb.shape[0]
    first, last = trace.steps[0], trace.steps[-1]
    ax.imshow(rgb, aspect="auto", interpolation="nearest", extent=(first - 0.5, last + 0.5, n_l - 0.5, -0.5))
    ax.set_xlabel("step")
    ax.set_ylabel("layer # (from 0)")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.xaxis.get_major_locator().set_params(integer=True)
    cax = fig.add_axes((0.83, 48 / height, 0.025, 1 - 60 / height))
    cmap = ListedColormap(_viridis(np.linspace(0, 1, 256)) / 255.0)
    bar = fig.colorbar(ScalarMappable(LogNorm(10 ** lo, 10 ** max(hi, lo + 1e-6)), cmap), cax=cax)
    bar.set_label("‖g‖ (log)")
    bar.ax.yaxis.set_minor_formatter(NullFormatter())  # 2e-1, 3e-1, ... would crowd the bar
    bar.set_ticks([10 ** lo, 10 ** hi], labels=[fmt(10 ** lo), fmt(10 ** hi)])  # the range, whatever its span


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


def hist_alt(name: str, hist: Histogram) -> str:
    counts = np.asarray(hist.counts, dtype=float)
    at = int(counts.argmax()) if counts.size else 0
    centre = hist.lo + (hist.hi - hist.lo) * (at + 0.5) / max(len(counts), 1)
    return (f"histogram of {name}.grad: {len(counts)} bins from {fmt(hist.lo)} to {fmt(hist.hi)}, "
            f"most values near {fmt(centre)}" + ("" if hist.exact else " (estimated from a sample)"))


def hist_figure(name: str, hist: Histogram, log: bool = False, width: int = 300, height: int = 130) -> str:
    """One parameter's gradient histogram as an ``<img>``: bars, where zero falls, both end values."""
    from torch_nbdebug.render.figures import picture

    return picture(lambda fig: _draw_hist(fig, hist, log), width, height, hist_alt(name, hist),
                   "tnd-figure tnd-hist")


def _draw_hist(fig: Any, hist: Histogram, log: bool) -> None:
    ax = fig.add_axes((0.04, 0.2, 0.92, 0.76))
    counts = np.asarray(hist.counts, dtype=float)
    edges = np.asarray(hist.edges)
    ax.bar(edges[:-1], np.log10(counts + 1) if log else counts, width=np.diff(edges), align="edge",
           color="#1f6feb", linewidth=0)
    if hist.lo < 0 < hist.hi:  # where zero falls: a gradient centred off zero is worth seeing
        ax.axvline(0, color="#57606a", linestyle=(0, (2, 2)), linewidth=0.8)
    ax.set_xlim(hist.lo, hist.hi if hist.hi > hist.lo else hist.lo + max(abs(hist.lo), 1.0) * 1e-3)
    ax.set_yticks([])
    ticks = [hist.lo, 0.0, hist.hi] if hist.lo < 0 < hist.hi else [hist.lo, hist.hi]
    ax.set_xticks(ticks, [fmt(t) for t in ticks])
    labels = ax.get_xticklabels()  # end labels inside the axis so they never collide or clip
    labels[0].set_horizontalalignment("left")
    labels[-1].set_horizontalalignment("right")
    ax.spines[["top", "right", "left"]].set_visible(False)


# -- static HTML -----------------------------------------------------------------------------------
FLOW_KEY = "per layer at this step: dark bar = mean |g|, light bar = max |g|, log scale; ! = flagged (see the table)"


def html(trace: GradTrace, flags: tuple[Flag, ...], layer: int = 0, step: int = -1) -> str:
    from torch_nbdebug.render.figures import img_tag

    step = step % len(trace.steps) if trace.steps else 0
    parts = ['<div class="tnd tnd-grads">', f"<h3>{esc(_title(trace, step))}</h3>"]
    if trace.steps:
        parts.append(f"<p><b>Gradient flow</b> {muted(FLOW_KEY)}</p><div>" + img_tag(flow_png(trace, step, flags), flow_alt(trace, step, flags), flow_width(trace),
                                         FLOW_H, "tnd-figure tnd-flow") + "</div>")
        if len(trace.steps) > 1:
            parts.append(_heatmap_block(trace, flags))
        parts.append(_layer_table_html(trace, flags, step, layer))
        parts.append(_layer_detail_html(trace, layer, step, flags))
    parts += [f"<p>{muted(esc(n))}</p>" for n in trace.notes]
    parts.append("</div>")
    return "".join(parts)


def _heatmap_block(trace: GradTrace, flags: tuple[Flag, ...] = ()) -> str:
    key = (f"(rows = layers in {esc(trace.order)} order, #0 <code>{esc(trace.layers[0].name)}</code> at the top; "
           "columns = steps; white = no gradient, red = NaN/Inf)")
    return f"<p><b>Gradient norm, layers × steps</b> {muted(key)}</p><div>{heatmap_figure(trace, flags)}</div>"


def _flag_text(f: Flag) -> str:
    return f'<b style="color:{FLAG_COLOURS[f.kind]}">{esc(f.kind)}</b>: {esc(f.reason)}'


def _layer_table_html(trace: GradTrace, flags: tuple[Flag, ...], step: int, current: int) -> str:
    table_ = layer_table(trace, step)
    by_layer = flagged_layers(tuple(f for f in flags if f.step == step))
    rows = []
    for li, layer in enumerate(trace.layers):
        name = f"<code>{esc(layer.name)}</code>" + (" ◀ <b>shown below</b>" if li == current else "")
        rows.append((str(li), name, esc(layer.kind), fmt(table_["norm"][li]), fmt(table_["mean_abs"][li]),
                     fmt(table_["max_abs"][li]), fmt(table_["update_ratio"][li]),
                     "<br>".join(_flag_text(f) for f in by_layer.get(li, []))))
    head = ["#", "layer", "type", "‖g‖", "mean |g|", "max |g|",
            '<abbr title="size of the last update relative to the weights">‖Δw‖/‖w‖</abbr>', "flags"]
    return _scrolls(table(head, rows, numeric=[0, 3, 4, 5, 6], cls="tnd-grads-layers"))


def _scrolls(html_: str) -> str:
    """A wide table scrolls in its own box (base.css), so the rest of the view stays in a narrow panel."""
    return f'<div class="scroll">{html_}</div>'


def _layer_detail_html(trace: GradTrace, layer: int, step: int, flags: tuple[Flag, ...] = ()) -> str:
    lg = trace.layer(layer, step)
    mine = [f for f in flags if f.step == step and f.layer == layer]
    parts = [f"<h3>Layer #{layer} ({layer + 1}/{len(trace.layers)}): <code>{esc(lg.name)}</code> "
             f"({esc(lg.info.kind)})</h3>"]
    parts += [f"<p>{_flag_text(f)}</p>" for f in mine]
    rows, hists = [], []
    for p in lg.params:
        approx = not p.exact
        cells = (fmt(p.norm), fmt(p.mean), fmt(p.std), fmt(p.max_abs), fmt_count(p.zeros, approx),
                 fmt_count(p.nan, approx), fmt_count(p.inf, approx), fmt(p.param_norm), fmt(p.update_ratio, approx))
        rows.append((f"<code>{esc(p.info.short)}</code>", f"<code>{esc(list(p.info.shape))}</code>", *cells))
        if p.hist is not None:
            hists.append(f'<div style="display:inline-block;margin-right:16px;vertical-align:top"><b><code>'
                         f'{esc(p.info.short)}</code>.grad values</b><br>{hist_figure(p.info.short, p.hist)}</div>')
    head = ["parameter", "shape", "‖g‖", "mean", "std", "max |g|", "zeros", "NaN", "Inf", "‖w‖", "‖Δw‖/‖w‖"]
    parts.append(_scrolls(table(head, rows, numeric=range(2, 11))))
    parts.append(f"<div>{''.join(hists)}</div>")  # side by side where styles apply, else one under the other
    if lg.activation:
        parts.append("<p>activations: " + esc(", ".join(f"{k} {fmt(v)}" for k, v in lg.activation.items())) + "</p>")
    return "".join(parts)


# -- widget ----------------------------------------------------------------------------------------
class GradsView(View):
    """The stepper: overview (flow plot, heatmap) plus per-layer detail; ``layer``/``step`` sync both ways."""

    _esm = esm_path("grads.js")
    _css = esm_path("base.css")  # the shared look, also in the live view
    meta = traitlets.Dict().tag(sync=True)
    # float32 bytes, float64 for those meta["wide"] names (see numbers)
    stats = traitlets.Bytes(b"").tag(sync=True)       # [S, P, F]
    flow = traitlets.Bytes(b"").tag(sync=True)        # [S, L, 4]: norm, mean|g|, max|g|, update ratio
    hist = traitlets.Bytes(b"").tag(sync=True)        # [H, P, B]
    hist_range = traitlets.Bytes(b"").tag(sync=True)  # [H, P, 2]
    acts = traitlets.Bytes(b"").tag(sync=True)        # [S, L, A]
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
    arrays_ = {"stats": trace.stats, "flow": flow, "hist": trace.hist, "hist_range": trace.hist_range}
    if trace.activations is not None:
        arrays_["acts"] = trace.activations
    packed = {key: numbers(a) for key, a in arrays_.items()}
    meta["wide"] = [key for key, (_, wide) in packed.items() if wide]
    return GradsView(meta=meta, **{key: data for key, (data, _) in packed.items()},
                     layer=layer, step=step % n_s if n_s else 0)


def numbers(a: np.ndarray) -> tuple[bytes, bool]:
    """``a`` as little-endian float32 bytes, or as float64 ones (and True) when float32 would turn one of
    its finite numbers into inf: a norm of float64 gradients past float32's 3.4e38 is shown as it is,
    as the text and HTML views show it. float32 otherwise: half the bytes in the saved notebook."""
    with np.errstate(over="ignore"):
        narrow = np.ascontiguousarray(a, dtype="<f4")
    if np.isinf(narrow).any() and (np.isinf(narrow) & np.isfinite(a)).any():  # one test in the common case
        return np.ascontiguousarray(a, dtype="<f8").tobytes(), True
    return narrow.tobytes(), False


__all__ = ["text", "html", "widget", "GradsView", "flow_png", "heatmap_png", "heatmap_figure", "hist_figure", "fmt",
           "FLAG_COLOURS"]
