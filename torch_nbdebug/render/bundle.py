"""Every output is a MIME bundle: text/plain, a self-contained static view, then the live widget.

Notebook front ends pick the richest type they can show: a live kernel shows the widget; a terminal
shows the text. nbconvert and GitHub also prefer the widget view and draw nothing when the notebook
saved no widget state, so notebooks meant to be read without a kernel (ours in ``notebooks/``) are
saved with the widget view dropped from each output: the static HTML then shows, and running the
cell brings the widget back. Result objects implement ``_repr_mimebundle_`` through :func:`bundle`.

The static HTML survives the sanitizer of a notebook opened without trusting it (JupyterLab,
Notebook 7 strip ``<svg>`` and ``<style>``): semantic HTML plus figures as
``<img src="data:image/png;base64,...">`` (:mod:`torch_nbdebug.render.figures`). Stricter readers
drop or escape every ``<img>`` inside HTML — nbconvert's ``--HTMLExporter.sanitize_html=True``
escapes it into text — but show ``image/png`` outputs; for them :func:`split_figures` turns one saved
output into its HTML pieces and its pictures as separate ``image/png`` outputs, in order.

A widget lives in the kernel until it is closed, with its whole payload (a graph's SVG, a run's
curves). Running a cell again clears its outputs in the front end, so the widgets its last run showed
are closed when the same cell (by the cell id the front end sends: JupyterLab, Notebook 7, VS Code)
shows its next ones (:func:`retire_earlier`): re-running a cell 50 times keeps one widget, not 50.
"""
from __future__ import annotations

import re
import sys
import weakref
from html.parser import HTMLParser
from typing import Any, Callable, Optional

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
# How render.figures.img_tag writes a figure: class first, then the inline PNG, alt, title, size.
FIGURE = re.compile(r'<img class="tnd-figure[^"]*" src="data:image/png;base64,([A-Za-z0-9+/=]+)" alt="([^"]*)"'
                    r'[^>]*?width="(\d+)" height="(\d+)">')


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


# cell id -> (the run that displayed them, weak references to the widgets it displayed)
_SHOWN: dict[str, tuple[Any, list[Any]]] = {}


def _running_cell() -> Optional[tuple[str, Any]]:
    """(cell id, this run) of the cell running now, when the front end sent a cell id. The run is
    IPython's ``ExecutionInfo`` of the cell (one per run), else the execution count."""
    ipython = sys.modules.get("IPython")  # never imported here: a kernel has it loaded already
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None:
        return None
    info = getattr(getattr(getattr(shell, "displayhook", None), "exec_result", None), "info", None)
    cell = getattr(info, "cell_id", None)
    if cell:
        return (cell, info) if isinstance(cell, str) else None
    header = getattr(shell, "parent_header", None)
    meta = header.get("metadata") if isinstance(header, dict) else None
    cell = meta.get("cellId") if isinstance(meta, dict) else None
    return (cell, getattr(shell, "execution_count", None)) if isinstance(cell, str) and cell else None


def retire_earlier(widget: Any) -> None:
    """Note ``widget`` as shown by the running cell; close the widgets an earlier run of the same
    cell showed (the front end cleared their outputs when the cell started again)."""
    running = _running_cell()
    if running is None:
        return
    cell, run = running
    last = _SHOWN.get(cell)
    if last is not None and (last[0] is run if not isinstance(run, int) else last[0] == run):
        last[1].append(weakref.ref(widget))
        return
    _SHOWN[cell] = (run, [weakref.ref(widget)])
    for ref in last[1] if last is not None else ():
        old = ref()
        if old is not None and old is not widget:
            layout = getattr(old, "layout", None)  # a model of its own, kept until closed too
            old.close()
            if layout is not None and hasattr(layout, "close"):
                layout.close()


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
        if live is not None:
            retire_earlier(live)
        return bundle(self.text(), self.html(), live)

    def __repr__(self) -> str:
        return self.text()


def split_figures(output: dict[str, Any]) -> list[dict[str, Any]]:
    """One saved output (an nbformat ``display_data``/``execute_result`` dict) as a list of outputs:
    the HTML before each figure, the figure as ``image/png`` (its alt text as ``text/plain``), the
    HTML after it, ... An output without our figures, or still holding a widget view, comes back
    as it was. The first piece keeps the output's type, text/plain and metadata.
    """
    data = output.get("data", {})
    html = data.get("text/html")
    if isinstance(html, list):
        html = "".join(html)
    if not isinstance(html, str) or WIDGET_MIME in data or not FIGURE.search(html):
        return [output]
    import html as html_lib

    pieces: list[dict[str, Any]] = []
    at = 0
    for found in FIGURE.finditer(html):
        pieces.append({"text/html": html[at:found.start()]})
        b64, alt, width, height = found.groups()
        pieces.append({"image/png": b64, "text/plain": html_lib.unescape(alt), "_size": (int(width), int(height))})
        at = found.end()
    pieces.append({"text/html": html[at:]})
    _balance([piece for piece in pieces if "text/html" in piece])
    out: list[dict[str, Any]] = []
    for piece in pieces:
        if "text/html" in piece and not re.sub(r"<[^>]*>|\s", "", piece["text/html"]):
            continue  # only tags left (a wrapper's closing </div>): nothing to show
        size = piece.pop("_size", None)
        meta = {"image/png": {"width": size[0], "height": size[1]}} if size else {}
        out.append({"output_type": "display_data", "data": piece, "metadata": meta})
    first = out[0]
    first["output_type"] = output.get("output_type", "display_data")
    if "execution_count" in output:
        first["execution_count"] = output["execution_count"]
    first["metadata"] = {**output.get("metadata", {}), **first["metadata"]}
    first["data"] = {"text/plain": data.get("text/plain", ""), **first["data"]}
    return out


_VOID = frozenset("area base br col embed hr img input link meta param source track wbr".split())


class _Tags(HTMLParser):
    """The elements left open at the end of some HTML (their start tags as written)."""

    def __init__(self, open_tags: list[tuple[str, str]]) -> None:
        super().__init__(convert_charrefs=False)
        self.open = list(open_tags)

    def handle_starttag(self, tag: str, attrs: Any) -> None:
        if tag not in _VOID:
            self.open.append((tag, self.get_starttag_text() or f"<{tag}>"))

    def handle_endtag(self, tag: str) -> None:
        for k in range(len(self.open) - 1, -1, -1):
            if self.open[k][0] == tag:
                del self.open[k:]
                return


def _balance(pieces: list[dict[str, Any]]) -> None:
    """Make each HTML piece well formed on its own, in place: a viewer that pastes outputs one after
    the other (nbconvert's HTML) must not nest the next cell inside an element a piece left open. The
    elements open where a figure was cut are closed before it and reopened after it."""
    open_tags: list[tuple[str, str]] = []
    for piece in pieces:
        html = piece["text/html"]
        parser = _Tags(open_tags)
        parser.feed(html)
        parser.close()
        prefix = "".join(start for _, start in open_tags)
        suffix = "".join(f"</{tag}>" for tag, _ in reversed(parser.open))
        piece["text/html"] = prefix + html + suffix
        open_tags = parser.open
