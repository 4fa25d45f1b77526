"""The nanwatch report as text, as self-contained static HTML, and as a live widget.

The card says where (module, cell line), what (op, NaN or Inf, input/output statistics), why and
the fix (the hint). Below: the cell with the line highlighted, per-layer statistics with the birth
row marked, and every event. Every user string goes through :func:`esc`.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import traitlets

from torch_nbdebug.data.nanwatch import LayerStats, NanEvent, NanSummary
from torch_nbdebug.data.stats import fmt_number
from torch_nbdebug.render.html import AMBER, GREEN, bad, esc, muted, table
from torch_nbdebug.render.widget import View, esm_path

_PHASE_LABEL = {"forward": "forward", "backward": "backward", "optimizer": "optimizer step", "input": "input data"}
_KIND_LABEL = {"nan": "NaN", "inf": "Inf"}
CONTEXT_LINES = 6  # lines shown either side of the birth line; a long cell would bury it otherwise


# -- text ----------------------------------------------------------------------------------------
def report_text(s: NanSummary, finished: bool = True) -> str:
    if not finished:
        return "nanwatch: still running (the report fills in when the watched code ends)"
    lines = []
    first = s.first
    if first is None:
        lines.append(f"nanwatch: no NaN/Inf born ({s.checked()}, mode={s.mode})")
        if clean_doubt(s):
            lines.append("  " + clean_doubt(s))
    else:
        lines.append(f"nanwatch: {first.title(s.line_label(first))}")
        lines += ["  " + x for x in event_lines(first, s)]
        if len(s.events) > 1:
            lines.append(f"all births ({len(s.events)}):")
            lines += [f"  {i + 1}. {short(e, s)}" for i, e in enumerate(s.events)]
    if s.absorbed:
        lines.append(f"{ABSORBED_TITLE}:")
        lines += [f"  - {short(e, s)}" for e in s.absorbed]
    lines += [f"note: {n}" for n in s.notes]
    return "\n".join(lines)


def event_lines(e: NanEvent, s: NanSummary) -> list[str]:
    out = []
    if e.lineno is not None:
        out.append(f"{s.line_label(e)}: {e.line}" if e.line else s.line_label(e))
    if e.phase == "backward" and e.forward_op:
        out.append(f"created in forward by {e.forward_op}" + (f" in {e.forward_module}" if e.forward_module else ""))
    if e.aten_op and e.aten_op != e.op:
        out.append(f"op: {e.aten_op}")
    if e.hint:
        out.append(f"why/fix: {e.hint}")
    for i, st in enumerate(e.inputs):
        out.append(f"input {i}: {st.brief()}")
    if e.output is not None:
        out.append(f"output: {e.output.brief()}")
    return out


def short(e: NanEvent, s: NanSummary) -> str:
    where = " ".join(x for x in (e.module or e.param or "", s.line_label(e) if e.lineno else "") if x)
    return f"[{e.phase}, step {e.step}] {e.kind.upper()} {e.op}" + (f" — {where}" if where else "")


# -- static HTML ---------------------------------------------------------------------------------
def report_html(s: NanSummary, finished: bool = True) -> str:
    if not finished:
        return (f'<div class="tnd"><p><b>nanwatch: still running</b> '
                f'{muted("(the report fills in when the watched code ends)")}</p></div>')
    parts = ['<div class="tnd tnd-nanwatch">', card_html(s.first, s)]
    if s.first is not None and s.cell_source:
        parts.append(source_html(s))
    if s.layers:
        parts.append(layers_html(s.layers))
    if s.events:
        parts.append(events_html(s.events, "All births", s))
    if s.absorbed:
        parts.append(events_html(s.absorbed, ABSORBED_TITLE, s))
    parts += [f"<p>{muted('note: ' + esc(n))}</p>" for n in s.notes]
    parts.append("</div>")
    return "".join(parts)


def card_html(e: Optional[NanEvent], s: NanSummary) -> str:
    if e is None:
        doubt, checked = clean_doubt(s), s.checked(",")
        if doubt:  # never a green "all clear" the data does not support
            return (f'<blockquote class="card caution"><b class="warn" style="color:{AMBER}">⚠ nanwatch: no NaN/Inf birth recorded</b> '
                    f'{muted(f"({checked}, mode {esc(s.mode)})")}<br>{esc(doubt)}</blockquote>')
        return (f'<blockquote class="card ok"><b class="good" style="color:{GREEN}">✓ nanwatch: no NaN/Inf born</b> '
                f'{muted(f"— every value stayed finite ({checked}, mode {esc(s.mode)})")}'
                f'</blockquote>')
    rows = [("Where", _where(e, s)), ("What", _what(e)), ("Why / fix", esc(e.hint))]
    if e.phase == "backward" and e.forward_op:
        rows.insert(1, ("Forward", f"created by <code>{esc(e.forward_op)}</code>"
                        + (f" in <code>{esc(e.forward_module)}</code>" if e.forward_module else "")
                        + (f" at line {e.forward_lineno}" if e.forward_lineno else "")))
    stats = [f"<code>input {i}: {esc(st.brief())}</code>" for i, st in enumerate(e.inputs)]
    if e.output is not None:
        stats.append(f"<code>output: {esc(e.output.brief())}</code>")
    rows.append(("Stats", "<br>".join(stats)))
    body = "".join(f'<tr><th scope="row" style="text-align:left">{k}</th><td style="text-align:left">{v}</td></tr>'
                   for k, v in rows)
    return (f'<div class="card nw-card"><h3 class="nw-title">{bad(esc(e.title(s.line_label(e))))}</h3>'
            f"<table>{body}</table></div>")


ABSORBED_TITLE = "Absorbed: thrown away by torch.where / masked_fill or a cast to integers, or skipped by GradScaler"


def clean_doubt(s: NanSummary) -> str:
    """Why a report without births is not a clean bill of health ("" when it is)."""
    if any(layer.fwd_finite is False or layer.grad_finite is False for layer in s.layers):
        if s.absorbed:
            return "the NaN/Inf values in the table come from the absorbed births listed below."
        return ("but some layer outputs or gradients below hold NaN/Inf: they were not created by a watched op "
                "(see the notes), so their birth was not caught.")
    if s.ops_checked == 0 and s.module_calls == 0:
        return "but no op or module output was checked, so this says nothing about the values (see the notes)."
    return ""


def _where(e: NanEvent, s: NanSummary) -> str:
    bits = []
    if e.module:
        bits.append(f"<code class='nw-module'>{esc(e.module)}</code>")
    if e.param:
        bits.append(f"parameter <code>{esc(e.param)}</code>")
    if e.lineno is not None:
        bits.append(f"{esc(s.line_label(e))}: <code class='nw-line'>{esc(e.line)}</code>")
    bits.append(f"{esc(_PHASE_LABEL.get(e.phase, e.phase))}, step {e.step}")
    return " · ".join(bits)


def _what(e: NanEvent) -> str:
    text = f"<b>{'NaN' if e.kind == 'nan' else 'Inf'}</b> from <code class='nw-op'>{esc(e.op)}</code>"
    if e.aten_op and e.aten_op != e.op:
        text += f" (<code>{esc(e.aten_op)}</code>)"
    if e.detail:
        text += f" {muted(esc(e.detail))}"
    return text


def source_html(s: NanSummary) -> str:
    """The cell around the birth line; lines far from it are folded into a "… N lines" marker.

    Real line breaks (not CSS blocks) separate the lines, and the birth line is marked with ▶ and
    bold, so the listing reads the same with no stylesheet."""
    target = s.first.lineno if s.first is not None else None
    lines = s.cell_source.splitlines()
    first = s.source_first_line
    lo, hi = source_window(len(lines), first, target)
    out = [f'<i class="gap">… {lo} line{"" if lo == 1 else "s"} above</i>'] if lo else []
    for i, text in enumerate(lines[lo:hi], start=first + lo):
        if i == target:
            out.append(f'<b class="line hl" style="background:rgba(255,200,0,0.25)">▶{i:>3}  {esc(text)}</b>')
        else:
            out.append(f'<span class="line"> {i:>3}  {esc(text)}</span>')
    if hi < len(lines):
        rest = len(lines) - hi
        out.append(f'<i class="gap">… {rest} line{"" if rest == 1 else "s"} below</i>')
    return f'<pre class="cell nw-source">{chr(10).join(out)}</pre>'


def source_window(count: int, first: int, target: Optional[int]) -> tuple[int, int]:
    """Index range of the lines to show: all of a short cell, else CONTEXT_LINES around the target."""
    if target is None or count <= 2 * CONTEXT_LINES + 3:
        return 0, count
    at = target - first
    lo = max(0, at - CONTEXT_LINES)
    hi = min(count, at + CONTEXT_LINES + 1)
    return (0 if lo <= 2 else lo), (count if count - hi <= 2 else hi)  # never fold just one or two lines


def _fmt(v: Optional[float]) -> str:
    return "" if v is None else fmt_number(v)


def _cell(finite: Optional[bool], *values: Optional[float]) -> str:
    if finite is None:
        return "<td style='text-align:right'>—</td>" * 3
    if not finite:
        return f"<td colspan='3' style='text-align:center'>{bad('NaN/Inf')}</td>"
    return "".join(f"<td style='text-align:right'>{_fmt(v)}</td>" for v in values)


def layers_html(layers: tuple[LayerStats, ...]) -> str:
    right = "style='text-align:right'"
    head = (f"<thead><tr><th rowspan='2' style='text-align:left'>module</th><th rowspan='2' {right}>calls</th>"
            "<th colspan='3'>activation (output)</th><th colspan='3'>gradient (w.r.t. output)</th></tr><tr>"
            + f"<th {right}>min</th><th {right}>max</th><th {right}>mean</th>" * 2 + "</tr></thead>")
    rows = []
    for layer in layers:
        path = ".<wbr>".join(esc(part) for part in layer.module.split("."))  # wraps after a dot when narrow
        name = f"<code>{path}</code>" + (f" {bad('◀ birth')}" if layer.birth else "")
        mark = ' class="mark"' if layer.birth else ""
        rows.append(f"<tr{mark}><td style='text-align:left'>{name}</td><td {right}>{layer.calls}</td>"
                    f"{_cell(layer.fwd_finite, layer.fwd_min, layer.fwd_max, layer.fwd_mean)}"
                    f"{_cell(layer.grad_finite, layer.grad_min, layer.grad_max, layer.grad_mean)}</tr>")
    return (f"<h3>Per-layer activations and gradients</h3><table class='nw-layers'>{head}<tbody>{''.join(rows)}"
            "</tbody></table>")


def events_html(events: tuple[NanEvent, ...], title: str, s: NanSummary) -> str:
    rows = [(str(i + 1), esc(_PHASE_LABEL.get(e.phase, e.phase)), str(e.step), bad(esc(_KIND_LABEL.get(e.kind, e.kind))),
             f"<code>{esc(e.op)}</code>", f"<code>{esc(e.module or e.param)}</code>" if e.module or e.param else "",
             "" if e.lineno is None else esc(s.line_label(e))) for i, e in enumerate(events)]
    head = ["#", "phase", "step", "kind", "op", "module / parameter", "line"]
    return f"<h3>{esc(title)}</h3>{table(head, rows, numeric=[0, 2, 6], cls='nw-events')}"


# -- widget --------------------------------------------------------------------------------------
class NanView(View):
    """Live view: the card, the highlighted cell, the layer table and the event list (click to select)."""

    _esm = esm_path("nanwatch.js")
    _css = esm_path("base.css")  # the shared look, also in the live view
    report = traitlets.Dict().tag(sync=True)
    selected = traitlets.Int(0).tag(sync=True)

    @classmethod
    def of(cls, summary: NanSummary) -> "NanView":
        return cls(report=json_safe(summary.to_dict()))


def json_safe(value: Any) -> Any:
    """Replace NaN/Inf floats (not valid JSON) by strings, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value
