"""Static figures as PNG pictures: the one kind of figure every notebook front end shows.

A notebook opened without trusting it (JupyterLab, Notebook 7: any notebook they did not run) goes
through a sanitizer that strips inline ``<svg>`` and ``<style>`` from ``text/html``, but keeps
``<img src="data:image/png;base64,...">``. So the static layer of every view draws its figures here,
with matplotlib, and embeds them as ``<img>`` with an alt text that says what the picture shows.

Use it from a renderer::

    from torch_nbdebug.render.figures import picture

    def draw(fig):                       # a matplotlib Figure of the requested size, white background
        ax = fig.add_axes((0.1, 0.15, 0.85, 0.8))
        ax.plot(xs, ys)
    html = picture(draw, width=640, height=220, alt="loss per step: 3.2 falling to 0.4")

Rules kept here so no renderer has to know them:

- matplotlib is imported lazily (``import torch_nbdebug`` stays cheap) and only through
  ``matplotlib.figure.Figure`` + the Agg canvas: pyplot is never imported, so the user's current
  figure, open figures and backend are untouched;
- a fixed style (:data:`STYLE`) applies inside ``matplotlib.rc_context`` only while drawing: the
  user's rcParams (a dark style, a big font) neither leak into our figures nor get changed;
- 100 DPI, sizes given in CSS pixels (the ``<img>`` carries the same ``width``/``height``), a
  256-colour palette PNG without metadata (same data, same bytes); a figure is tens of KB: callers downsample long
  series first (``process.memory.decimate`` keeps each bucket's min and max, so peaks survive).
"""
from __future__ import annotations

import base64
import contextlib
import gc
import io
import threading
import warnings
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from torch_nbdebug.data.stats import fmt_number
from torch_nbdebug.render.html import esc

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

__all__ = ["DPI", "STYLE", "png", "picture", "img_tag", "warm_up", "log_axis", "MUTED", "GRID", "TEXT"]

DPI = 100
TEXT, MUTED, GRID = "#1f2328", "#57606a", "#d8dee4"
STYLE: dict[RcKeyType, Any] = {
    "font.family": "DejaVu Sans",  # ships with matplotlib: the same glyphs on every machine
    "font.size": 9.0,
    "axes.edgecolor": MUTED, "axes.labelcolor": MUTED, "axes.linewidth": 0.8,
    "axes.titlesize": 10.0, "axes.titleweight": "bold", "axes.titlecolor": TEXT,
    "xtick.color": MUTED, "ytick.color": MUTED, "xtick.labelsize": 8.0, "ytick.labelsize": 8.0,
    "text.color": TEXT, "figure.facecolor": "white", "axes.facecolor": "white",
    "savefig.facecolor": "white", "legend.fontsize": 8.0, "legend.frameon": False,
    "svg.fonttype": "none", "path.simplify": True, "axes.unicode_minus": False,
}


def _import_drawing() -> None:
    import matplotlib.backends.backend_agg  # noqa: F401 - the modules png() uses, ~0.9 s the first time
    import matplotlib.figure  # noqa: F401
    import matplotlib.ticker  # noqa: F401
    import PIL.Image

    PIL.Image.preinit()  # the format plugins its first save imports


def warm_up() -> None:
    """Import what drawing a picture needs in a background thread (``%load_ext`` calls it): the first
    static view of a session no longer pays matplotlib's import (~0.9 s). Imports only: no figure is
    drawn and no setting read or changed; a picture asked for meanwhile waits for the import as any
    import does. A missing matplotlib is left for :func:`png` to report."""
    def run() -> None:
        try:
            _import_drawing()
        except ImportError:
            pass

    threading.Thread(target=run, name="torch_nbdebug-warm-up", daemon=True).start()


def png(draw: Callable[[Any], None], width: float, height: float) -> bytes:
    """Call ``draw(fig)`` on a fresh ``width`` × ``height`` (CSS px) figure; return its PNG bytes."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with _freed_at_once(), matplotlib.rc_context(STYLE), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a degenerate axis is our drawing's business, not the user's output
        fig = Figure(figsize=(max(round(width), 1) / DPI, max(round(height), 1) / DPI), dpi=DPI)
        canvas = FigureCanvasAgg(fig)
        draw(fig)
        canvas.draw()
        rgb = np.array(canvas.buffer_rgba())[..., :3]
        del fig, canvas
    return _encode(rgb)


INKS, SHADES, CLOSE = 16, 4, 6.0


def _encode(rgb: np.ndarray) -> bytes:
    """A palette of 256 colours (median cut keeps the flat fills exact): a third of the bytes of RGB;
    its edges in a few shades (:func:`fewer_shades`): a third fewer again."""
    from PIL import Image  # matplotlib's own dependency

    quantized = Image.fromarray(rgb).quantize(256, method=Image.Quantize.MEDIANCUT)
    index = np.asarray(quantized)
    palette = np.array(quantized.getpalette() or [], np.uint8).reshape(-1, 3)[:int(index.max()) + 1]
    shaded = fewer_shades(palette, np.bincount(index.ravel(), minlength=len(palette)))
    colours, lut = np.unique(shaded, axis=0, return_inverse=True)  # shades that met: one palette entry
    out = Image.fromarray(lut.reshape(-1).astype(np.uint8)[index], mode="P")
    out.putpalette(colours.reshape(-1).tolist())
    data = io.BytesIO()
    out.save(data, format="png", optimize=True)
    return data.getvalue()


def fewer_shades(colours: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """A palette with its anti-aliased edges in a few shades. An edge pixel of text or a line is a blend
    of the ink (one of the :data:`INKS` colours most ``counts`` pixels have, or the text colours) and the
    white page; its blend is rounded to the nearest of the :data:`SHADES` - 1 shades strictly between the
    two, so an edge stays smooth (never snapped to the ink or to white: a faint line stays, as faint)
    while the PNG compresses far better (agg draws each edge in dozens of shades). The inks themselves,
    and every colour off those blends (a line crossing a fill; within :data:`CLOSE` of 255 per channel
    counts as on), are kept exactly."""
    order = np.argsort(-counts, kind="stable")[:INKS]
    inks = [ink for ink in (*colours[order], _rgb(TEXT), _rgb(MUTED)) if int(np.min(ink)) < 250]
    c = colours.astype(np.float32)
    out = c.copy()
    kept = np.zeros(len(colours), bool)
    kept[order] = True
    for ink in inks:
        base = np.asarray(ink, np.float32)
        d = 255.0 - base
        t = np.clip(((c - base) @ d) / float(d @ d), 0.0, 1.0)
        on = ~kept & (t > 0) & (t < 1) & (np.abs(c - (base + t[:, None] * d)).max(axis=1) <= CLOSE)
        shade = np.clip(np.round(t * SHADES) / SHADES, 1 / SHADES, 1 - 1 / SHADES)
        out[on] = base + shade[on, None] * d
        kept |= on
    return np.round(out).astype(np.uint8)


def _rgb(colour: str) -> np.ndarray:
    return np.array([int(colour[k:k + 2], 16) for k in (1, 3, 5)], np.uint8)


@contextlib.contextmanager
def _freed_at_once() -> Any:
    """Free the figure drawn inside as soon as it is drawn, at a few ms. A matplotlib figure is a web of
    reference cycles (tens of thousands of objects) that only a full garbage collection frees, rare in a
    kernel holding a model: figures piled up until then, and the heap grew by ~1 MB a picture, for good
    (50 %%monitor runs: +52 MB). A full collection frees them but walks the whole heap (~0.17 s with torch
    loaded). So the heap that was there before the picture is frozen (``gc.freeze``: moved aside in
    O(1), left out of collections) while drawing; the collection afterwards walks only what the picture
    made, then the heap is unfrozen as it was. A heap the user froze themselves stays as they froze it:
    then a full collection (the slow way)."""
    if gc.get_freeze_count():
        try:
            yield
        finally:
            gc.collect()
        return
    gc.collect(1)  # the young garbage made before (the cell's): freed now, not promoted by unfreeze to the old heap
    gc.freeze()
    try:
        yield
    finally:
        try:
            gc.collect()
        finally:
            gc.unfreeze()


def log_axis(ax: Any) -> None:
    """Give ``ax`` a log y axis whose ticks read as every view writes numbers (``0.01``, ``1e-07``), not
    as TeX powers of ten: those are drawn through mathtext, whose parser takes ~0.4 s to build the first
    time a session draws one. The same ticks are labelled as matplotlib labels them."""
    from matplotlib.ticker import LogFormatter

    class Plain(LogFormatter):
        def __call__(self, x: float, pos: Any = None) -> str:
            return fmt_number(x, 3) if super().__call__(x, pos) else ""

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(Plain())
    ax.yaxis.set_minor_formatter(Plain(labelOnlyBase=False))


def img_tag(data: bytes, alt: str, width: float, height: float, cls: str = "tnd-figure") -> str:
    """``<img>`` with the PNG inline: kept by every sanitizer that keeps pictures. The ``alt`` text says
    what it shows (once: a ``title`` repeating it would be saved twice)."""
    return (f'<img class="{esc(cls)}" src="data:image/png;base64,{base64.b64encode(data).decode("ascii")}" '
            f'alt="{esc(alt)}" width="{round(width)}" height="{round(height)}">')


def picture(draw: Callable[[Any], None], width: float, height: float, alt: str, cls: str = "tnd-figure") -> str:
    """Draw a figure (see :func:`png`) and return it as an ``<img>`` tag with ``alt`` text."""
    return img_tag(png(draw, width, height), alt, width, height, cls)
