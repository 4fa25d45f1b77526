"""%%profile views: text, a static figure in plain HTML, and the widget (``static/profile.js``).

The static view survives notebook sanitizers: the verdict and the tables as semantic HTML, the
figure (a stacked bar per step, and the timeline of the median step) as an ``<img>`` PNG.
"""
from __future__ import annotations

from typing import Any, Optional

import traitlets

from torch_nbdebug.data.profile import (CATEGORIES, CATEGORY_COLOURS, CATEGORY_LABELS, Comparison, LineRow,
                                        ProfileData)
from torch_nbdebug.render.figures import picture
from torch_nbdebug.render.html import esc, muted, swatch, table
from torch_nbdebug.render.widget import View, esm_path

TEXT_ROWS = 5      # lines, modules and ops listed in the text view
HTML_ROWS = 10     # and in the static HTML


def fmt_ms(ms: Optional[float]) -> str:
    if ms is None:
        return "-"
    if ms >= 100:
        return f"{ms:.0f} ms"
    if ms >= 1:
        return f"{ms:.1f} ms"
    return f"{ms * 1000:.0f} µs"


def title(data: ProfileData) -> str:
    n = len(data.steps)
    what = {"optimizer": "optimizer step", "dataloader": "DataLoader batch", "cell": "cell run"}[data.step_source]
    if data.step_source == "cell":
        head = "%%profile: the cell as one step (no optimizer step and no DataLoader batch in it)"
    else:
        first, last = (data.steps[0].number, data.steps[-1].number) if n else (0, 0)
        skipped = f", {data.warmup} warm-up skipped" if data.warmup else ""
        head = f"%%profile: {n} {what}{'es' if what.endswith('batch') and n != 1 else 's' if n != 1 else ''} " \
               f"profiled ({first}-{last}{skipped})"
    state = {"finished": "", "stopped": " — stopped: what was profiled is kept",
             "failed": " — the cell raised: what was profiled is kept"}[data.status]
    return f"{head}, median step {fmt_ms(data.step_ms)} on {data.device}{state}"


def _shares(data: ProfileData) -> list[tuple[str, float, float]]:
    mean = sum(s.ms for s in data.steps) / len(data.steps) if data.steps else 0.0
    return [(c, data.mean(c), data.mean(c) / mean if mean else 0.0) for c in CATEGORIES]


def where(row: LineRow) -> str:
    return str(row.line)


def text(data: ProfileData) -> str:
    v = data.verdict
    lines = [title(data), f"verdict: {v.kind.upper()} — {v.summary}", f"  fix: {v.fix}"]
    lines.append("time per step: " + " · ".join(f"{CATEGORY_LABELS[c]} {fmt_ms(ms)} ({share:.0%})"
                                                 for c, ms, share in _shares(data) if ms > 0))
    idle = [s.device_idle_ms for s in data.steps if s.device_idle_ms is not None]
    if idle:
        lines.append(f"device idle: {fmt_ms(sum(idle) / len(idle))} per step")
    if data.steps:
        ops = sum(s.ops for s in data.steps) / len(data.steps)
        lines.append(f"torch ops per step: {ops:.0f}")
    if data.lines:
        lines.append("top lines (time per step, share):")
        lines += [f"  {fmt_ms(r.ms):>9} {r.share:4.0%}  {where(r)}" for r in data.lines[:TEXT_ROWS]]
    if data.modules:
        lines.append("top modules (forward, per step):")
        lines += [f"  {fmt_ms(m.ms):>9} {m.share:4.0%}  {m.path} (self {fmt_ms(m.self_ms)}, {m.calls:g} call"
                  f"{'s' if m.calls != 1 else ''})" for m in data.modules[:TEXT_ROWS]]
    if data.ops:
        lines.append("top ops (per step):")
        lines += [f"  {fmt_ms(o.ms):>9} {o.share:4.0%}  {o.name} ×{o.calls:g}, median {o.median_us:.0f} µs"
                  for o in data.ops[:TEXT_ROWS]]
    lines += [f"TorchTidy: {p.name} ({p.count}×): {p.description}" for p in data.patterns]
    if data.trace:
        lines.append(f"trace: {data.trace} (open it at ui.perfetto.dev)")
    lines += [f"note: {n}" for n in data.notes]
    return "\n".join(lines)


# -- static figure ---------------------------------------------------------------------------
def _draw(fig: Any, data: ProfileData) -> None:
    bars, line = fig.add_axes((0.08, 0.42, 0.62, 0.5)), fig.add_axes((0.08, 0.1, 0.9, 0.14))
    x = [s.number for s in data.steps]
    bottom = [0.0] * len(x)
    for c in CATEGORIES:
        ms = [s.categories.get(c, 0.0) for s in data.steps]
        if any(ms):
            bars.bar(x, ms, bottom=bottom, color=CATEGORY_COLOURS[c], label=CATEGORY_LABELS[c], width=0.8)
            bottom = [b + m for b, m in zip(bottom, ms)]
    bars.set_xlabel("step")
    bars.set_ylabel("ms")
    bars.set_title("Time per step by category")
    bars.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0))
    for s in data.timeline:
        line.broken_barh([(s.start, max(s.end - s.start, 1e-4))], (0, 1), color=CATEGORY_COLOURS[s.category])
    line.set_yticks([])
    line.set_xlabel("ms from the step's start")
    line.set_title(f"Step {data.timeline_step}, what the host did")
    if data.timeline:
        line.set_xlim(0, data.timeline[-1].end)


def alt(data: ProfileData) -> str:
    parts = ", ".join(f"{CATEGORY_LABELS[c]} {share:.0%}" for c, _, share in _shares(data) if share >= 0.01)
    return f"stacked bars of {len(data.steps)} steps' time by category ({parts}), and one step's timeline"


def html(data: ProfileData) -> str:
    v = data.verdict
    parts = [f'<div class="tnd tnd-profile"><p><b>{esc(title(data))}</b></p>',
             f"<p><b>Verdict: {esc(v.kind)}</b> ({v.share:.0%} of the step) — {esc(v.summary)}<br>"
             f"<b>Fix:</b> {esc(v.fix)}</p>"]
    if data.steps:
        parts.append(picture(lambda fig: _draw(fig, data), 720, 330, alt(data)))
        rows = [[f"{swatch(CATEGORY_COLOURS[c])}{esc(CATEGORY_LABELS[c])}", esc(fmt_ms(ms)), f"{share:.0%}"]
                for c, ms, share in _shares(data)]
        parts.append("<p><b>Time per step</b></p>" + table(["category", "mean", "share"], rows, numeric=(1, 2)))
    if data.lines:
        rows = [[esc(r.line.location), f"<code>{esc(r.text)}</code>", esc(fmt_ms(r.ms)), f"{r.share:.0%}",
                 f"{r.ops:.0f}"] for r in data.lines[:HTML_ROWS]]
        parts.append("<p><b>Top lines</b></p>" + table(["where", "statement", "per step", "share", "ops"], rows,
                                                       numeric=(2, 3, 4)))
    if data.modules:
        rows = [[f"<code>{esc(m.path)}</code>", esc(fmt_ms(m.ms)), esc(fmt_ms(m.self_ms)), f"{m.share:.0%}",
                 f"{m.calls:g}"] for m in data.modules[:HTML_ROWS]]
        parts.append("<p><b>Top modules</b> (forward)</p>" +
                     table(["module", "per step", "self", "share", "calls"], rows, numeric=(1, 2, 3, 4)))
    if data.ops:
        rows = [[f"<code>{esc(o.name)}</code>", f"{o.calls:g}", esc(fmt_ms(o.ms)), f"{o.median_us:.0f} µs",
                 f"{o.share:.0%}"] for o in data.ops[:HTML_ROWS]]
        parts.append("<p><b>Top ops</b></p>" + table(["op", "calls", "per step", "median", "share"], rows,
                                                     numeric=(1, 2, 3, 4)))
    if data.patterns:
        parts.append("<p><b>TorchTidy</b></p><ul>" + "".join(
            f"<li><b>{esc(p.name)}</b> ({p.count}×): {esc(p.description)}</li>" for p in data.patterns) + "</ul>")
    parts += [f"<p>{muted('note: ' + esc(n))}</p>" for n in data.notes]
    parts.append("</div>")
    return "".join(parts)


# -- comparison ------------------------------------------------------------------------------
def comparison_text(c: Comparison) -> str:
    faster = f"{c.speedup:.2f}x faster" if c.speedup >= 1 else f"{1 / c.speedup:.2f}x slower"
    verdict = (f"verdict {c.before_verdict} -> {c.after_verdict}" if c.verdict_changed
               else f"verdict still {c.after_verdict}")
    lines = [f"step {fmt_ms(c.before_ms)} -> {fmt_ms(c.after_ms)} ({faster}); {verdict}"]
    for label, rows in (("categories", c.categories), ("modules", c.modules), ("lines", c.lines)):
        moved = [r for r in rows if abs(r.delta_ms) >= 0.0005][:TEXT_ROWS]
        if moved:
            lines.append(f"{label}:")
            lines += [f"  {'+' if r.delta_ms > 0 else '-'}{fmt_ms(abs(r.delta_ms)):>9}  "
                      f"{CATEGORY_LABELS.get(r.name, r.name)}  ({fmt_ms(r.before_ms)} -> {fmt_ms(r.after_ms)})"
                      for r in moved]
    return "\n".join(lines)


def comparison_html(c: Comparison) -> str:
    head, *rest = comparison_text(c).split("\n")
    return f'<div class="tnd tnd-profile"><p><b>{esc(head)}</b></p><pre>{esc(chr(10).join(rest))}</pre></div>'


# -- widget ----------------------------------------------------------------------------------
class ProfileView(View):
    """Stacked bars per step, a zoomable timeline of one step, tables whose rows open their line."""

    _esm = esm_path("profile.js")
    _css = esm_path("base.css")
    report = traitlets.Dict().tag(sync=True)      # the summary (ProfileData.to_dict) plus labels and colours
    zoom: traitlets.List[Any] = traitlets.List([]).tag(sync=True)      # [start ms, end ms] of the timeline, or [] for all of it
    opened = traitlets.Int(-1).tag(sync=True)     # the line row opened (-1: none)


def widget(data: ProfileData) -> ProfileView:
    view = ProfileView()
    payload = data.to_dict()
    payload["title"] = title(data)
    payload["labels"] = CATEGORY_LABELS
    payload["colours"] = CATEGORY_COLOURS
    payload["categories"] = list(CATEGORIES)
    for row, raw in zip(data.lines, payload["lines"]):
        raw["where"] = row.line.location
    view.report = payload
    return view
