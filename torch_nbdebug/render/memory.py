"""Memory views: text, a static SVG timeline (for notebooks without a kernel) and zoomable widgets.

The widget holds the full-resolution series in the kernel; the browser asks for a sample range
(``x_range``) and receives a decimated window (``view``), so a million events stay responsive.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np
import traitlets

from torch_nbdebug.data.memory import CATEGORIES, CATEGORY_LABELS, Allocation, MemoryState, MemoryTimeline
from torch_nbdebug.process.memory import allocation_spans, decimate, window
from torch_nbdebug.render.html import esc, stylesheet
from torch_nbdebug.render.widget import View, esm_path

COLORS = {"parameters": "#4e79a7", "gradients": "#f28e2b", "optimizer_state": "#59a14f",
          "activations": "#e15759", "temporaries": "#edc948", "other": "#bab0ac"}
PHASE_COLORS = {"forward": "#dbeafe", "backward": "#fde7d3", "optimizer": "#dcfce7"}
W, H, LEFT, RIGHT, TOP, BOTTOM = 760, 250, 78, 12, 18, 32
STATIC_POINTS = 600


def fmt_bytes(n: Optional[float]) -> str:
    """``1536`` -> ``1.5 KiB`` (binary units, as PyTorch's own tools print)."""
    if n is None:
        return "-"
    value, sign = abs(float(n)), "-" if n < 0 else ""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{sign}{value:.0f} {unit}" if unit == "B" else f"{sign}{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"  # pragma: no cover


def nice_ticks(top: float, count: int = 4) -> list[float]:
    """Round byte values for the y axis: 0, 64 KiB, 128 KiB, ... (1/2/2.5/5 × a power of ten, per unit)."""
    if top <= 0:
        return [0.0]
    unit = 1024.0 ** min(3, max(0, int(math.log(max(top, 1), 1024))))
    raw = top / unit / count
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw) * unit
    return [k * step for k in range(int(top // step) + 1)]


def _shape(a: Any) -> str:
    return f"{a.dtype}[{', '.join(str(s) for s in a.shape)}]" if a.dtype else "(allocator block)"


def _where(a: Any) -> str:
    return where(a.line) if a.line is not None else ""


def where(line: Any) -> str:
    """``cell line 3: loss = ...`` for notebook cells (IPython's temp file names mean nothing to users)."""
    if "ipykernel_" in line.filename or line.filename.startswith("<ipython-input"):
        return f"cell line {line.lineno}: {line.text}" if line.text else f"cell line {line.lineno}"
    return str(line)


# -- text ----------------------------------------------------------------------------------------
def timeline_text(tl: MemoryTimeline) -> str:
    lines = [f"memory timeline ({tl.device}): peak {fmt_bytes(tl.peak_bytes)} at event {tl.peak_step} of "
             f"{max(len(tl.steps) - 1, 0)}; start {fmt_bytes(tl.start_bytes)}, end {fmt_bytes(tl.final_bytes)}; "
             f"{tl.iterations} iteration(s), {tl.duration_s:.3g} s"]
    if tl.note:
        lines.append(tl.note)
    if tl.reserved is not None and len(tl.reserved):
        frag = int(tl.reserved[tl.peak_step]) - tl.peak_bytes
        lines.append(f"reserved at peak {fmt_bytes(int(tl.reserved[tl.peak_step]))} "
                     f"({fmt_bytes(frag)} cached/fragmented), max reserved {fmt_bytes(int(tl.reserved.max()))}")
    if tl.allocator:
        a = tl.allocator
        lines.append(f"allocator at the end: reserved {fmt_bytes(a.get('reserved'))} in {a.get('segments', 0)} "
                     f"segment(s), allocated {fmt_bytes(a.get('allocated'))}; fragmentation: "
                     f"{fmt_bytes(a.get('free_in_used_segments'))} free inside segments in use, "
                     f"largest free block {fmt_bytes(a.get('largest_free_block'))}")
    lines.append(f"  {'category':<32}{'start':>11}{'at peak':>11}{'max':>11}{'end':>11}")
    for c in CATEGORIES:
        t = tl.category_totals.get(c, {})
        lines.append(f"  {CATEGORY_LABELS[c]:<32}" + "".join(f"{fmt_bytes(t.get(k, 0)):>11}"
                                                          for k in ("start", "peak", "max", "final")))
    if tl.peak_allocations:
        lines.append("largest allocations alive at the peak:")
        for a in tl.peak_allocations:
            origin = " ".join(x for x in (a.holder, f"in {a.module}" if a.module else "", _where(a)) if x)
            lines.append(f"  {fmt_bytes(a.nbytes):>10}  {_shape(a):<22} {CATEGORY_LABELS[a.category]:<16} {origin}".rstrip())
    for leak in tl.leaks:
        graph = ", autograd graph attached" if leak.has_graph else ""
        lines.append(f"leak: {leak.holder} holds {leak.count} tensor(s), {fmt_bytes(leak.nbytes)}{graph}"
                     + (f"; allocated at {where(leak.line)}" if leak.line else ""))
        if leak.note:
            lines.append(f"      {leak.note}")
    return "\n".join(lines)


def state_text(st: MemoryState) -> str:
    head = f"memory now ({st.device}): {fmt_bytes(st.live_bytes)} in {st.tensor_count} live tensor storage(s)"
    if st.allocated is not None:
        head += (f"; allocator: allocated {fmt_bytes(st.allocated)}, reserved {fmt_bytes(st.reserved)}, "
                 f"peak {fmt_bytes(st.peak)}")
    lines = [head] + ([st.note] if st.note else [])
    lines += [f"  {CATEGORY_LABELS[c]:<32}{fmt_bytes(st.by_category.get(c, 0)):>11}" for c in CATEGORIES]
    if st.top:
        lines.append("largest live tensors:")
        lines += [f"  {fmt_bytes(t.nbytes):>10}  {_shape(t):<22} {CATEGORY_LABELS[t.category]:<16} {t.name}"
                  + (" (graph attached)" if t.has_graph else "") for t in st.top]
    return "\n".join(lines)


# -- static SVG / HTML -----------------------------------------------------------------------------
def timeline_svg(tl: MemoryTimeline, max_points: int = STATIC_POINTS) -> str:
    """A self-contained SVG: stacked categories, shaded phases, iteration ticks, the peak marked."""
    n = len(tl.steps)
    if n == 0:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="40"><text x="8" y="24">no events recorded</text></svg>'
    idx = decimate(tl.totals, max_points)
    ymax = float(max(tl.peak_bytes, int(tl.reserved.max()) if tl.reserved is not None and len(tl.reserved) else 0, 1)) * 1.08
    sx = lambda s: LEFT + (W - LEFT - RIGHT) * (s / max(n - 1, 1))  # noqa: E731
    sy = lambda b: TOP + (H - TOP - BOTTOM) * (1 - b / ymax)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="tnd-memory" style="background:#fff" width="{W}" height="{H}" '
             f'viewBox="0 0 {W} {H}" font-size="10" font-family="sans-serif">']
    rects, ticks = _phase_rects(tl, sx)
    parts += rects
    parts += _stack_polygons(tl.by_category[idx], tl.steps[idx], sx, sy)
    parts += ticks  # iteration boundaries over the areas, so they stay visible
    if tl.reserved is not None and len(tl.reserved):
        pts = " ".join(f"{sx(s):.1f},{sy(r):.1f}" for s, r in zip(tl.steps[idx], tl.reserved[idx]))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="#24292f" stroke-dasharray="4 2"><title>reserved by the '
                     f'caching allocator</title></polyline>')
    parts += _axes(n, ymax, sx, sy)
    px, py = sx(tl.peak_step), sy(tl.peak_bytes)
    parts.append(f'<line x1="{px:.1f}" x2="{px:.1f}" y1="{TOP}" y2="{H - BOTTOM}" stroke="#cf222e" stroke-width="1.2"/>'
                 f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3.5" fill="#cf222e"/>'
                 f'<text x="{min(px + 4, W - 120):.1f}" y="{TOP - 5}" fill="#cf222e" font-weight="600">'
                 f'peak {esc(fmt_bytes(tl.peak_bytes))}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _phase_rects(tl: MemoryTimeline, sx: Any) -> tuple[list[str], list[str]]:
    out, ticks, last_iter, last_px = [], [], 0, -1.0
    for p in tl.phases[:3000]:
        x0, x1 = sx(p.start - 1), sx(p.end)
        if p.iteration != last_iter and p.iteration > 1:
            ticks.append(f'<line x1="{x0:.1f}" x2="{x0:.1f}" y1="{TOP}" y2="{H - BOTTOM}" stroke="#57606a" '
                       f'stroke-dasharray="2 3"><title>iteration {p.iteration}</title></line>')
        last_iter = p.iteration
        if x1 - x0 < 0.3 and x0 - last_px < 0.3:
            continue  # sub-pixel runs merge visually; skipping keeps the SVG small
        last_px = x1
        out.append(f'<rect x="{x0:.1f}" y="{TOP}" width="{max(x1 - x0, 0.3):.1f}" height="{H - TOP - BOTTOM}" '
                   f'fill="{PHASE_COLORS.get(p.phase, "#eee")}"><title>{esc(p.phase)} (iteration {p.iteration})</title></rect>')
    return out, ticks


def _stack_polygons(by_cat: np.ndarray, steps: np.ndarray, sx: Any, sy: Any) -> list[str]:
    out = []
    upper = np.cumsum(by_cat, axis=1)
    xs = [f"{sx(s):.1f}" for s in steps]
    for c, name in enumerate(CATEGORIES):
        if not by_cat[:, c].any():
            continue
        lower = upper[:, c - 1] if c else np.zeros(len(steps))
        top = " ".join(f"{x},{sy(v):.1f}" for x, v in zip(xs, upper[:, c]))
        bottom = " ".join(f"{x},{sy(v):.1f}" for x, v in zip(reversed(xs), lower[::-1]))
        out.append(f'<polygon points="{top} {bottom}" fill="{COLORS[name]}" fill-opacity="0.85">'
                   f'<title>{esc(CATEGORY_LABELS[name])}</title></polygon>')
    return out


def _axes(n: int, ymax: float, sx: Any, sy: Any) -> list[str]:
    out = [f'<line x1="{LEFT}" x2="{W - RIGHT}" y1="{H - BOTTOM}" y2="{H - BOTTOM}" stroke="#57606a"/>',
           f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{H - BOTTOM}" stroke="#57606a"/>']
    for b in nice_ticks(ymax / 1.08):
        out.append(f'<line x1="{LEFT - 3}" x2="{LEFT}" y1="{sy(b):.1f}" y2="{sy(b):.1f}" stroke="#57606a"/>'
                   f'<text x="{LEFT - 5}" y="{sy(b) + 3:.1f}" text-anchor="end" fill="#57606a">'
                   f'{esc(fmt_bytes(b).replace(".0 ", " "))}</text>')
    for k in range(5):
        s = round((n - 1) * k / 4)
        out.append(f'<text x="{sx(s):.1f}" y="{H - BOTTOM + 12}" text-anchor="middle" fill="#57606a">{s}</text>')
    mid = (TOP + H - BOTTOM) / 2
    out.append(f'<text x="11" y="{mid:.0f}" text-anchor="middle" fill="#57606a" transform="rotate(-90 11 {mid:.0f})">'
               f'memory allocated</text>'
               f'<text x="{(LEFT + W - RIGHT) / 2:.0f}" y="{H - 4}" text-anchor="middle" fill="#57606a">'
               f'allocation/free events, in order (dashed lines: iteration starts)</text>')
    return out


def legend_html(timeline: bool = True, reserved: bool = False) -> str:
    """Category swatches; for a timeline also the phase shading, iteration/peak marks and the reserved line."""
    cats = "".join(f'<span><span class="swatch" style="background:{COLORS[c]}"></span>{esc(CATEGORY_LABELS[c])}</span>'
                   for c in CATEGORIES)
    if not timeline:
        return f'<div class="legend muted">{cats}</div>'
    phases = "".join(f'<span><span class="swatch" style="background:{col}"></span>{p} (shading)</span>'
                     for p, col in PHASE_COLORS.items())
    marks = ('<span>┆ iteration start</span><span><span style="color:#cf222e">│</span> peak</span>'
             + ('<span>╌ reserved (allocator cache)</span>' if reserved else ""))
    return f'<div class="legend muted">{cats}<br>{phases}{marks}</div>'


def _alloc_rows(allocs: Sequence[Allocation]) -> str:
    rows = "".join(f"<tr><td class='num'>{esc(fmt_bytes(a.nbytes))}</td><td class='mono nowrap'>{esc(_shape(a))}</td>"
                   f"<td class='nowrap'>{_swatch(a.category)}{esc(CATEGORY_LABELS[a.category])}</td>"
                   f"<td class='mono'>{esc(a.holder or '')}</td><td class='mono'>{esc(a.module or '')}</td>"
                   f"<td class='mono src' title='{esc(_where(a))}'>{esc(_where(a))}</td></tr>" for a in allocs)
    if not rows:
        return '<div class="muted">no allocation was alive at the peak</div>'
    return ("<table><tr><th class='num'>size</th><th>tensor</th><th>category</th><th>held by</th><th>module</th>"
            f"<th>allocated at</th></tr>{rows}</table>")


def _swatch(category: str) -> str:
    return f'<span class="swatch" style="background:{COLORS[category]}"></span>'


def _leak_card(leak: Any) -> str:
    graph = " — <span class='bad'>autograd graph attached</span>" if leak.has_graph else ""
    return (f'<div class="card"><b>Leak:</b> <b class="mono">{esc(leak.holder)}</b> holds {leak.count:,} tensor(s), '
            f'{esc(fmt_bytes(leak.nbytes))}{graph}<div class="muted mono">{esc(", ".join(leak.names))}</div>'
            + (f"<div class='mono src'>allocated at {esc(where(leak.line))}</div>" if leak.line else "")
            + (f"<div>{esc(leak.note)}</div>" if leak.note else "") + "</div>")


def timeline_html(tl: MemoryTimeline) -> str:
    head = esc(timeline_text(tl).splitlines()[0])
    note = f'<div class="warn">{esc(tl.note)}</div>' if tl.note else ""
    totals = "".join(f"<tr><td class='nowrap'>{_swatch(c)}{esc(CATEGORY_LABELS[c])}</td>" + "".join(
        f"<td class='num'>{esc(fmt_bytes(tl.category_totals.get(c, {}).get(k, 0)))}</td>" for k in ("start", "peak", "max", "final"))
        + "</tr>" for c in CATEGORIES)
    leaks = "".join(_leak_card(leak) for leak in tl.leaks)
    reserved = tl.reserved is not None and len(tl.reserved) > 0
    return (f'{stylesheet()}<div class="tnd tnd-memory-static"><h3>{head}</h3>{note}{leaks}'
            f'<div style="overflow-x:auto">{timeline_svg(tl)}</div>{legend_html(reserved=reserved)}'
            f"<h3>Memory by category</h3><table><tr><th>category</th><th class='num'>start</th><th class='num'>at peak</th>"
            f"<th class='num'>max</th><th class='num'>end</th></tr>{totals}</table>"
            f'<h3>Largest allocations alive at the peak</h3>{_alloc_rows(tl.peak_allocations)}</div>')


def state_html(st: MemoryState) -> str:
    total = max(st.live_bytes, 1)
    bar = "".join(f'<div title="{esc(CATEGORY_LABELS[c])}: {esc(fmt_bytes(v))}" style="width:{100 * v / total:.2f}%;'
                  f'background:{COLORS[c]}"></div>' for c, v in st.by_category.items() if v)
    shares = "".join(f"<tr><td class='nowrap'>{_swatch(c)}{esc(CATEGORY_LABELS[c])}</td><td class='num'>{esc(fmt_bytes(v))}</td>"
                     f"<td class='num'>{100 * v / total:.1f}%</td></tr>" for c, v in st.by_category.items() if v)
    rows = "".join(f"<tr><td class='num'>{esc(fmt_bytes(t.nbytes))}</td><td class='mono nowrap'>{esc(_shape(t))}</td>"
                   f"<td class='nowrap'>{_swatch(t.category)}{esc(CATEGORY_LABELS[t.category])}</td><td class='mono'>{esc(t.name)}</td>"
                   f"<td>{'<span class=bad>yes</span>' if t.has_graph else ''}</td></tr>" for t in st.top)
    note = f'<div class="warn">{esc(st.note)}</div>' if st.note else ""
    table = (f"<h3>Largest live tensors</h3><table><tr><th class='num'>size</th><th>tensor</th><th>category</th>"
             f"<th>held by</th><th>autograd graph</th></tr>{rows}</table>" if rows else
             '<div class="muted">no live tensors found</div>')
    return (f'{stylesheet()}<div class="tnd tnd-memory-static"><h3>{esc(state_text(st).splitlines()[0])}</h3>{note}'
            f'<div style="display:flex;height:16px;max-width:600px;border:1px solid #d0d7de;margin:4px 0">{bar}</div>'
            f"<table><tr><th>category</th><th class='num'>size</th><th class='num'>share</th></tr>{shares}</table>"
            f"{table}</div>")


# -- widgets -------------------------------------------------------------------------------------
def _meta(tl: MemoryTimeline) -> dict[str, Any]:
    return {"kind": "timeline", "n": int(len(tl.steps)), "device": tl.device, "note": tl.note,
            "title": timeline_text(tl).splitlines()[0],
            "categories": list(CATEGORIES), "labels": [CATEGORY_LABELS[c] for c in CATEGORIES],
            "colors": [COLORS[c] for c in CATEGORIES], "phase_colors": PHASE_COLORS,
            "peak": {"step": tl.peak_step, "bytes": tl.peak_bytes,
                     "allocations": [a.to_dict() for a in tl.peak_allocations]},
            "ymax": int(max(tl.peak_bytes, int(tl.reserved.max()) if tl.reserved is not None and len(tl.reserved) else 0, 1)),
            "leaks": [leak.to_dict() for leak in tl.leaks]}


class TimelineView(View):
    """Zoomable timeline: the browser sets ``x_range``; the kernel answers with a decimated ``view``."""

    _esm = esm_path("memory.js")
    _css = esm_path("base.css")  # the shared look, also in the live view
    meta = traitlets.Dict().tag(sync=True)
    view = traitlets.Dict().tag(sync=True)
    x_range = traitlets.List(traitlets.Int(), default_value=[0, 0]).tag(sync=True)

    def __init__(self, tl: MemoryTimeline, max_points: int = 1200, **kwargs: Any) -> None:
        self._timeline = tl
        self._max_points = max_points
        self._spans = allocation_spans(tl.allocations)  # numbers only: no tensors are kept
        n = len(tl.steps)
        super().__init__(meta=_meta(tl), x_range=[0, max(n - 1, 0)], **kwargs)
        self.view = window(tl, 0, max(n - 1, 0), max_points, spans=self._spans) if n else {}

    @traitlets.observe("x_range")
    def _zoom(self, change: dict[str, Any]) -> None:
        if len(self._timeline.steps) and len(change["new"]) == 2:
            lo, hi = change["new"]
            self.view = window(self._timeline, lo, hi, self._max_points, spans=self._spans)


class StateView(View):
    """Memory now: a stacked bar by category and the largest tensors, filterable by name."""

    _esm = esm_path("memory.js")
    _css = esm_path("base.css")
    meta = traitlets.Dict().tag(sync=True)

    def __init__(self, st: MemoryState, **kwargs: Any) -> None:
        super().__init__(meta={"kind": "state", "title": state_text(st).splitlines()[0], "note": st.note,
                               "categories": list(CATEGORIES), "labels": [CATEGORY_LABELS[c] for c in CATEGORIES],
                               "colors": [COLORS[c] for c in CATEGORIES], "state": st.to_dict()}, **kwargs)
