"""Every output is a MIME bundle: text/plain, a self-contained static view, then the live widget.

Notebook front ends pick the richest type they can show: a live kernel shows the widget; a terminal
shows the text. nbconvert and GitHub also prefer the widget view and draw nothing when the notebook
saved no widget state, so notebooks meant to be read without a kernel (ours in ``notebooks/``) are
saved with the widget view dropped from each output: the static HTML (inline SVG/PNG) then shows, and
running the cell brings the widget back. Result objects implement ``_repr_mimebundle_`` through
:func:`bundle`.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


def bundle(text: str, html: Optional[str] = None, widget: Any = None) -> dict[str, Any]:
    """Merge the three layers of an output into one MIME bundle dict."""
    data: dict[str, Any] = {"text/plain": text}
    if html is not None:
        data["text/html"] = html
    if widget is not None:
        view = widget._repr_mimebundle_()
        view = view[0] if isinstance(view, tuple) else view
        if WIDGET_MIME in view:
            data[WIDGET_MIME] = view[WIDGET_MIME]
    return data


class Displayable:
    """Mixin for result objects: ``text()``, ``html()`` and an optional ``widget()`` make the bundle.

    The widget is built lazily on display (so a report used only in code costs no widget), and a
    failure to build it degrades to the static view instead of hiding the result.
    """

    text: Callable[[], str]
    html: Callable[[], str]

    def widget(self) -> Any:  # pragma: no cover - overridden where a widget exists
        return None

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        try:
            live = self.widget()
        except ImportError:
            live = None
        return bundle(self.text(), self.html(), live)

    def __repr__(self) -> str:
        return self.text()
