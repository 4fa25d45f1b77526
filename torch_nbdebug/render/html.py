"""Small helpers for static HTML/SVG: escaping and a shared stylesheet.

Every user-provided string (module names, op names, variable names) goes through :func:`esc`.
"""
from __future__ import annotations

import html
from importlib import resources

__all__ = ["esc", "stylesheet", "static_text"]


def esc(value: object) -> str:
    """Escape any value for HTML text or a quoted attribute."""
    return html.escape(str(value), quote=True)


def static_text(name: str) -> str:
    """Read a file shipped in ``torch_nbdebug/render/static`` (ES modules, CSS)."""
    return resources.files("torch_nbdebug.render").joinpath("static", name).read_text(encoding="utf-8")


def stylesheet() -> str:
    """The shared CSS, inlined into every static view so it renders with no network."""
    return f"<style>{static_text('base.css')}</style>"
