"""Export what a tool recorded as TensorBoard event files: ``to_tensorboard(result, logdir)``.

Written through ``torch.utils.tensorboard.SummaryWriter`` (TensorBoard is an optional extra:
``pip install torch_nbdebug[tensorboard]``), so any TensorBoard, or a notebook-free dashboard that
reads event files, shows the same run:

- a monitor (``%%monitor`` / ``monitor(...)``): each watched value per optimizer step, per-layer
  gradient norm and update/parameter ratio, and the alerts as text;
- a gradient trace (``%%grads`` / ``record_gradients``): per-layer gradient norm and update ratio
  per step, and per-parameter histograms at the steps that kept one;
- a memory timeline (``%%cudamem`` / ``memory_timeline``): bytes by category over time (thinned
  to at most 2,000 points), and the peak as text;
- a nanwatch report (``%%nanwatch`` / ``nanwatch``): the births as a text table;
- a profile (``%%profile`` / ``profile``): time by category per step, and the verdict as text.
"""
from __future__ import annotations

import math
import os
import re
from typing import Any, Union

import numpy as np

from torch_nbdebug.data.grads import GradTrace
from torch_nbdebug.data.memory import CATEGORIES
from torch_nbdebug.data.memory import MemoryTimeline as TimelineData
from torch_nbdebug.data.monitor import MonitorHistory, Rules
from torch_nbdebug.data.nanwatch import NanSummary
from torch_nbdebug.data.profile import CATEGORIES as PROFILE_CATEGORIES
from torch_nbdebug.data.profile import ProfileData
from torch_nbdebug.errors import InputError
from torch_nbdebug.process.grads import layer_arrays
from torch_nbdebug.process.monitor import alerts as find_alerts
from torch_nbdebug.process.monitor import thin

__all__ = ["to_tensorboard", "summary_writer", "require_tensorboard", "clean_tag"]

INSTALL_HINT = "pip install torch_nbdebug[tensorboard]"
_MEMORY_POINTS = 2000
_INVALID_TAG = re.compile(r"[^-/\w.]")  # what SummaryWriter would replace (with a warning per tag)


def clean_tag(text: str) -> str:
    """A TensorBoard tag for a user's expression or layer name: ``opt.param_groups[0]["lr"]`` →
    ``opt.param_groups_0___lr__``, the same rule TensorBoard applies, without its warning."""
    return _INVALID_TAG.sub("_", text)


def require_tensorboard() -> Any:
    """``SummaryWriter``, or an ImportError saying how to install TensorBoard."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError(f"writing TensorBoard event files needs the tensorboard package: {INSTALL_HINT}") from None
    return SummaryWriter


def check_logdir(logdir: Union[str, "os.PathLike[str]"]) -> str:
    """Make ``logdir`` now, as the writer would at the end of a run, or say why it cannot be made or
    written (before the run, not after it)."""
    path = str(logdir)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        raise InputError(f"cannot make the TensorBoard directory {path!r}: {err.strerror or err}; pass a "
                         f"directory you can write, e.g. runs/exp1") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise InputError(f"cannot write to the TensorBoard directory {path!r}: pass a directory you can write, "
                         f"e.g. runs/exp1")
    return path


def summary_writer(logdir: Union[str, "os.PathLike[str]"]) -> Any:
    """A ``SummaryWriter`` for ``logdir``, or a clear error when TensorBoard is not installed."""
    if not isinstance(logdir, (str, os.PathLike)) or not str(logdir).strip():
        raise InputError(f"to_tensorboard needs a directory to write to (a path), got {logdir!r}")
    return require_tensorboard()(log_dir=str(logdir))


def to_tensorboard(result: Any, logdir: Union[str, "os.PathLike[str]"], *, rules: Rules = Rules()) -> str:
    """Write ``result`` (a monitor, gradient trace, memory timeline or nanwatch report) to ``logdir``;
    returns the directory. Open it with ``tensorboard --logdir DIR``."""
    write = _writer_for(result)
    writer = summary_writer(logdir)
    try:
        write(writer, _data_of(result), rules)
    finally:
        writer.close()
    return str(logdir)


_KINDS = (MonitorHistory, GradTrace, TimelineData, NanSummary, ProfileData)


def _data_of(result: Any) -> Any:
    """The plain data behind a result object (a report wraps its data)."""
    if isinstance(result, _KINDS):
        return result
    for attr in ("history", "trace", "summary", "data"):
        try:
            inner = getattr(result, attr)  # an InputError (not started, still running) says what to do
        except AttributeError:
            continue
        if isinstance(inner, _KINDS):
            return inner
        if inner is None and attr == "trace":  # record_gradients(...) before its block has ended
            raise InputError("the recording is still running: export it after the `with` block ends")
    return result


def _writer_for(result: Any) -> Any:
    data = _data_of(result)
    for kind, write in ((MonitorHistory, write_history), (GradTrace, write_grads), (TimelineData, write_memory),
                        (NanSummary, write_nanwatch), (ProfileData, write_profile)):
        if isinstance(data, kind):
            return write
    raise InputError(f"to_tensorboard writes a monitor, a gradient trace (record_gradients / %%grads), a memory "
                     f"timeline (memory_timeline / %%cudamem), a nanwatch report or a profile (%%profile); got "
                     f"{type(result).__name__}")


def write_history(writer: Any, history: MonitorHistory, rules: Rules = Rules()) -> None:
    for i, name in enumerate(history.expressions):
        for step, value in zip(history.steps, history.values[:, i]):
            writer.add_scalar(f"monitor/{clean_tag(name)}", float(value), int(step))
    for li, layer in enumerate(history.layers):
        for k, step in enumerate(history.steps):
            norm, ratio = float(history.grad_norm[k, li]), float(history.update_ratio[k, li])
            if norm >= 0 or math.isnan(norm):  # -1: the layer had no gradient at this step
                writer.add_scalar(f"grad_norm/{clean_tag(layer)}", norm, int(step))
            if math.isfinite(ratio):
                writer.add_scalar(f"update_ratio/{clean_tag(layer)}", ratio, int(step))
    found = find_alerts(history, rules)
    if found:
        writer.add_text("monitor/alerts", "\n".join(f"- **{a.kind}** {a.message()}" for a in found),
                        int(history.steps[-1]))


def write_grads(writer: Any, trace: GradTrace, rules: Rules = Rules()) -> None:
    arrays = layer_arrays(trace)
    for li, layer in enumerate(trace.layers):
        for k, step in enumerate(trace.steps):
            for name in ("norm", "update_ratio"):
                value = float(arrays[name][k, li])
                if math.isfinite(value):
                    writer.add_scalar(f"grad_{name}/{clean_tag(layer.name)}", value, int(step))
    for h, row in enumerate(trace.hist_rows):
        for p, param in enumerate(trace.params):
            _histogram(writer, f"grad_hist/{clean_tag(param.name)}", trace.hist[h, p], trace.hist_range[h, p],
                       int(trace.steps[row]))


def _histogram(writer: Any, tag: str, counts: np.ndarray, bounds: np.ndarray, step: int) -> None:
    lo, hi = float(bounds[0]), float(bounds[1])
    total = float(np.sum(counts))
    if not (math.isfinite(lo) and math.isfinite(hi)) or total <= 0:
        return
    edges = np.linspace(lo, hi if hi > lo else lo + 1e-12, len(counts) + 1)
    centres = (edges[:-1] + edges[1:]) / 2
    writer.add_histogram_raw(tag, min=lo, max=hi, num=total, sum=float(np.sum(counts * centres)),
                             sum_squares=float(np.sum(counts * centres ** 2)),
                             bucket_limits=[float(e) for e in edges[1:]], bucket_counts=[float(c) for c in counts],
                             global_step=step)


def write_memory(writer: Any, timeline: TimelineData, rules: Rules = Rules()) -> None:
    keep = thin(len(timeline.steps), _MEMORY_POINTS)
    for k in keep:
        step = int(timeline.steps[k])
        for c, category in enumerate(CATEGORIES):
            writer.add_scalar(f"memory/{category}", int(timeline.by_category[k, c]), step)
        writer.add_scalar("memory/total", int(timeline.by_category[k].sum()), step)
        if timeline.reserved is not None:
            writer.add_scalar("memory/reserved", int(timeline.reserved[k]), step)
    writer.add_text("memory/summary", f"device {timeline.device}: peak {timeline.peak_bytes:,} bytes at event "
                                      f"{timeline.peak_step}, {timeline.final_bytes:,} bytes at the end"
                    + (f"\n\n{timeline.note}" if timeline.note else ""), 0)


def write_nanwatch(writer: Any, summary: NanSummary, rules: Rules = Rules()) -> None:
    rows = ["| # | phase | step | op | module | line |", "|---|---|---|---|---|---|"]
    for k, event in enumerate(summary.events, 1):
        where = f"{event.filename}:{event.lineno} `{event.line.strip()}`" if event.lineno else ""
        cells = [str(k), event.phase, str(event.step), event.op, event.module or "", where]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    text = "\n".join(rows) if summary.events else "no NaN or Inf was born"
    writer.add_text("nanwatch/births", text, 0)
    writer.add_scalar("nanwatch/births", len(summary.events), 0)


def write_profile(writer: Any, data: ProfileData, rules: Rules = Rules()) -> None:
    """Per profiled step: its time and its time by category (ms); the verdict as text."""
    for step in data.steps:
        writer.add_scalar("profile/step_ms", step.ms, step.number)
        for category in PROFILE_CATEGORIES:
            writer.add_scalar(f"profile/{category}_ms", step.categories.get(category, 0.0), step.number)
        if step.device_idle_ms is not None:
            writer.add_scalar("profile/device_idle_ms", step.device_idle_ms, step.number)
    v = data.verdict
    writer.add_text("profile/verdict", f"**{v.kind}** ({v.share:.0%} of the step): {v.summary}\n\nfix: {v.fix}",
                    data.steps[-1].number if data.steps else 0)
