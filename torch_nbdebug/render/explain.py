"""A diagnosis as text, as one paragraph (under an automatic traceback), as a static HTML card, and
as a live widget (:class:`ExplainView`, state :class:`DiagnosisPayload`).

The card uses ``style=`` attributes only (no ``<style>``, no ``<svg>``, no script), so it survives
the HTML sanitizers of JupyterLab's untrusted outputs, GitHub and nbconvert; every user string
(module names, lines, operand names, the message) is escaped.
"""
from __future__ import annotations

from typing import Optional, TypedDict

import traitlets

from torch_nbdebug.data.explain import Diagnosis, Operand
from torch_nbdebug.render.html import esc, static_text
from torch_nbdebug.render.widget import View, esm_path

TITLES = {"shape": "Shape mismatch", "device": "Device mismatch", "dtype": "Dtype mismatch",
          "inplace": "Saved tensor modified in place", "graph_reuse": "Backward through a freed graph",
          "no_grad": "No gradient chain", "index": "Index out of range", "other": "PyTorch error"}
_BORDER = "#c0392b"
_CARD = (f"border-left:4px solid {_BORDER};background:#fdf3f2;color:#222;padding:8px 12px;margin:6px 0;"
         "font-family:system-ui,-apple-system,'Segoe UI',sans-serif;font-size:13px;line-height:1.45;max-width:980px")
_CODE = "font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;background:#f4e4e1;padding:0 3px"
# Explicit alignment and backgrounds: notebook front ends right-align and stripe table cells by default.
_CELL = "text-align:left;vertical-align:top;background:transparent;border:none;padding:2px 6px"
_LABEL = f"{_CELL};color:#7a2a20;font-weight:600;padding-right:10px;white-space:nowrap"


def title(d: Diagnosis) -> str:
    return f"{TITLES.get(d.kind, 'PyTorch error')}: {d.summary}" if d.summary else TITLES.get(d.kind, "PyTorch error")


def where(d: Diagnosis) -> str:
    """``model.fc, line 7: return self.fc(x)``."""
    parts = [f"`{d.module}`"] if d.module else []
    if d.lineno:
        parts.append(f"line {d.lineno}" + (f": {d.line}" if d.line else ""))
    return ", ".join(parts)


def culprit(d: Diagnosis) -> str:
    if not (d.culprit_op or d.culprit_lineno):
        return ""
    text = f"`{d.culprit_op}`" if d.culprit_op else ""
    if d.culprit_module:
        text += f" in `{d.culprit_module}`"
    if d.culprit_lineno:
        text += f", line {d.culprit_lineno}" + (f": {d.culprit_line}" if d.culprit_line else "")
    return text.strip(", ")


def diagnosis_text(d: Diagnosis) -> str:
    lines = [f"explain [{d.kind}] {title(d)}"]
    rows = [("where", where(d)), ("op", d.op), ("culprit", culprit(d)), ("why/fix", d.hint), ("careful", d.warning)]
    lines += [f"  {label:>8}: {value}" for label, value in rows if value]
    lines += [f"  {'operand':>8}: {o.describe()}" for o in d.operands]
    if d.restart_needed:
        lines.append("  restart the kernel: the CUDA context is unusable after a device-side assert")
    if d.suggest_record:
        lines.append("  run the cell again with %%explain on its first line to name the culprit")
    if d.note:
        lines.append(f"  {'note':>8}: {d.note}")
    return "\n".join(lines)


def paragraph_text(d: Diagnosis) -> str:
    """One paragraph for under a traceback (the automatic explanation)."""
    at = where(d)
    text = f"torch_nbdebug: {TITLES.get(d.kind, 'PyTorch error').lower()}{' at ' + at if at else ''}. {d.hint}"
    if d.warning:
        text += f" {d.warning}"
    if d.suggest_record:
        text += " (%%explain on the cell's first line records the run and names the culprit.)"
    return text


def _code(text: str) -> str:
    """Escape, then show `backticked` spans as code."""
    parts = esc(text).split("`")
    return "".join(f'<code style="{_CODE}">{p}</code>' if i % 2 else p for i, p in enumerate(parts))


def _row(label: str, value_html: str) -> str:
    return (f'<tr style="background:transparent"><th scope="row" style="{_LABEL}">{esc(label)}</th>'
            f'<td class="tnd-explain-{esc(label)}" style="{_CELL}">{value_html}</td></tr>')


def diagnosis_html(d: Diagnosis) -> str:
    rows = [("where", where(d)), ("op", f"`{d.op}`" if d.op else ""), ("culprit", culprit(d)), ("fix", d.hint),
            ("careful", d.warning)]
    body = "".join(_row(label, _code(value)) for label, value in rows if value)
    if d.operands:
        items = "".join(f"<li>{_code('`' + o.describe() + '`')}</li>" for o in d.operands)
        body += _row("operands", f'<ul style="margin:0;padding-left:18px;text-align:left">{items}</ul>')
    notes = []
    if d.restart_needed:
        notes.append("Restart the kernel: the CUDA context is unusable after a device-side assert.")
    if d.suggest_record:
        notes.append("Run the cell again with `%%explain` on its first line to name the culprit.")
    if d.note:
        notes.append(d.note)
    note_html = "".join(f'<div class="tnd-explain-note" style="margin-top:6px">{_code(n)}</div>' for n in notes)
    return (f'<div class="tnd-explain tnd-explain-{esc(d.kind)}" data-kind="{esc(d.kind)}" style="{_CARD}">'
            f'<div class="tnd-explain-title" style="font-weight:700;color:{_BORDER};margin-bottom:4px">'
            f"<b>{_code(title(d))}</b></div>"
            f'<table style="border-collapse:collapse;margin:0;width:auto">{body}</table>{note_html}</div>')


def paragraph_html(d: Diagnosis) -> str:
    return (f'<div class="tnd-explain-auto" data-kind="{esc(d.kind)}" style="{_CARD}">'
            f"{_code(paragraph_text(d))}</div>")


# -- widget --------------------------------------------------------------------------------------
class OperandPayload(TypedDict):
    """One operand as the widget gets it."""

    name: str
    shape: Optional[list[int]]
    dtype: str
    device: str
    producer: str
    requires_grad: bool


class DiagnosisPayload(TypedDict):
    """The widget's synced state: the diagnosis as JSON, plus what the kernel already worded."""

    kind: str
    title: str  # "Shape mismatch" (the kind's title, from TITLES)
    summary: str
    exc_type: str
    message: str
    op: str
    module: str
    filename: str
    lineno: int
    line: str
    culprit_op: str
    culprit_module: str
    culprit_filename: str
    culprit_lineno: int
    culprit_line: str
    hint: str
    warning: str  # Diagnosis.warning: a tempting fix not to apply (``loss.requires_grad = True``)
    operands: list[OperandPayload]
    recorded: bool
    suggest_record: bool
    restart_needed: bool
    note: str  # Diagnosis.note: how the recorded run differed from a plain one
    text: str  # diagnosis_text(): what the copy button puts on the clipboard


def _operand_payload(o: Operand) -> OperandPayload:
    return OperandPayload(name=o.name, shape=None if o.shape is None else [int(s) for s in o.shape],
                          dtype=o.dtype, device=o.device, producer=o.producer, requires_grad=bool(o.requires_grad))


def payload(d: Diagnosis) -> DiagnosisPayload:
    """The widget's state for a diagnosis: plain strings, numbers, booleans and lists (no tensors)."""
    return DiagnosisPayload(
        kind=d.kind, title=TITLES.get(d.kind, "PyTorch error"), summary=d.summary, exc_type=d.exc_type,
        message=d.message, op=d.op, module=d.module, filename=d.filename, lineno=int(d.lineno), line=d.line,
        culprit_op=d.culprit_op, culprit_module=d.culprit_module, culprit_filename=d.culprit_filename,
        culprit_lineno=int(d.culprit_lineno), culprit_line=d.culprit_line, hint=d.hint, warning=d.warning,
        operands=[_operand_payload(o) for o in d.operands], recorded=bool(d.recorded),
        suggest_record=bool(d.suggest_record), restart_needed=bool(d.restart_needed), note=d.note, text=diagnosis_text(d))


# Only what base.css has no rule for; colours come from JupyterLab's theme variables (dark themes too).
_VIEW_CSS = """
.tnd-explain-view .card { max-width: 980px; }
.tnd-explain-view .xp-head { display: flex; align-items: baseline; gap: 8px; flex-wrap: wrap; }
.tnd-explain-view .xp-head .tnd-explain-title { flex: 1 1 auto; }
.tnd-explain-view table { margin: 4px 0; }
.tnd-explain-view table.xp-facts th { background: transparent; color: var(--jp-ui-font-color2, #57606a); }
.tnd-explain-view table.xp-facts th, .tnd-explain-view table.xp-facts td { border-bottom: none; }
.tnd-explain-view code { background: var(--jp-layout-color2, rgba(127, 127, 127, 0.12)); border-radius: 3px; padding: 0 3px; }
.tnd-explain-view .xp-warning { border-left: 3px solid var(--jp-warn-color0, #bf8700); padding: 4px 8px; margin: 6px 0;
  background: var(--jp-warn-color3, rgba(191, 135, 0, 0.1)); }
.tnd-explain-view .xp-note { margin-top: 4px; }
.tnd-explain-view button:focus-visible { outline: 2px solid var(--jp-brand-color1, #0969da); outline-offset: 1px; }
.tnd-explain-view button[aria-expanded] .xp-caret { display: inline-block; width: 1em; }
.tnd-explain-view pre.xp-message { white-space: pre-wrap; margin: 4px 0; padding: 4px 8px; max-height: 240px; overflow: auto;
  border: 1px solid var(--jp-border-color2, #d8dee4); border-radius: 4px; }
"""


class ExplainView(View):
    """Live view of a diagnosis: the card, the operands table, a collapsible details section (the
    full message and the files) and a button that copies the diagnosis as text."""

    _esm = esm_path("explain.js")
    _css = static_text("base.css") + _VIEW_CSS
    diagnosis = traitlets.Dict().tag(sync=True)
    expanded = traitlets.Bool(False).tag(sync=True)  # the details section is open

    @classmethod
    def of(cls, d: Diagnosis, expanded: bool = False) -> "ExplainView":
        return cls(diagnosis=dict(payload(d)), expanded=expanded)
