"""``repro(fn, state=...)`` — run code twice from the same state and say why the runs differ
(the Python twin of ``%%repro``).

Before the first run the state (parameters, buffers, gradients, optimizer / scheduler / scaler state,
plain tensors copy-on-write, namespace bindings) and the random generators are snapshotted; before
the second run they are restored. The second run's results stand, so afterwards the state is as if
the code had run once. Side effects outside torch (prints, files, appends to lists) happen twice.
"""
from __future__ import annotations

import dataclasses
import sys
import types
from collections.abc import MutableMapping
from typing import Any, Callable, Optional, Sequence

from torch import nn

from torch_nbdebug.data.repro import (Cause, Divergence, NondeterministicUse, OpTrace, PreflightItem, ReproOp,
                                      ReproSummary)
from torch_nbdebug.errors import InputError
from torch_nbdebug.process.repro import (explain, find_divergence, first_op, missing_ops, nondeterministic_uses,
                                         preflight, summarize)
from torch_nbdebug.record.compiled import CompiledCode
from torch_nbdebug.record.repro import ReproRecorder, StateSnapshot, end_state, is_state, read_settings, state_in
from torch_nbdebug.record.source import UserNamespace, frame_locals, line_of, skipped_note
from torch_nbdebug.render.bundle import Displayable

__all__ = ["repro", "run_twice", "ReproReport", "ReproOp", "PreflightItem", "last_report"]

_last: Optional["ReproReport"] = None


class ReproReport(Displayable):
    """Whether two runs agreed, and if not the first op that differs and why. Holds no tensors."""

    def __init__(self, summary: Optional[ReproSummary] = None) -> None:
        self.summary = summary if summary is not None else ReproSummary()
        self.finished = summary is not None

    identical = property(lambda self: self.summary.identical, doc="True when both runs matched op by op")
    first = property(lambda self: self.summary.first, doc="the first op that differs (ReproOp) or None")
    cause = property(lambda self: self.summary.cause,
                     doc="'rng', 'uninitialized', 'external', 'nondeterministic_op', 'unknown' or None")
    hint = property(lambda self: self.summary.hint, doc="the fix")
    preflight = property(lambda self: self.summary.preflight, doc="settings that decide determinism")
    notes = property(lambda self: self.summary.notes)
    uninitialized = property(lambda self: self.summary.uninitialized,
                             doc="the first op that read memory before it was written (ReproOp), even when the "
                                 "runs agreed by chance, or None")

    @property
    def nondeterministic_ops(self) -> tuple[NondeterministicUse, ...]:
        """Ops used that PyTorch lists as nondeterministic on their device, with their lines."""
        return self.summary.nondeterministic_ops

    def text(self) -> str:
        from torch_nbdebug.render.repro import report_text

        return report_text(self.summary, self.finished)

    def html(self) -> str:
        from torch_nbdebug.render.repro import report_html

        return report_html(self.summary, self.finished)

    def to_dict(self) -> dict[str, Any]:
        return self.summary.to_dict()


class _Comparator:
    """Compares run 2 with run 1 as its ops arrive; remembers the first divergence."""

    def __init__(self, run1: Sequence[OpTrace]) -> None:
        self.run1 = run1
        self.start = 0
        self.found: Optional[Divergence] = None

    def __call__(self, run2: Sequence[OpTrace]) -> bool:
        self.found = find_divergence(self.run1, run2, self.start)
        self.start = len(run2)
        return self.found is not None


def _caller_name(value: Any, caller: Optional[types.FrameType], fallback: str) -> str:
    """The caller's variable name for a state object (``model`` rather than ``state[0]``)."""
    if caller is not None:
        # frame_locals: a plain f_locals read before 3.13 leaves a snapshot on the frame keeping tensors alive
        local = frame_locals(caller)
        for scope in ((caller.f_globals,) if local is None else (local, caller.f_globals)):
            for name, candidate in list(scope.items()):
                if candidate is value and not name.startswith("_"):
                    return name
    return fallback


def _named_state(state: Any, namespace: Optional[MutableMapping[str, Any]],
                 caller: Optional[types.FrameType] = None,
                 skipped: Optional[list[str]] = None) -> list[tuple[str, Any]]:
    named = state_in(namespace, skipped) if namespace is not None else []
    if state is None:
        return named
    items = list(state.items()) if isinstance(state, dict) else \
        list(enumerate(state)) if isinstance(state, (list, tuple)) else [(0, state)]
    for key, value in items:
        if not is_state(value):
            raise InputError(f"repro: state= takes modules, optimizers, LR schedulers, GradScalers, tensors, "
                             f"generators and DataLoaders; item {key!r} is a {type(value).__name__}")
        named.append((key if isinstance(key, str) else _caller_name(value, caller, f"state[{key}]"), value))
    return named


def _module_names(named: list[tuple[str, Any]], caller: Optional[types.FrameType]) -> dict[str, Any]:
    """Names for the modules the runs call: the state's, then the modules the caller holds in its
    variables (a model ``fn`` uses without passing it as state is named ``model.1`` too, not by class).
    Modules only, so no tensor the function frees is kept while it runs."""
    found: dict[str, Any] = {}
    if caller is not None:
        view = UserNamespace(frame=caller)
        found = {name: value for name, value in view.items() if issubclass(type(value), nn.Module)}
        view.release()
    found.update(named)
    return found


def run_twice(fn: Callable[[], Any], *, state: Any = None, restore_rng: bool = True,
              namespace: Optional[MutableMapping[str, Any]] = None) -> tuple["ReproReport", Any]:
    """Run ``fn`` twice from the same state; return the report and the second run's value.
    The user's exception (from either run) propagates unchanged; the report is then :func:`last_report`."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the user's traceback
    return _run_twice(fn, state, restore_rng, namespace, sys._getframe(1))


def _run_twice(fn: Callable[[], Any], state: Any, restore_rng: bool, namespace: Optional[MutableMapping[str, Any]],
               caller: Optional[types.FrameType]) -> tuple["ReproReport", Any]:
    global _last
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the user's traceback
    if not callable(fn):
        raise InputError(f"repro: fn must be a function to run twice (e.g. a lambda), not {type(fn).__name__}")
    if not isinstance(restore_rng, bool):
        raise InputError(f"repro: restore_rng must be True or False, not {restore_rng!r}")
    if namespace is not None and not isinstance(namespace, MutableMapping):
        raise InputError(f"repro: namespace must be a dict of names whose values it restores (e.g. globals()), "
                         f"not {type(namespace).__name__}")
    skipped: list[str] = []
    named = _named_state(state, namespace, caller, skipped)
    names = namespace if namespace is not None else _module_names(named, caller)  # for the report
    del caller
    report = _last = ReproReport()
    snapshot = StateSnapshot(named, namespace, restore_rng)
    context = dict(names=tuple(snapshot.names), restore_rng=restore_rng, named=named, skipped=tuple(skipped))
    watches = snapshot.watches_writes
    run1 = ReproRecorder(names, labels=snapshot.labels, pristine=snapshot.pristine,
                         before_write=snapshot.before_write if watches else None,
                         movable=snapshot.movable if watches else None, move=snapshot.move if watches else None)
    # The recorder's dispatch mode would make torch.compile drop compiled code for good.
    compiled = CompiledCode(names, _COMPILED_PURPOSE).__enter__()
    try:
        try:
            with run1:
                fn()
        except BaseException:
            report.summary, report.finished = _first_run_failed(run1, context), True
            raise
        unwritten = snapshot.unwritten()
        after_first = end_state(unwritten)
        snapshot.restore()
        comparator = _Comparator(run1.traces)
        run2 = ReproRecorder(names, labels=snapshot.labels, places=True, check=comparator,
                             restored=run1.pristine_reads)
        try:
            with run2:
                value = fn()
        except BaseException as exc:
            report.summary, report.finished = _second_run_failed(exc, run1, run2, comparator, context), True
            raise
        report.summary = _compare(run1, run2, comparator, context, (after_first, end_state(unwritten)))
        report.finished = True
        return report, value
    finally:
        compiled.__exit__(None, None, None)
        if compiled.note and report.summary is not None:
            report.summary = dataclasses.replace(report.summary, notes=report.summary.notes + (compiled.note,))
        snapshot.release()


_COMPILED_PURPOSE = ("repro ran it twice (compiled code cannot run under the recorder's dispatch mode), so the "
                     "ops compared are the eager ones")


def repro(fn: Callable[[], Any], state: Any = None, *, restore_rng: bool = True,
          namespace: Optional[MutableMapping[str, Any]] = None) -> "ReproReport":
    """Run ``fn()`` twice from the same starting state and report whether the runs agree.

    state: what ``fn`` changes — a module, optimizer, LR scheduler, GradScaler, tensor, torch.Generator
    or DataLoader, or a tuple/list/dict of them (``state=(model, opt)``); it is snapshotted and restored
    before the second run, so afterwards it is as if ``fn`` had run once. restore_rng: also restore
    the random generators (torch CPU/CUDA, NumPy, Python ``random``). namespace: a dict of variables
    (e.g. ``globals()``) to take state from and whose names are rebound before the second run.
    """
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the user's traceback
    return _run_twice(fn, state, restore_rng, namespace, sys._getframe(1))[0]


def last_report() -> Optional[ReproReport]:
    """The most recent report from ``repro()`` or ``%%repro`` (None before the first)."""
    return _last


# -- building the summary ----------------------------------------------------------------------------
def _common(run1: ReproRecorder, context: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    lines = {key: _line(place) for key, (_, place) in run1.nondeterministic.items()}
    settings = read_settings(context["named"], run1.cuda_used)
    if not context["names"]:
        notes.append("no modules, optimizers or tensors were given or found: only the random generators "
                     "and name bindings were restored")
    if not context["restore_rng"]:
        notes.append("random generators not restored (--no-restore-rng / restore_rng=False)")
    notes.append("the cell ran twice: its side effects outside torch, if any (prints, files, appends to Python "
                 "lists), happened twice")
    if context["skipped"]:
        notes.append(skipped_note(context["skipped"]))
    notes.extend(run1.errors)
    return dict(nondeterministic_ops=nondeterministic_uses(run1.nondeterministic, lines),
                preflight=preflight(settings), state=context["names"], restore_rng=context["restore_rng"],
                notes=tuple(notes))


def _first_run_failed(run1: ReproRecorder, context: dict[str, Any]) -> ReproSummary:
    notes = ["the first run raised an exception: nothing to compare (fix the error, then run again)"]
    return ReproSummary(identical=False, ops=(len(run1.traces), 0), **_common(run1, context, notes))


def _second_run_failed(exc: BaseException, run1: ReproRecorder, run2: ReproRecorder, comparator: _Comparator,
                       context: dict[str, Any]) -> ReproSummary:
    if isinstance(exc, KeyboardInterrupt) and comparator.found is None:
        notes = ["interrupted during the second run: compared the ops it reached, all equal so far"]
        return ReproSummary(identical=False, ops=(len(run1.traces), len(run2.traces)), **_common(run1, context, notes))
    return _compare(run1, run2, comparator, context, None, raised=True)


def _compare(run1: ReproRecorder, run2: ReproRecorder, comparator: _Comparator, context: dict[str, Any],
             states: Optional[tuple[dict[str, Any], dict[str, Any]]], raised: bool = False) -> ReproSummary:
    notes: list[str] = []
    d = comparator.found
    if d is None and raised:
        d = Divergence(len(run2.traces), "exception", detail="the second run raised, the first did not")
    if d is None:
        d = missing_ops(run1.traces, run2.traces)
    if d is not None and d.index < len(run2.traces):
        notes.append(f"compared {d.index + 1} of {len(run1.traces)} ops; stopped at the first difference")
    cause: Optional[Cause] = explain(d, run1.traces, run2.traces, context["restore_rng"]) if d is not None else None
    first = _first(d, run1, run2) if d is not None else None
    compared = len(run2.traces) if d is None else min(d.index + 1, len(run2.traces))
    changed = _state_divergence(len(run2.traces), *states) if states is not None else None
    if changed is not None:
        # State the snapshot could not restore (changed outside torch's ops) explains what follows.
        d, cause = changed, explain(changed, run1.traces, run2.traces, context["restore_rng"])
        if first is not None:
            first = dataclasses.replace(first, input=f"{changed.detail}: changed outside torch's ops, not restored")
    uninit = _uninitialized_read(run2)
    if uninit is not None and (cause != "uninitialized"):
        where = f"line {uninit.lineno} ({uninit.op})" if uninit.lineno else uninit.op
        agreed = "the runs agreed by chance there" if d is None or d.index > uninit.index else "not the first difference"
        notes.append(f"{where} read memory that {uninit.allocated_at or 'a torch.empty-like op'} allocated and "
                     f"nothing wrote before: its values are whatever the allocator handed back ({agreed}); "
                     f"allocate it with torch.zeros or write it before reading")
    return summarize(d, cause, first, ops=(len(run1.traces), compared), uninitialized=uninit,
                     **_common(run1, context, notes))


def _uninitialized_read(run2: ReproRecorder) -> Optional[ReproOp]:
    """The first op of the second run that read uninitialized memory, with its place and the allocation's."""
    for index, trace in enumerate(run2.traces):
        if trace.reads_uninitialized is not None:
            d = Divergence(index, "output")
            first = _first(d, run2, run2)
            return dataclasses.replace(first, max_abs_diff=None, kind="output") if first is not None else None
    return None


def _first(d: Divergence, run1: ReproRecorder, run2: ReproRecorder) -> Optional[ReproOp]:
    place = run2.places[d.index] if d.index < len(run2.places) else None
    allocated = None
    if d.index < len(run2.traces) and run2.traces[d.index].reads_uninitialized is not None:
        alloc = run2.alloc_places.get(run2.traces[d.index].reads_uninitialized)  # type: ignore[arg-type]
        if alloc is not None and alloc.filename:
            allocated = f"line {alloc.lineno}: {_line(alloc)}"
    return first_op(d, run1.traces, run2.traces, place, _line(place), allocated)


def _state_divergence(index: int, before: dict[str, Any], after: dict[str, Any]) -> Optional[Divergence]:
    for name, fp in before.items():
        other = after.get(name)
        if other is None or not fp.same(other):
            return Divergence(index, "state", detail=name)
    return None


def _line(place: Any) -> str:
    if place is None or not place.filename or not place.lineno:
        return ""
    return line_of(place.filename, place.lineno).text

