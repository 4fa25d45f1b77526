"""The ``%%repro`` report as text and as a static HTML card.

The card uses only ``style=`` attributes (no ``<style>``, no ``<svg>``, no script), so it survives
notebook sanitizers (GitHub, nbviewer, JupyterLab's untrusted output); every user string is escaped.
"""
from __future__ import annotations

from typing import Optional

from torch_nbdebug.data.repro import ReproOp, ReproSummary
from torch_nbdebug.render.html import esc

__all__ = ["report_text", "report_html"]

_CAUSE_TEXT = {
    "rng": "randomness not restored or not seeded",
    "uninitialized": "memory read before it was written",
    "external": "a value from outside torch's state",
    "nondeterministic_op": "same inputs, different output (a nondeterministic kernel)",
    "unknown": "no op explains it",
}
# Colours follow JupyterLab's theme variables; the fallbacks (after the comma) are for viewers with no
# JupyterLab stylesheet (GitHub, plain HTML). A sanitizer that drops `var()` (JupyterLab, untrusted)
# drops only that declaration: the text then takes the page's own colours, which suit its theme.
_MUTED = "var(--jp-ui-font-color2, #57606a)"
# Translucent grey: a code chip reads on a light and on a dark page alike.
_CODE_BG = "var(--jp-layout-color2, rgba(127, 127, 127, 0.12))"
_STATUS_COLOR = {"ok": "#1a7f37", "warn": "#b35900", "info": _MUTED}


def _where(first: ReproOp) -> str:
    place = f"line {first.lineno}" if first.lineno else "(no line of yours)"
    module = f" in {first.module}" if first.module else ""
    return f"{place}{module}, {first.phase}"


def _diff(value: Optional[float]) -> str:
    return "n/a" if value is None else f">= {value:.3g}"


def headline(summary: ReproSummary, finished: bool = True) -> str:
    if not finished:
        return "repro: still running"
    if summary.identical and summary.ops[1]:
        return f"repro: the two runs are identical ({summary.ops[0]} ops compared bit for bit)"
    if summary.identical:
        return "repro: the two runs are identical (no torch ops ran)"
    if summary.cause is None:
        return "repro: not compared"
    return f"repro: the runs differ - cause: {summary.cause} ({_CAUSE_TEXT[summary.cause]})"


def report_text(summary: ReproSummary, finished: bool = True) -> str:
    lines = [headline(summary, finished)]
    first = summary.first
    if first is not None:
        lines.append(f"  first difference: {first.op} at {_where(first)}")
        if first.line:
            lines.append(f"    {first.line}")
        if first.input:
            lines.append(f"  input that differed: {first.input}")
        if first.allocated_at:
            lines.append(f"  memory allocated at {first.allocated_at}")
        lines.append(f"  size of the difference: max |diff| {_diff(first.max_abs_diff)}")
    if summary.hint:
        lines.append(f"  fix: {summary.hint}")
    for use in summary.nondeterministic_ops:
        at = f" line {use.lineno}: {use.line}" if use.lineno else ""
        lines.append(f"  nondeterministic on {use.device}: {use.op} x{use.count}{at}")
    warned = [p for p in summary.preflight if p.status == "warn"]
    for item in warned:
        lines.append(f"  preflight: {item.name} = {item.value} - {item.advice}")
    for note in summary.notes:
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def code_spans(text: str) -> str:
    """Escaped text with its `backticked` parts as ``<code>`` (an unpaired backtick stays as written)."""
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an odd number of backticks: the last one opens nothing
        parts[-2:] = [parts[-2] + "`" + parts[-1]]
    return "".join(f'<code style="background:{_CODE_BG};padding:1px 4px">{esc(p)}</code>' if i % 2 else esc(p)
                   for i, p in enumerate(parts))


def _row(label: str, value: str) -> str:
    return (f'<tr><th style="text-align:left;padding:2px 8px 2px 0;vertical-align:top;font-weight:600;'
            f'white-space:nowrap">{esc(label)}</th><td style="text-align:left;padding:2px 0">{value}</td></tr>')


def _first_rows(first: ReproOp) -> list[str]:
    rows = [_row("first difference", f"<code>{esc(first.op)}</code> at {esc(_where(first))}")]
    if first.line:
        rows.append(_row("your line", f'<code style="background:{_CODE_BG};padding:1px 4px">{esc(first.line)}</code>'))
    if first.input:
        rows.append(_row("input that differed", esc(first.input)))
    if first.allocated_at:
        rows.append(_row("allocated at", f"<code>{esc(first.allocated_at)}</code>"))
    rows.append(_row("max |diff|", esc(_diff(first.max_abs_diff))))
    return rows


def _preflight_rows(summary: ReproSummary) -> list[str]:
    rows = []
    for item in summary.preflight:
        color = _STATUS_COLOR[item.status]
        advice = f' <span style="color:{_MUTED}">- {esc(item.advice)}</span>' if item.advice and item.status == "warn" else ""
        rows.append(f'<li><span style="color:{color};font-weight:600">{esc(item.status)}</span> '
                    f'{esc(item.name)} = <code>{esc(item.value)}</code>{advice}</li>')
    return rows


def report_html(summary: ReproSummary, finished: bool = True) -> str:
    ok = summary.identical and finished
    border = "#1a7f37" if ok else "#cf222e"
    cause = esc(summary.cause or "")
    parts = [f'<div class="tnd-repro" data-cause="{cause}" style="border-left:4px solid {border};padding:6px 10px;'
             f'font-family:sans-serif;font-size:13px;line-height:1.4">',
             f'<div style="color:{border};margin-bottom:4px"><b>{esc(headline(summary, finished))}</b></div>']
    rows: list[str] = _first_rows(summary.first) if summary.first is not None else []
    if summary.hint:
        rows.append(_row("fix", code_spans(summary.hint)))
    for use in summary.nondeterministic_ops:
        at = f" - line {use.lineno}: <code>{esc(use.line)}</code>" if use.lineno else ""
        rows.append(_row(f"nondeterministic on {use.device}", f"<code>{esc(use.op)}</code> x{use.count}{at}"))
    if rows:
        parts.append('<table style="border-collapse:collapse">' + "".join(rows) + "</table>")
    preflight = _preflight_rows(summary)
    if preflight:
        parts.append('<details style="margin-top:4px"><summary>preflight: settings that decide determinism'
                     '</summary><ul style="margin:2px 0 2px 18px;padding:0">' + "".join(preflight) + "</ul></details>")
    if summary.notes:
        parts.append(f'<ul style="margin:4px 0 0 18px;padding:0;color:{_MUTED}">'
                     + "".join(f"<li>{esc(n)}</li>" for n in summary.notes) + "</ul>")
    parts.append("</div>")
    return "".join(parts)
