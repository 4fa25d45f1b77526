"""Python twin of ``%%profile``: ``with profile() as prof:`` around training steps, then ``prof.verdict``.

Wires the recorder (torch.profiler, module ranges, the line sampler: ``record/profile.py``) to the
summary (``process/profile.py``) and the views (``render/profile.py``). ``prof`` is the result once
the block has ended: ``verdict`` (why the step is slow, with the fix), ``breakdown`` (per step, time by
category, adding up to the step), ``by_module``, ``by_line``, ``ops``, ``compare(other)``,
``to_json()`` / ``Profile.from_json``, ``export_chrome_trace(path)``.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from typing import Any, Mapping, Optional, Union

from torch_nbdebug.data.profile import (Comparison, LineRow, ModuleRow, OpRow, Pattern, ProfileData, Status, Step,
                                        Verdict)
from torch_nbdebug.api._block import RecorderBlock
from torch_nbdebug.errors import InputError
from torch_nbdebug.process.profile import summarize
from torch_nbdebug.process.profile_compare import compare as compare_data
from torch_nbdebug.record.profile import ProfileRecorder
from torch_nbdebug.record.source import caller_namespace
from torch_nbdebug.render.bundle import Displayable

__all__ = ["profile", "Profile", "ProfileComparison"]

PathLike = Union[str, "os.PathLike[str]"]


class Profile(RecorderBlock[ProfileRecorder], Displayable):
    """A profiled block: a context manager while it runs, then the report."""

    _reused = "this profile() block was already used: call torch_nbdebug.profile() again"

    def __init__(self, recorder: Optional[ProfileRecorder], warmup: int, trace: Optional[str] = None,
                 tensorboard: Optional[str] = None, data: Optional[ProfileData] = None, keep: bool = False) -> None:
        self._recorder = recorder
        self._keep = keep
        self._warmup = warmup
        self._trace_path = trace
        self._tensorboard = tensorboard
        self._data = data
        self._entered = data is not None
        self._kept: Optional[ProfileRecorder] = None   # holds the profiler when the trace is kept

    # -- recording -------------------------------------------------------------------------
    def __enter__(self) -> "Profile":
        self._claim().__enter__()
        return self

    def _end(self, recorder: ProfileRecorder, status: Status) -> None:
        capture = recorder.finish(status)  # removes everything first
        if self._trace_path is not None:
            recorder.export_chrome_trace(self._trace_path)
        if self._tensorboard is not None:
            _trace_for_tensorboard(recorder, self._tensorboard)
        self._kept = recorder if self._keep else None
        if not self._keep:
            recorder.profiler = None  # only the summary is kept
        self._data = summarize(capture, self._warmup)
        if self._trace_path is not None:
            self._data = replace(self._data, trace=self._trace_path)
        if self._tensorboard is not None:
            self.to_tensorboard(self._tensorboard)

    # -- results ---------------------------------------------------------------------------
    @property
    def data(self) -> ProfileData:
        if self._data is None:
            raise InputError("nothing profiled yet: use it as `with torch_nbdebug.profile() as prof:` around "
                             "your training steps, then read prof.verdict")
        return self._data

    @property
    def verdict(self) -> Verdict:
        """Why the step is slow: ``verdict.kind`` (data, host, launch, sync, compute, memory, balanced),
        ``verdict.share`` of the step, ``verdict.summary``, ``verdict.fix``, ``verdict.line``, ``verdict.module``."""
        return self.data.verdict

    @property
    def breakdown(self) -> tuple[Step, ...]:
        """Per profiled step: ``ms`` and ``categories`` (ms by category, adding up to ``ms``)."""
        return self.data.steps

    @property
    def by_module(self) -> tuple[ModuleRow, ...]:
        return self.data.modules

    @property
    def by_line(self) -> tuple[LineRow, ...]:
        return self.data.lines

    @property
    def ops(self) -> tuple[OpRow, ...]:
        return self.data.ops

    @property
    def patterns(self) -> tuple[Pattern, ...]:
        """TorchTidy's anti-patterns found (torch.profiler._pattern_matcher), where this torch has them."""
        return self.data.patterns

    @property
    def step_ms(self) -> float:
        return self.data.step_ms

    def compare(self, other: "Profile") -> "ProfileComparison":
        """What changed from ``other`` (before) to this profile (after): ``prof_after.compare(prof_before)``."""
        if not isinstance(other, Profile):
            raise InputError(f"compare takes another profile (the result of %%profile -o or profile()), got "
                             f"{type(other).__name__}")
        return ProfileComparison(compare_data(other.data, self.data))

    def to_dict(self) -> dict[str, Any]:
        """The summary as plain data (what ``to_json`` writes and a script run's rank file holds)."""
        return self.data.to_dict()

    def to_json(self) -> str:
        """The summary as JSON (``Profile.from_json`` reads it back)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        try:
            raw = json.loads(text)
        except (TypeError, ValueError) as exc:
            raise InputError(f"not a %%profile report: {exc}") from None
        return cls(None, 0, data=ProfileData.from_dict(raw))

    def export_chrome_trace(self, path: PathLike) -> str:
        """Write the profiled steps as a Chrome/Perfetto trace (open it at ui.perfetto.dev)."""
        target = os.fspath(path)
        if self._kept is not None:
            self._kept.export_chrome_trace(target)
        elif self._data is not None and self._data.trace and os.path.exists(self._data.trace):
            if os.path.abspath(self._data.trace) != os.path.abspath(target):
                shutil.copyfile(self._data.trace, target)
        else:
            raise InputError("the trace was not kept (only the summary is): profile with "
                             "profile(keep_trace=True) or %%profile --trace FILE")
        return target

    def to_tensorboard(self, logdir: PathLike) -> str:
        """Write time by category per step and the verdict as TensorBoard event files in ``logdir``."""
        from torch_nbdebug.api.tensorboard import to_tensorboard

        return to_tensorboard(self.data, logdir)

    # -- display ---------------------------------------------------------------------------
    def text(self) -> str:
        from torch_nbdebug.render.profile import text

        return text(self.data)

    def html(self) -> str:
        from torch_nbdebug.render.profile import html

        return html(self.data)

    def widget(self) -> Any:
        from torch_nbdebug.render.profile import widget

        return widget(self.data)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        if self._data is None:
            return {"text/plain": repr(self)}
        return super()._repr_mimebundle_(include, exclude)

    def __repr__(self) -> str:
        if self._data is None:
            return "profile(): not finished (use it as a `with` block around training steps)"
        return self.text()


class ProfileComparison(Displayable):
    """Two profiles side by side (``after.compare(before)``)."""

    def __init__(self, data: Comparison) -> None:
        self.data = data

    def __getattr__(self, name: str) -> Any:
        if name == "data":
            raise AttributeError(name)
        return getattr(self.data, name)

    def text(self) -> str:
        from torch_nbdebug.render.profile import comparison_text

        return comparison_text(self.data)

    def html(self) -> str:
        from torch_nbdebug.render.profile import comparison_html

        return comparison_html(self.data)


def _trace_for_tensorboard(recorder: ProfileRecorder, logdir: str) -> None:
    """The trace where TensorBoard's profile readers look for it (``tensorboard_trace_handler``'s place)."""
    import socket
    import time

    os.makedirs(logdir, exist_ok=True)
    name = f"{socket.gethostname()}_{os.getpid()}.{int(time.time() * 1000)}.pt.trace.json"
    recorder.export_chrome_trace(os.path.join(logdir, name))


def _count(value: Any, what: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InputError(f"{what} must be a whole number >= {least}, got {value!r}")
    return value


def profile(namespace: Optional[Mapping[str, Any]] = None, *, steps: Optional[int] = 20, warmup: int = 1,
            trace: Optional[PathLike] = None, keep_trace: bool = False, tensorboard: Optional[PathLike] = None,
            interval: float = 0.001, tidy: bool = False) -> Profile:
    """Profile the training steps run inside the ``with`` block and say why a step is slow.

    Steps are the optimizer's steps (else the DataLoader's batches, else the whole block is one step);
    the first ``warmup`` are left out, and after ``steps`` more the profiler stops (``steps=None``: all of
    them). Modules are named from ``namespace`` (default: where ``profile`` is called). ``trace`` writes the
    profiled steps as a Chrome/Perfetto trace; ``keep_trace`` keeps it in memory for ``export_chrome_trace``;
    ``tensorboard`` writes the breakdown as event files (and the trace, for TensorBoard's profile readers).
    The sampler looks at the running line every ``interval`` seconds. ``tidy`` also records shapes and
    Python stacks and lists torch's TorchTidy anti-patterns (``prof.patterns``): as dear as the profiler
    with ``record_shapes=True, with_stack=True``.
    """
    if steps is not None:
        _count(steps, "steps", 1)
    _count(warmup, "warmup", 0)
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0.0001 <= interval <= 1:
        raise InputError(f"interval is seconds between looks at the running line, 0.0001 to 1, got {interval!r}")
    paths = []
    for name, value in (("trace", trace), ("tensorboard", tensorboard)):
        if value is not None and (not isinstance(value, (str, os.PathLike)) or not os.fspath(value).strip()):
            raise InputError(f"{name} must be a path, got {value!r}")
        paths.append(None if value is None else os.fspath(value))
    if tensorboard is not None:
        from torch_nbdebug.api.tensorboard import require_tensorboard

        require_tensorboard()
    names = caller_namespace(namespace)  # counts what cannot be inspected; released when the block ends
    recorder = ProfileRecorder(names, steps=steps, warmup=warmup, interval=float(interval),
                               keep_trace=bool(keep_trace) or trace is not None or tensorboard is not None,
                               tidy=bool(tidy))
    return Profile(recorder, warmup, paths[0], paths[1], keep=bool(keep_trace))
