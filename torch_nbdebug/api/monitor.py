"""Python twin of ``%%monitor``: ``with monitor("loss", "opt.param_groups[0]['lr']") as mon:``.

At every (or every ``every``-th) optimizer step the expressions are evaluated where
``optimizer.step()`` is called, else where the ``with`` statement is (or in ``namespace=``), with
per-layer gradient norm and update/parameter ratio. ``mon.history`` is what was recorded (also while the block runs),
``mon.alerts`` the rules that fired; ``mon`` displays as the interactive view, and
``mon.to_tensorboard(logdir)`` writes TensorBoard event files. ``live=True`` shows a live view while
the block runs (under a Jupyter kernel; nothing otherwise), replaced by the final view at the end.
"""
from __future__ import annotations

import os
import types
from typing import Any, Callable, Mapping, Optional, Union

from torch_nbdebug.api._block import RecorderBlock
from torch_nbdebug.data.monitor import Alert, MonitorHistory, Rules, Status
from torch_nbdebug.errors import InputError
from torch_nbdebug.process.monitor import alerts as find_alerts
from torch_nbdebug.record.monitor import MonitorRecorder, Scope
from torch_nbdebug.record.source import caller_frame
from torch_nbdebug.render.bundle import Displayable

__all__ = ["monitor", "Monitor", "MonitorHistory", "MonitorRules", "Rules", "Alert"]

Watched = Union[str, Callable[[], Any]]
MonitorRules = Rules  # the name exported as torch_nbdebug.MonitorRules


class Monitor(RecorderBlock[MonitorRecorder], Displayable):
    """A monitored run: a context manager while it records, then the result (``history``, ``alerts``)."""

    _reused = "this monitor(...) block was already used: call monitor(...) again"

    def __init__(self, recorder: MonitorRecorder, rules: Rules, tensorboard: Optional[str], live: bool) -> None:
        self._recorder: Optional[MonitorRecorder] = recorder
        self._entered = False
        self._history: Optional[MonitorHistory] = None
        self.rules = rules
        self.tensorboard = tensorboard
        self.live: Any = None  # a render.live.LiveDisplay: started on enter, ticked at each recorded step
        self._own_live = live
        self._alerts: Optional[tuple[Alert, ...]] = None       # of the final history
        self._seen: tuple[int, tuple[Alert, ...]] = (0, ())    # rows checked by the live view, and their alerts

    # -- recording -------------------------------------------------------------------------
    def __enter__(self) -> "Monitor":
        recorder = self._claim()
        if self._own_live and self.live is None:
            from torch_nbdebug.render.live import LiveDisplay

            self.live = LiveDisplay(self._live_title(), self.progress, fallback=lambda report: None)
        if self.live is not None:
            self.live.start()
            recorder.on_step = self.live.tick
        recorder.__enter__()
        return self

    def _end(self, recorder: MonitorRecorder, status: Status) -> None:
        self._history = recorder.finish(status)  # removes the hooks first
        if self.tensorboard is not None:
            self.to_tensorboard(self.tensorboard)

    def _ended(self) -> None:
        if self._own_live and self.live is not None:
            try:
                if self._history is not None:
                    self.live.show(self)
            finally:
                self.live.close()

    def _live_title(self) -> str:
        names = self._recorder.expressions if self._recorder is not None else ()
        return "%%monitor " + ", ".join(names)

    # -- results ---------------------------------------------------------------------------
    @property
    def history(self) -> MonitorHistory:
        """What was recorded: final after the block, a snapshot of the steps so far while it runs."""
        if self._history is not None:
            return self._history
        if self._recorder is None or not self._entered:
            raise InputError("nothing recorded yet: use monitor(...) as `with monitor(\"loss\") as mon:` "
                             "around your training loop")
        return self._recorder.history("running")

    @property
    def alerts(self) -> tuple[Alert, ...]:
        """The rules that fired (see :class:`Rules`), in step order."""
        if self._history is None:
            return self._live_alerts(self.history)
        if self._alerts is None:
            self._alerts = self._live_alerts(self._history)
        return self._alerts

    def _live_alerts(self, history: MonitorHistory) -> tuple[Alert, ...]:
        """Alerts with each row checked once: the rows seen by an earlier call are not scanned again."""
        start, before = self._seen
        found = find_alerts(history, self.rules, start=start, before=before) if start <= len(history) else \
            find_alerts(history, self.rules)
        self._seen = (len(history), found)
        return found

    def progress(self) -> Any:
        """The live view's panels now (called by the live view, a few times per second at most)."""
        from torch_nbdebug.render import monitor as render

        history = self.history
        return render.progress(history, self._live_alerts(history))

    def to_tensorboard(self, logdir: Union[str, "os.PathLike[str]"]) -> str:
        """Write the history as TensorBoard event files in ``logdir`` (returns it)."""
        from torch_nbdebug.api.tensorboard import to_tensorboard

        return to_tensorboard(self.history, logdir, rules=self.rules)

    def __getitem__(self, name: str) -> Any:
        """``mon["loss"]``: one recorded series as a numpy array."""
        return self.history[name]

    # -- display ---------------------------------------------------------------------------
    def text(self) -> str:
        from torch_nbdebug.render import monitor as render

        return render.text(self.history, self.alerts)

    def html(self) -> str:
        from torch_nbdebug.render import monitor as render

        return render.html(self.history, self.alerts)

    def widget(self) -> Any:
        from torch_nbdebug.render import monitor as render

        return render.widget(self.history, self.alerts)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        if self._history is None and not self._entered:
            return {"text/plain": "monitor(...): not started (use it as a `with` block)"}
        return super()._repr_mimebundle_(include, exclude)

    def __repr__(self) -> str:
        if self._history is None and not self._entered:
            return "monitor(...): not started (use it as a `with` block)"
        return self.text()


def monitor(*expressions: Watched, every: int = 1, namespace: Optional[Mapping[str, Any]] = None,
            rules: Optional[Rules] = None, layers: bool = True, ratio: bool = True,
            tensorboard: Optional[Union[str, "os.PathLike[str]"]] = None, live: bool = False) -> Monitor:
    """Watch values at every ``every``-th optimizer step of the loop run inside the ``with`` block.

    ``expressions`` are Python expressions (``"loss"``, ``"opt.param_groups[0]['lr']"``) or
    callables taking no argument. Names are looked up where ``optimizer.step()`` is called, then in
    ``namespace`` (default: where ``monitor`` is called). A tensor value must have one element; a
    copy of it stays on its device until the view reads it. ``layers`` records each layer's exact
    gradient norm, ``ratio`` its update/parameter ratio ‖Δw‖/‖w‖ (estimated from a fixed sample of
    at most 1024 elements per parameter, exact for smaller ones). ``rules`` sets the alerts (see
    :class:`Rules`); ``tensorboard`` writes event files to that directory at the end.
    """
    names, codes = _compile(expressions)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise InputError(f"every must be a whole number of optimizer steps >= 1, got {every!r}")
    if rules is None:
        rules = Rules()
    elif not isinstance(rules, Rules):
        raise InputError(f"rules must be a torch_nbdebug.monitor Rules(...), got {type(rules).__name__}")
    if tensorboard is not None and (not isinstance(tensorboard, (str, os.PathLike)) or not str(tensorboard).strip()):
        raise InputError(f"tensorboard must be a directory path, got {tensorboard!r}")
    if tensorboard is not None:
        from torch_nbdebug.api.tensorboard import check_logdir, require_tensorboard

        require_tensorboard()  # missing TensorBoard, or a directory that cannot be made, is said now, not after a long run
        check_logdir(tensorboard)
    if namespace is not None and not isinstance(namespace, Mapping):
        raise InputError(f"monitor: namespace must be a mapping of names to objects (like globals()), "
                         f"not {type(namespace).__name__}")
    if namespace is not None:
        scope = Scope(namespace=namespace)
    else:
        frame = caller_frame()
        scope = Scope(frame=frame)
        del frame
    recorder = MonitorRecorder(names, codes, scope, every=every, layers=bool(layers), ratio=bool(ratio))
    return Monitor(recorder, rules, None if tensorboard is None else str(tensorboard), live)


def _compile(expressions: tuple[Watched, ...]) -> tuple[tuple[str, ...], tuple[Any, ...]]:
    if not expressions:
        raise InputError('monitor needs at least one value to watch, e.g. monitor("loss")')
    names: list[str] = []
    codes: list[Union[types.CodeType, Callable[[], Any]]] = []
    for item in expressions:
        if isinstance(item, str):
            text = item.strip()
            try:
                codes.append(compile(text, "<monitor>", "eval"))
            except SyntaxError as exc:
                raise InputError(f"monitor: {item!r} is not a Python expression ({exc.msg})") from None
            names.append(text)
        elif callable(item):
            codes.append(item)
            names.append(getattr(item, "__name__", None) or repr(item))
        else:
            raise InputError(f"monitor watches expressions (strings like \"loss\") or callables; got "
                             f"{type(item).__name__}")
    if len(set(names)) != len(names):
        raise InputError(f"monitor: each value is watched once; {names} repeats one")
    return tuple(names), tuple(codes)
