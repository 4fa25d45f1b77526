"""Small helpers for static HTML: escaping, and the few pieces every static view is built from.

Every user-provided string (module names, op names, variable names) goes through :func:`esc`.

The static views are read where no stylesheet reaches them: a notebook opened without trusting it
(JupyterLab's sanitizer strips ``<style>`` and ``<svg>``), nbconvert HTML, GitHub. So they are plain
semantic HTML — ``<h3>``, ``<table>`` with ``<th>``, ``<b>``, ``<code>``, ``<pre>`` with real line
breaks — that reads well with no CSS at all; figures are ``<img>`` pictures
(:mod:`torch_nbdebug.render.figures`). Colour comes from ``style=`` as an extra that never carries
meaning alone: a red cell also says "NaN/Inf", a swatch sits next to its label.
"""
from __future__ import annotations

import html
from importlib import resources
from typing import Iterable, Sequence

__all__ = ["esc", "stylesheet", "static_text", "table", "swatch", "muted", "bad", "RED", "MUTED", "AMBER", "GREEN"]

RED, MUTED, AMBER, GREEN = "#cf222e", "#57606a", "#9a6700", "#1a7f37"


def esc(value: object) -> str:
    """Escape any value for HTML text or a quoted attribute."""
    return html.escape(str(value), quote=True)


def static_text(name: str) -> str:
    """Read a file shipped in ``torch_nbdebug/render/static`` (ES modules, CSS)."""
    return resources.files("torch_nbdebug.render").joinpath("static", name).read_text(encoding="utf-8")


def stylesheet() -> str:
    """The shared CSS as a ``<style>`` element (live views only: sanitizers strip it from saved outputs)."""
    return f"<style>{static_text('base.css')}</style>"


def table(head: Sequence[str], rows: Iterable[Sequence[str]], numeric: Iterable[int] = (), cls: str = "") -> str:
    """A ``<table>`` of already-escaped cells; ``numeric`` columns align right, the others left.

    Alignment is a ``style=`` extra: JupyterLab right-aligns every cell by default, which makes names
    and sentences hard to read; without styles the table still has its header row and columns.
    """
    right = set(numeric)
    align = ["right" if i in right else "left" for i in range(len(head))]
    top = "".join(f'<th style="text-align:{a}">{h}</th>' for h, a in zip(head, align))
    body = "".join("<tr>" + "".join(f'<td style="text-align:{a}">{c}</td>' for c, a in zip(row, align)) + "</tr>"
                   for row in rows)
    attrs = f' class="{esc(cls)}"' if cls else ""
    return f"<table{attrs}><thead><tr>{top}</tr></thead><tbody>{body}</tbody></table>"


def swatch(colour: str) -> str:
    """A coloured square before a label (a ■ character: it shows, uncoloured, even with no styles)."""
    return f'<span style="color:{esc(colour)}" aria-hidden="true">■</span> '


def muted(inner: str) -> str:
    return f'<span class="muted" style="color:{MUTED}">{inner}</span>'


def bad(inner: str) -> str:
    """Something wrong (NaN/Inf, a leak): bold, and red where styles apply."""
    return f'<b class="bad" style="color:{RED}">{inner}</b>'
