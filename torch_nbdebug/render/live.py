"""Live views: a small widget shown as soon as a cell starts, updated while it runs, replaced at the end.

The whole API::

    live = LiveDisplay(title, progress, fallback=display)  # live only under an ipykernel shell
    live.start()        # show the live view now (no-op without a live front end)
    live.tick()         # call at each step (optimizer step...): counts it; pushes an update when due
    live.update()       # push an update now (progress() is called, its panels are sent)
    live.show(report)   # the final view replaces the live one in place (or ``fallback(report)``)
    live.close()        # stop; a live view never replaced is cleared; always call it (finally)

``LiveDisplay`` is also a context manager (``start`` on enter, ``close`` on exit).

- **Front end.** A live view needs an ipykernel shell (``ZMQInteractiveShell``): its comm messages
  reach the front end while the kernel is busy. A plain IPython terminal, a script, a batch run
  (nbclient, ``nbconvert --execute``, papermill: their requests allow no stdin) or
  ``TORCH_NBDEBUG_LIVE=0`` get no live view and no extra output; :func:`live_frontend` decides.
- **Replacement, not accumulation.** The live view is published with a ``display_id`` and replaced by
  the final view with ``update_display_data``, where the live one was: a saved notebook holds the final
  view only. When there is no final view the live one is replaced by an empty text output. The live
  widget is closed when replaced (its comm and state go away).
- **Cost.** :meth:`LiveDisplay.tick` adds one to a counter and compares a monotonic clock with the
  next due time (:class:`RateLimiter`, at most ``1 / interval`` updates per second); ``progress()`` is
  called only when an update is due, so device values are read then and never per step. A failing
  ``progress()`` stops the updates (a note is shown) and never breaks the user's code.
- **Progress.** ``progress()`` returns a :class:`Progress`: a one-line ``status`` and ``panels``, each a
  small JSON dict drawn by ``static/live.js``: ``lines`` (series over x, optionally log-scale),
  ``stack`` (stacked areas, e.g. memory by category over time) or ``table`` (rows of text).
  Elapsed time ticks in the browser between updates.

This module never imports IPython (only ``magics/`` does): the shell is passed in, or read from an
IPython already loaded by the running kernel.
"""
from __future__ import annotations

import os
import sys
import time
import uuid
from typing import Any, Callable, Literal, Optional, TypedDict, Union

import traitlets

from torch_nbdebug.render.bundle import WIDGET_MIME, bundle
from torch_nbdebug.render.html import esc, stylesheet
from torch_nbdebug.render.widget import View, esm_path

__all__ = ["LiveDisplay", "LiveView", "RateLimiter", "Progress", "LinesPanel", "StackPanel", "TablePanel",
           "live_frontend", "DEFAULT_INTERVAL", "MAX_POINTS"]

DEFAULT_INTERVAL = 0.25  # seconds between updates: at most 4 per second
MAX_POINTS = 400         # points per series sent to the browser (older ones are thinned by the caller)


class Series(TypedDict):
    name: str
    y: list[Optional[float]]


class LinesPanel(TypedDict, total=False):
    kind: Literal["lines"]
    title: str
    x: list[float]
    xlabel: str
    series: list[Series]
    log: bool
    unit: str  # "" or "bytes": how y values are formatted


class StackPanel(TypedDict, total=False):
    kind: Literal["stack"]
    title: str
    x: list[float]
    xlabel: str
    series: list[Series]
    unit: str


class TablePanel(TypedDict, total=False):
    kind: Literal["table"]
    title: str
    columns: list[str]
    rows: list[list[str]]


Panel = Union[LinesPanel, StackPanel, TablePanel]


class Progress(TypedDict, total=False):
    status: str         # one line: "3 births so far", "peak 1.2 GB"
    panels: list[Panel]
    alert: bool         # the status is bad news (drawn in red)


class RateLimiter:
    """``due()`` is True at most once per ``interval`` seconds; it reads a monotonic clock only."""

    def __init__(self, interval: float = DEFAULT_INTERVAL, clock: Callable[[], float] = time.monotonic) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be a positive number of seconds, got {interval!r}")
        self.interval, self._clock = interval, clock
        self._next = clock() + interval  # the view was just shown: the first update waits one interval

    def due(self) -> bool:
        now = self._clock()
        if now < self._next:
            return False
        self._next = now + self.interval
        return True


def live_frontend(shell: Any = None) -> Any:
    """The shell when its front end can show a live view while the kernel is busy, else None.

    That is an ipykernel shell (comm messages go out on IOPub while a cell runs); a terminal IPython,
    a plain script or ``TORCH_NBDEBUG_LIVE=0`` in the environment mean no live view.
    """
    if os.environ.get("TORCH_NBDEBUG_LIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    if shell is None:
        ipython = sys.modules.get("IPython")  # a kernel has imported it; if nothing has, there is no kernel
        shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or getattr(shell, "kernel", None) is None:
        return None
    if not any(k.__module__.startswith("ipykernel.") and k.__name__ == "ZMQInteractiveShell" for k in type(shell).__mro__):
        return None
    # Batch runners (nbclient, nbconvert --execute, papermill) send execute requests without stdin;
    # front ends a person watches (JupyterLab, Notebook, VS Code) allow it. ipykernel keeps the flag.
    if getattr(shell.kernel, "_allow_stdin", True) is False:
        return None
    return shell


class LiveView(View):
    """The live widget: a header (title, steps, elapsed, status) over the progress panels."""

    _esm = esm_path("live.js")
    _css = esm_path("base.css")
    title = traitlets.Unicode("").tag(sync=True)
    running = traitlets.Bool(True).tag(sync=True)
    steps = traitlets.Int(0).tag(sync=True)
    elapsed = traitlets.Float(0.0).tag(sync=True)  # seconds at the last update; the browser ticks on
    status = traitlets.Unicode("").tag(sync=True)
    alert = traitlets.Bool(False).tag(sync=True)
    panels: traitlets.List[Any] = traitlets.List().tag(sync=True)
    updates = traitlets.Int(0).tag(sync=True)       # how many updates were pushed (tests, debugging)


def running_text(title: str) -> str:
    return f"{title}: running (the report replaces this view when the cell ends)"


def running_html(title: str) -> str:
    return (f'<div class="tnd">{stylesheet()}<div class="card info"><b>{esc(title)}</b>: running '
            f'<span class="muted">(the report replaces this view when the cell ends)</span></div></div>')


class LiveDisplay:
    """One live view for one cell: see the module docstring for the protocol."""

    def __init__(self, title: str, progress: Callable[[], Progress], *, fallback: Callable[[Any], Any],
                 shell: Any = None, enabled: bool = True, interval: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.title = title
        self.shell = live_frontend(shell) if enabled else None
        self.active = self.shell is not None
        self.steps = 0
        self.error: Optional[str] = None  # why updates stopped (progress() raised)
        self._progress, self._fallback, self._clock = progress, fallback, clock
        self._interval = DEFAULT_INTERVAL if interval is None else interval
        self._limiter: Optional[RateLimiter] = None
        self._view: Optional[LiveView] = None
        self._display_id = f"tnd-live-{uuid.uuid4().hex}"
        self._shown = self._replaced = False
        self._started = 0.0

    # -- protocol ---------------------------------------------------------------------------
    def start(self) -> "LiveDisplay":
        if not self.active or self._shown:
            return self
        self._started = self._clock()
        self._view = LiveView(title=self.title)
        self._publish(bundle(running_text(self.title), running_html(self.title), self._view), update=False)
        self._shown = True
        self._limiter = RateLimiter(self._interval, self._clock)
        return self

    def tick(self) -> None:
        """One step done; an update is pushed when one is due (cheap otherwise)."""
        self.steps += 1
        limiter = self._limiter
        if limiter is not None and limiter.due():
            self.update()

    def update(self) -> None:
        view = self._view
        if view is None or self.error is not None:
            return
        try:
            progress = self._progress()
        except Exception as exc:  # noqa: BLE001 - a live view must never break the user's code
            self.error = f"live updates stopped: {type(exc).__name__}: {exc}"
            progress = Progress(status=self.error, alert=True)
        with view.hold_sync():  # one comm message per update
            view.steps = self.steps
            view.elapsed = round(self._clock() - self._started, 3)
            view.status = progress.get("status", "")
            view.alert = bool(progress.get("alert", False))
            if "panels" in progress:
                view.panels = list(progress["panels"])
            view.updates += 1

    def show(self, obj: Any) -> None:
        """Show the final view: in place of the live one when there is one, else with ``fallback``."""
        if not self._shown or self._replaced or self.shell is None:
            self._fallback(obj)
            return
        data, metadata = self.shell.display_formatter.format(obj)
        self._replace(data, metadata)

    def close(self) -> None:
        """Stop updating; clear a live view that no final view replaced; close the widget's comm."""
        self._limiter = None
        try:
            if self._shown and not self._replaced:
                self._replace({"text/plain": ""}, {})
        finally:
            self._close_view()

    def _replace(self, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        # JupyterLab re-renders an updated output in place when its preferred MIME type is unchanged:
        # a widget view replaced by another one would reuse the live view's renderer, which hides
        # itself for good once the live widget is closed. So a widget replacement goes through an
        # empty text output first (a fresh renderer for the final view), with the live widget closed.
        self._close_view()
        if WIDGET_MIME in data:
            self._publish({"text/plain": ""}, update=True)
        self._publish(data, metadata=metadata, update=True)
        self._replaced = True

    def _close_view(self) -> None:
        view, self._view = self._view, None
        self._limiter = None
        if view is not None:
            view.close()

    def __enter__(self) -> "LiveDisplay":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _publish(self, data: dict[str, Any], metadata: Optional[dict[str, Any]] = None, *, update: bool) -> None:
        if self.shell is None:  # not live: nothing is shown, nothing to update
            return
        self.shell.display_pub.publish(data=data, metadata=metadata or {},
                                       transient={"display_id": self._display_id}, update=update)
