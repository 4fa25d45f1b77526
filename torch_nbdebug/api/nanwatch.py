"""``with nanwatch() as report:`` — where the first NaN/Inf was born (the Python twin of ``%%nanwatch``).

The report is yielded at once and filled in on exit, also when the block raises; the user's
exception passes through unchanged (a ``NanBirthError`` from ``raise_on_birth`` carries the report).
"""
from __future__ import annotations

import dataclasses
import types
import weakref
from typing import Any, Iterator, Literal, Mapping, Optional

from torch_nbdebug.api._block import start_within
from torch_nbdebug.data.nanwatch import LayerStats, NanEvent, NanSummary
from torch_nbdebug.errors import InputError, NanBirthError
from torch_nbdebug.process.nanwatch import summarize_watch
from torch_nbdebug.record.compiled import CompiledCode
from torch_nbdebug.record.modules import module_at, module_roots
from torch_nbdebug.record.nanwatch import NanRecorder, NanRecording, uses_replay
from torch_nbdebug.record.source import (UserNamespace, caller_frame, caller_namespace, cell_number, cell_source,
                                         running_cell_number, skipped_note)
from torch_nbdebug.render.bundle import Displayable

__all__ = ["nanwatch", "NanReport", "NanEvent", "NanWatch", "last_report", "NanBirthError"]

MODES = ("op", "module")
_SOURCE_WINDOW = 300
_last: Optional["NanReport"] = None
_COMPILED_PURPOSE = {
    "op": "nanwatch checked each of its ops (compiled code cannot run under the watch's dispatch mode)",
    "module": "nanwatch checked each module's output (compiled, its modules are fused and unseen)",
}


class NanReport(Displayable):
    """What a watch found. Shown as text, static HTML and a widget; holds statistics, never tensors."""

    def __init__(self, summary: Optional[NanSummary] = None) -> None:
        self.summary = summary if summary is not None else NanSummary()
        self.finished = summary is not None
        # The module the first birth was in (weakly: %graph marks the birth only on this very model)
        self.birth_module: Optional[weakref.ref] = None
        self.cell: Optional[int] = None  # the notebook cell that ran the watch (In [4]), when known

    @property
    def events(self) -> tuple[NanEvent, ...]:
        """Births in the order they happened (forward, backward, optimizer and input-data events)."""
        return self.summary.events

    @property
    def first(self) -> Optional[NanEvent]:
        return self.summary.first

    @property
    def absorbed(self) -> tuple[NanEvent, ...]:
        """Forward births a ``torch.where``/``masked_fill`` threw away (harmless in forward)."""
        return self.summary.absorbed

    @property
    def layers(self) -> tuple[LayerStats, ...]:
        return self.summary.layers

    @property
    def notes(self) -> tuple[str, ...]:
        return self.summary.notes

    def __bool__(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self.events)

    def text(self) -> str:
        from torch_nbdebug.render.nanwatch import report_text

        return report_text(self.summary, self.finished)

    def html(self) -> str:
        from torch_nbdebug.render.nanwatch import report_html

        return report_html(self.summary, self.finished)

    def widget(self) -> Any:
        from torch_nbdebug.render.nanwatch import NanView

        return NanView.of(self.summary)

    def to_dict(self) -> dict[str, Any]:
        return self.summary.to_dict()

    def to_json(self) -> str:
        """The report as the versioned JSON document a script run writes (``torch_nbdebug.load`` reads it)."""
        from torch_nbdebug.data.ranks import to_json

        return to_json("nanwatch", self.to_dict())

    def to_tensorboard(self, logdir: Any) -> str:
        """Write the births (as a text table) as TensorBoard event files in ``logdir`` (returns it);
        needs ``pip install torch_nbdebug[tensorboard]``. See torch_nbdebug.api.tensorboard."""
        from torch_nbdebug.api.tensorboard import to_tensorboard

        return to_tensorboard(self, logdir)


class NanWatch:
    """The context manager returned by :func:`nanwatch`."""

    def __init__(self, namespace: Optional[Mapping[str, Any]], options: dict[str, Any],
                 caller: Optional[types.FrameType]) -> None:
        # The caller's locals and globals, read live (a model made inside the block is named too);
        # values that cannot be inspected are skipped and noted.
        self._live = UserNamespace(frame=caller) if namespace is None else caller_namespace(namespace)
        self._caller_file = caller.f_code.co_filename if caller is not None else None
        self.options = options
        self.report = NanReport()
        self._recorder = NanRecorder(self._live, **options)
        # Compiled code runs eagerly under the watch, so each op (op mode; a dispatch mode would make
        # torch.compile drop the compiled code for good) or each module's output (module mode; compiled,
        # only dynamo's fused GraphModule is seen) is checked, and compiled again afterwards.
        self._compiled: Optional[CompiledCode] = CompiledCode(self._live, _COMPILED_PURPOSE[options["mode"]])

    def __enter__(self) -> NanReport:
        if self._compiled is not None:
            self._compiled.__enter__()
        start_within(self._compiled, self._recorder.start)
        return self.report

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> Literal[False]:
        global _last
        recording: Optional[NanRecording] = None
        try:
            recording = self._recorder.stop()
        finally:
            try:
                if self._compiled is not None:
                    self._compiled.__exit__(None, None, None)
                # (a Stop while the recorder stopped: what it holds, all hooks off all the same)
                summary = self._summary(recording if recording is not None else self._recorder.recording(), exc)
            except Exception as err:  # noqa: BLE001 - never replace the user's exception with ours
                summary = NanSummary(notes=(f"nanwatch could not build its report: {type(err).__name__}: {err}",))
            self.report.summary, self.report.finished = summary, True
            self.report.birth_module = _birth_module(self._live, summary.first)
            self.report.cell = running_cell_number()
            _last = self.report
            self._live.release()  # keep neither the caller's frame nor its locals
            self._recorder.namespace = None
        if isinstance(exc, NanBirthError) and exc.report is None:
            _complete_error(exc, self.report)
        return False

    def _summary(self, rec: NanRecording, exc: Optional[BaseException]) -> NanSummary:
        notes = list(_notes(rec, exc))
        if self._compiled is not None and self._compiled.note:
            notes.append(self._compiled.note)
        if self._live.skipped:
            notes.append(skipped_note(self._live.skipped))
        events = [e if e.phase == "optimizer" else dataclasses.replace(e, steps_before=rec.steps_before(e.iteration))
                  for e in rec.events]
        summary = summarize_watch(events, set(rec.absorbed), rec.layers, mode=rec.options.mode,
                                  ops_seen=rec.ops_seen, ops_checked=rec.ops_checked, dropped=rec.dropped,
                                  notes=tuple(notes), options=dict(self.options))
        filename = summary.first.filename if summary.first is not None and summary.first.filename else self._caller_file
        return _with_cells(_with_source(summary, filename))


def _birth_module(namespace: Mapping[str, Any], first: Optional[NanEvent]) -> Optional[weakref.ref]:
    try:
        module = module_at(module_roots(namespace), first.module) if first is not None and first.module else None
        return weakref.ref(module) if module is not None else None
    except Exception:  # noqa: BLE001 - an odd namespace never costs the user their report
        return None


def _complete_error(exc: NanBirthError, report: NanReport) -> None:
    """Give the raised error the finished report, and the event with its hint in the message."""
    exc.report = report
    raw = exc.event
    for event in report.events:
        if isinstance(raw, NanEvent) and (event.phase, event.op, event.lineno, event.iteration) == \
                (raw.phase, raw.op, raw.lineno, raw.iteration):
            exc.event = event
            if event.hint and exc.args:
                exc.args = (f"{exc.args[0]}\n  why/fix: {event.hint}",) + tuple(exc.args[1:])
            break


def _with_source(summary: NanSummary, filename: Optional[str]) -> NanSummary:
    """Attach the source of the first event's cell (and of every other event's file) for highlighting."""
    if not filename:
        return summary
    first_line, text = _source_window(filename, summary.first.lineno if summary.first is not None else None)
    sources = {filename: (first_line, text)}
    for event in summary.events:
        if event.filename and event.filename not in sources and len(sources) < 8:
            sources[event.filename] = _source_window(event.filename, event.lineno)
    return dataclasses.replace(summary, cell_filename=filename, cell_source=text, source_first_line=first_line,
                               sources=tuple((name, first, src) for name, (first, src) in sources.items() if src))


def _with_cells(summary: NanSummary) -> NanSummary:
    """The cell the watch ran in and each event's cell, so a view says ``In [2], line 3`` for a line
    that is not in the cell it is shown under."""
    files = {e.filename for e in summary.events + summary.absorbed if e.filename}
    cells = tuple((name, number) for name in sorted(files) if (number := cell_number(name)) is not None)
    return dataclasses.replace(summary, cell=running_cell_number(), cells=cells)


def _source_window(filename: str, lineno: Optional[int]) -> tuple[int, str]:
    """The whole cell, or 30 lines around ``lineno`` of a long file."""
    lines = cell_source(filename).splitlines()
    first = 1
    if len(lines) > _SOURCE_WINDOW:
        first = max(1, (lineno or 1) - 15)
        lines = lines[first - 1:first + 29]
    return first, "\n".join(lines)


def _notes(rec: NanRecording, exc: Optional[BaseException]) -> Iterator[str]:
    opts = rec.options
    if not rec.saw_torch and exc is None:
        yield ("the code ran no torch operations, so there was nothing to watch: put the model call, "
               "loss.backward() and optimizer.step() inside the watched cell")
    if opts.mode == "module":
        yield "module-level mode: only module outputs (and gradients into them) were checked"
    if not opts.backward:
        yield "backward pass not watched (--no-backward)"
    if not opts.optimizer:
        yield "optimizer steps not watched (--no-optimizer)"
    if opts.ignore_inf:
        yield "Inf values ignored (--ignore-inf): only NaN births are reported"
    if rec.full or rec.dropped:
        yield (f"checking stopped after the first {opts.max_events} births (raise the limit with "
               f"max_events= / --max-events)")
    if rec.scaler_skips:
        steps = ", ".join(str(i - 1) for i in rec.scaler_skips[:10])  # on the one step axis (from 0)
        yield (f"GradScaler skipped the optimizer step in step(s) {steps} because of inf/NaN gradients "
               "(its normal loss-scale calibration): those backward births are listed as absorbed")
    if rec.other_thread:
        yield ("modules also ran in another thread: nanwatch checks the ops of the thread that runs the "
               "watched code only (run that work in this thread to watch it)")
    yield from rec.notes
    if exc is not None and not isinstance(exc, NanBirthError):
        yield f"the code raised {type(exc).__name__}: the report covers what ran before it"


REPLAY_DEFAULT = True  # tests run the always-on per-op watch too by setting this to False


def nanwatch(*, mode: str = "op", backward: bool = True, optimizer: bool = True, ignore_inf: bool = False,
             raise_on_birth: bool = False, namespace: Optional[Mapping[str, Any]] = None,
             defer: Optional[bool] = None, max_events: int = 50, replay: Optional[bool] = None) -> NanWatch:
    """Watch the block for NaN/Inf births: ``with nanwatch() as report: ...``.

    mode: ``"op"`` (default) checks every ATen op that can create a NaN/Inf; ``"module"`` checks only
    module outputs (cheaper, names the module but not the op). backward/optimizer: watch those phases.
    ignore_inf: report NaN only. raise_on_birth: raise :class:`NanBirthError` at the first birth (with
    defer, each check is then read at once: raising at the birth's line needs it).
    namespace: where to find variable names for modules/parameters (default: the caller's).
    defer: keep flags on the device and read them once per training step, when the backward starts
    (default: True on CUDA, where each read is a host synchronisation).
    replay: op mode on the immediate path (default: on). The per-op watch is off while a model's
    forward runs: each module call's output is kept and all are checked together when the model returns;
    a call whose output went non-finite is run again (same arguments, weights and RNG state; no
    ``.grad``, buffers restored) under the per-op watch, which names the op and line. A backward birth
    inside a model gets its forward op and line the same way. Backward, optimizer steps and code outside
    modules are watched per op. ``replay=False``: the per-op watch stays on for the whole block.
    """
    if mode not in MODES:
        raise InputError(f"nanwatch: mode must be 'op' (every op) or 'module' (module outputs only), not {mode!r}")
    if not isinstance(max_events, int) or max_events < 1:
        raise InputError(f"nanwatch: max_events must be a positive int, not {max_events!r}")
    if replay is None:
        replay = REPLAY_DEFAULT
    for name, value in (("backward", backward), ("optimizer", optimizer), ("ignore_inf", ignore_inf),
                        ("raise_on_birth", raise_on_birth), ("replay", replay)):
        if not isinstance(value, bool):
            raise InputError(f"nanwatch: {name} must be True or False, not {value!r}")
    if namespace is not None and not isinstance(namespace, Mapping):
        raise InputError(f"nanwatch: namespace must be a dict of names (e.g. globals()), not {type(namespace).__name__}")
    if defer is None:
        defer = _cuda_in_use()
    options = dict(mode=mode, backward=backward, optimizer=optimizer, ignore_inf=ignore_inf,
                   raise_on_birth=raise_on_birth, defer=defer, max_events=max_events)
    options["replay"] = uses_replay(replay, "module" if mode == "module" else "op", defer, raise_on_birth)  # (what the recorder will do)
    caller = caller_frame() if namespace is None else None  # the one definition of "the caller"
    return NanWatch(namespace, options, caller)


def _cuda_in_use() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def last_report() -> Optional[NanReport]:
    """The most recent report from ``nanwatch()`` or ``%%nanwatch`` (None before the first)."""
    return _last
