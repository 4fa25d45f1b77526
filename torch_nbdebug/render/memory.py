"""Memory views: text, a static PNG timeline (for notebooks without a kernel) and zoomable widgets.

The widget holds the full-resolution series in the kernel; the browser asks for a sample range
(``x_range``) and receives a decimated window (``view``), so a million events stay responsive.
"""
from __future__ import annotations

import json
import math

import numpy as np
from typing import Any, Optional, Sequence

import traitlets

from torch_nbdebug.data.memory import CATEGORIES, CATEGORY_LABELS, Allocation, MemoryState, MemoryTimeline
from torch_nbdebug.process.memory import allocation_spans, decimate, leaks_first, window
from torch_nbdebug.render.html import bad, esc, muted, swatch, table
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
    """``In [7], line 3: loss = ...`` for notebook cells (``cell line 3`` when the cell's number is not
    known: IPython's temp file names mean nothing to users), else ``file.py:3: ...``."""
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
        alloc = tl.allocator
        lines.append(f"allocator at the end: reserved {fmt_bytes(alloc.get('reserved'))} in {alloc.get('segments', 0)} "
                     f"segment(s), allocated {fmt_bytes(alloc.get('allocated'))}; fragmentation: "
                     f"{fmt_bytes(alloc.get('free_in_used_segments'))} free inside segments in use, "
                     f"largest free block {fmt_bytes(alloc.get('largest_free_block'))}")
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


# -- static picture / HTML --------------------------------------------------------------------------
def timeline_alt(tl: MemoryTimeline) -> str:
    """What the timeline picture shows, in words (its alt text)."""
    if not len(tl.steps):
        return "memory timeline: no events recorded"
    at_peak = {c: tl.category_totals.get(c, {}).get("peak", 0) for c in CATEGORIES}
    top = max(at_peak, key=lambda c: at_peak[c])
    return (f"memory timeline: memory allocated by category over {len(tl.steps)} allocation/free events "
            f"({tl.iterations} iteration(s)); peak {fmt_bytes(tl.peak_bytes)} at event {tl.peak_step}, "
            f"mostly {CATEGORY_LABELS[top]} ({fmt_bytes(at_peak[top])})")


def timeline_png(tl: MemoryTimeline, max_points: int = STATIC_POINTS) -> bytes:
    """Stacked categories over events, shaded phases, iteration starts, reserved line, the peak marked."""
    from torch_nbdebug.render.figures import png

    return png(lambda fig: _draw_timeline(fig, tl, max_points), W, H + 40)


def timeline_figure(tl: MemoryTimeline, max_points: int = STATIC_POINTS) -> str:
    """The timeline as an ``<img>`` (kept by the sanitizers of untrusted notebooks)."""
    from torch_nbdebug.render.figures import img_tag

    return img_tag(timeline_png(tl, max_points), timeline_alt(tl), W, H + 40, "tnd-figure tnd-memory-figure")


def _draw_timeline(fig: Any, tl: MemoryTimeline, max_points: int) -> None:
    ax = fig.add_axes((LEFT / W, 0.37, 1 - (LEFT + RIGHT) / W, 0.56))  # the legend below the axis label
    n = len(tl.steps)
    if n == 0:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no events recorded", ha="center", va="center", transform=ax.transAxes)
        return
    reserved = tl.reserved if tl.reserved is not None and len(tl.reserved) > 0 else None
    ymax = float(max(tl.peak_bytes, int(reserved.max()) if reserved is not None else 0, 1)) * 1.08
    idx = decimate(tl.totals, max_points)
    shown = [c for i, c in enumerate(CATEGORIES) if tl.by_category[:, i].any()]
    for phase, colour in PHASE_COLORS.items():  # one collection per phase: thousands of runs stay cheap
        runs = [(p.start - 1, p.end - p.start + 1) for p in tl.phases if p.phase == phase]
        if runs:
            ax.broken_barh(runs, (0, ymax), facecolors=colour, label=f"{phase} (shading)", antialiased=False)
    lower = np.zeros(len(idx))
    for c in shown:  # memory holds between events: steps, with crisp edges (a PNG of few colours)
        upper = lower + tl.by_category[idx, CATEGORIES.index(c)]
        ax.fill_between(tl.steps[idx], lower, upper, step="post", color=COLORS[c], linewidth=0, antialiased=False,
                        label=CATEGORY_LABELS[c])
        lower = upper
    starts = [p.start - 1 for k, p in enumerate(tl.phases) if k and p.iteration != tl.phases[k - 1].iteration]
    if starts:
        ax.vlines(starts, 0, ymax, colors="#57606a", linestyles=(0, (2, 3)), linewidth=0.8, label="iteration start")
    if reserved is not None:
        ax.plot(tl.steps[idx], reserved[idx], color="#24292f", linestyle=(0, (4, 2)), linewidth=1,
                label="reserved (allocator cache)")
    ax.axvline(tl.peak_step, color="#cf222e", linewidth=1.2)
    ax.plot([tl.peak_step], [tl.peak_bytes], "o", color="#cf222e", markersize=4, label="peak")
    ax.annotate(f"peak {fmt_bytes(tl.peak_bytes)}", (tl.peak_step, ymax), xytext=(4, 2), textcoords="offset points",
                color="#cf222e", fontweight="bold", ha="left" if tl.peak_step < 0.8 * n else "right", va="bottom")
    ax.set_xlim(0, max(n - 1, 1))
    ax.set_ylim(0, ymax)
    ticks = nice_ticks(ymax / 1.08)
    ax.set_yticks(ticks, [fmt_bytes(b).replace(".0 ", " ") for b in ticks])
    ax.set_xlabel("allocation/free events, in order")
    ax.set_ylabel("memory allocated")
    ax.spines[["top", "right"]].set_visible(False)
    found = dict(zip(*reversed(ax.get_legend_handles_labels())))  # label -> handle
    first = [CATEGORY_LABELS[c] for c in shown]  # categories first, then phases and marks
    labels = first + [label for label in found if label not in first]
    fig.legend([found[label] for label in labels], labels, loc="lower center", ncol=5, fontsize=7.5, handlelength=1.4, columnspacing=1.0)


def _alloc_rows(allocs: Sequence[Allocation], leaks: Sequence[Any] = ()) -> str:
    if not allocs:
        return f"<p>{muted('no allocation was alive at the peak')}</p>"
    leaked = {i for leak in leaks for i in leak.allocation_ids}
    rows = [(esc(fmt_bytes(a.nbytes)), f"<code>{esc(_shape(a))}</code>", _category(a.category),
             (f"<code>{esc(a.holder)}</code>" if a.holder else "") + (f" {bad('leak')}" if a.id in leaked else ""),
             f"<code>{esc(a.module)}</code>" if a.module else "",
             f"<code>{esc(_where(a))}</code>" if _where(a) else "") for a in allocs]
    return table(["size", "tensor", "category", "held by", "module", "allocated at"], rows, numeric=[0])


def _category(category: str) -> str:
    return swatch(COLORS[category]) + esc(CATEGORY_LABELS[category])


def _leak_card(leak: Any) -> str:
    graph = f" — {bad('autograd graph attached')}" if leak.has_graph else ""
    return (f'<blockquote class="tnd-leak">{bad("Leak:")} <b><code>{esc(leak.holder)}</code></b> holds '
            f'{leak.count:,} tensor(s), {esc(fmt_bytes(leak.nbytes))}{graph}<br>{muted(esc(", ".join(leak.names)))}'
            + (f"<br>allocated at <code>{esc(where(leak.line))}</code>" if leak.line else "")
            + (f"<br>{esc(leak.note)}" if leak.note else "") + "</blockquote>")


def timeline_html(tl: MemoryTimeline) -> str:
    head = esc(timeline_text(tl).splitlines()[0])
    note = f"<p>{bad('Note:')} {esc(tl.note)}</p>" if tl.note else ""
    totals = [[_category(c)] + [esc(fmt_bytes(tl.category_totals.get(c, {}).get(k, 0)))
                                for k in ("start", "peak", "max", "final")] for c in CATEGORIES]
    leaks = "".join(_leak_card(leak) for leak in tl.leaks)
    return (f'<div class="tnd tnd-memory-static"><h3>{head}</h3>{note}{leaks}<div>{timeline_figure(tl)}</div>'
            f"<h3>Memory by category</h3>{table(['category', 'start', 'at peak', 'max', 'end'], totals, numeric=[1, 2, 3, 4])}"
            f'<h3>Largest allocations alive at the peak</h3>{_alloc_rows(leaks_first(tl.peak_allocations, tl.leaks), tl.leaks)}</div>')


def state_alt(st: MemoryState) -> str:
    parts = ", ".join(f"{CATEGORY_LABELS[c]} {fmt_bytes(v)}" for c, v in st.by_category.items() if v)
    return f"memory now by category, {fmt_bytes(st.live_bytes)} in all: {parts or 'nothing live'}"


def _draw_state(fig: Any, st: MemoryState) -> None:
    ax = fig.add_axes((0.01, 0.45, 0.98, 0.5))
    total, left = max(st.live_bytes, 1), 0.0
    for c, v in st.by_category.items():
        if v:
            ax.barh(0, v / total, left=left, color=COLORS[c], edgecolor="white", linewidth=0.5,
                    label=f"{CATEGORY_LABELS[c]} {fmt_bytes(v)}")
            left += v / total
    ax.set_xlim(0, 1)
    ax.set_axis_off()
    fig.legend(loc="lower center", ncol=3, fontsize=7.5, handlelength=1.2, columnspacing=1.0)


def state_html(st: MemoryState) -> str:
    from torch_nbdebug.render.figures import picture

    total = max(st.live_bytes, 1)
    shares = [(_category(c), esc(fmt_bytes(v)), f"{100 * v / total:.1f}%") for c, v in st.by_category.items() if v]
    rows = [(esc(fmt_bytes(t.nbytes)), f"<code>{esc(_shape(t))}</code>", _category(t.category), f"<code>{esc(t.name)}</code>",
             bad("yes") if t.has_graph else "") for t in st.top]
    note = f"<p>{bad('Note:')} {esc(st.note)}</p>" if st.note else ""
    top = (f"<h3>Largest live tensors</h3>{table(['size', 'tensor', 'category', 'held by', 'autograd graph'], rows, numeric=[0])}"
           if rows else f"<p>{muted('no live tensors found')}</p>")
    bar = picture(lambda fig: _draw_state(fig, st), 600, 70, state_alt(st), "tnd-figure tnd-memory-bar") if shares else ""
    return (f'<div class="tnd tnd-memory-static"><h3>{esc(state_text(st).splitlines()[0])}</h3>{note}<div>{bar}</div>'
            f"{table(['category', 'size', 'share'], shares, numeric=[1, 2])}{top}</div>")


# -- widgets -------------------------------------------------------------------------------------
def _meta(tl: MemoryTimeline) -> dict[str, Any]:
    return {"kind": "timeline", "n": int(len(tl.steps)), "device": tl.device, "note": tl.note,
            "title": timeline_text(tl).splitlines()[0],
            "categories": list(CATEGORIES), "labels": [CATEGORY_LABELS[c] for c in CATEGORIES],
            "colors": [COLORS[c] for c in CATEGORIES], "phase_colors": PHASE_COLORS,
            "peak": {"step": tl.peak_step, "bytes": tl.peak_bytes},  # its allocations: the view's local peak
            "ymax": int(max(tl.peak_bytes, int(tl.reserved.max()) if tl.reserved is not None and len(tl.reserved) else 0, 1)),
            "leaks": [leak.to_dict() for leak in tl.leaks]}


# Fields of an allocation the widget shows (not its address, device or graph flag).
_SHOWN = ("id", "nbytes", "dtype", "shape", "category", "holder", "module", "op", "phase", "start", "end", "line")


def deltas(values: Any) -> str:
    """Integers as their differences, comma-separated, a run of ``n`` equal differences as ``d*n``
    (memory.js's ``ints`` reads it back). Memory changes in one category per event: a step-shaped
    series of thousands of events is a few hundred characters, not one JSON line per number (saved
    notebooks indent every list item)."""
    diffs = np.diff(np.asarray(values, dtype=np.int64), prepend=np.int64(0))
    if not len(diffs):
        return ""
    cuts = np.flatnonzero(diffs[1:] != diffs[:-1]) + 1
    starts, ends = np.r_[0, cuts], np.r_[cuts, len(diffs)]
    return ",".join(f"{diffs[a]}*{b - a}" if b - a > 1 else f"{diffs[a]}" for a, b in zip(starts.tolist(), ends.tolist()))


def packed_window(tl: MemoryTimeline, lo: int, hi: int, max_points: int, spans: Any) -> dict[str, Any]:
    """:func:`process.memory.window` as the widget receives it: each series as :func:`deltas` (times in
    microseconds, ``time_us``, to the 0.1 ms the widget prints), the phases and the local peak's
    allocations (with the fields the widget shows) as JSON texts."""
    view = window(tl, lo, hi, max_points, spans=spans)
    peak = view["local_peak"]
    allocations = [{k: a[k] for k in _SHOWN} for a in peak["allocations"]]
    seconds = view.pop("time_s")  # to the 0.1 ms the widget prints
    return {**view, "steps": deltas(view["steps"]), "time_us": deltas(np.round(np.asarray(seconds) * 1e4) * 100),
            "series": [deltas(column) for column in view["series"]],
            "reserved": None if view["reserved"] is None else deltas(view["reserved"]),
            "phases": _json(view["phases"]), "local_peak": {**peak, "allocations": _json(allocations)}}


def _json(rows: Any) -> str:
    """Rows of records as one compact JSON text (memory.js parses it): a saved notebook indents every
    key of a record on a line of its own, a text is one line."""
    return json.dumps(rows, separators=(",", ":"))


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
        self.view = packed_window(tl, 0, max(n - 1, 0), max_points, self._spans) if n else {}

    @traitlets.observe("x_range")
    def _zoom(self, change: dict[str, Any]) -> None:
        if len(self._timeline.steps) and len(change["new"]) == 2:
            lo, hi = change["new"]
            self.view = packed_window(self._timeline, lo, hi, self._max_points, self._spans)


class StateView(View):
    """Memory now: a stacked bar by category and the largest tensors, filterable by name."""

    _esm = esm_path("memory.js")
    _css = esm_path("base.css")
    meta = traitlets.Dict().tag(sync=True)

    def __init__(self, st: MemoryState, **kwargs: Any) -> None:
        super().__init__(meta={"kind": "state", "title": state_text(st).splitlines()[0], "note": st.note,
                               "categories": list(CATEGORIES), "labels": [CATEGORY_LABELS[c] for c in CATEGORIES],
                               "colors": [COLORS[c] for c in CATEGORIES], "state": st.to_dict()}, **kwargs)
