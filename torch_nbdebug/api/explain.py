"""``with explain() as ex:`` and ``explain_exception(exc)``: say where and why a PyTorch error happened.

``explain()`` records the block lightly (where autograd nodes were made, in-place ops, cut gradient
chains) and, when the block raises, builds ``ex.diagnosis`` from the traceback and the recording; the
exception passes through unchanged. ``explain_exception(exc)`` reads a caught exception post mortem
(nothing is re-run) and returns a :class:`Diagnosis`, or None for an error that is not PyTorch's.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping, Optional


from torch_nbdebug.api._block import start_within
from torch_nbdebug.data.explain import Diagnosis as DiagnosisData
from torch_nbdebug.data.explain import FailureFacts, Operand, Recording
from torch_nbdebug.errors import InputError
from torch_nbdebug.process.explain import diagnose
from torch_nbdebug.record.compiled import CompiledCode
from torch_nbdebug.record.explain import ExplainRecorder, IndexCheckError, failure_facts
from torch_nbdebug.record.source import UserNamespace, caller_namespace, cell_number, running_cell_number
from torch_nbdebug.render.bundle import Displayable

__all__ = ["explain", "explain_exception", "Diagnosis", "Explanation", "Operand", "IndexCheckError"]


@dataclasses.dataclass(frozen=True, repr=False)
class Diagnosis(DiagnosisData, Displayable):
    """What went wrong, where, the culprit and the fix. Shown as text, a static HTML card and a live widget."""

    @classmethod
    def of(cls, data: DiagnosisData) -> "Diagnosis":
        return cls(**{f.name: getattr(data, f.name) for f in dataclasses.fields(data)})

    def text(self) -> str:
        from torch_nbdebug.render.explain import diagnosis_text

        return diagnosis_text(self)

    def html(self) -> str:
        from torch_nbdebug.render.explain import diagnosis_html

        return diagnosis_html(self)

    def widget(self) -> Any:
        from torch_nbdebug.render.explain import ExplainView

        return ExplainView.of(self)

    def paragraph(self) -> "Paragraph":
        """The one-paragraph form shown under a traceback by the automatic explanation."""
        return Paragraph(self)

    def __repr__(self) -> str:
        return self.text()


class Paragraph(Displayable):
    """A diagnosis as one paragraph (text and HTML)."""

    def __init__(self, diagnosis: Diagnosis) -> None:
        self.diagnosis = diagnosis

    def text(self) -> str:
        from torch_nbdebug.render.explain import paragraph_text

        return paragraph_text(self.diagnosis)

    def html(self) -> str:
        from torch_nbdebug.render.explain import paragraph_html

        return paragraph_html(self.diagnosis)


class Explanation(Displayable):
    """The result of ``with explain() as ex:``: ``ex.diagnosis`` is set when the block raised a PyTorch error."""

    def __init__(self) -> None:
        self.diagnosis: Optional[Diagnosis] = None
        self.raised: Optional[str] = None  # the exception's type name, when the block raised
        self.finished = False
        self.note = ""  # how the block ran differently (compiled code ran eagerly), "" when it did not

    def text(self) -> str:
        if self.diagnosis is not None:
            return self.diagnosis.text()
        if self.raised:
            return f"explain: {self.raised} is not a PyTorch error; nothing to add"
        if not self.finished:
            return "explain: still running"
        return "explain: the code ran without an error" + (f" ({self.note})" if self.note else "")

    def html(self) -> str:
        if self.diagnosis is not None:
            return self.diagnosis.html()
        from torch_nbdebug.render.html import esc

        return f'<div class="tnd-explain-none" style="font-family:sans-serif;color:#555">{esc(self.text())}</div>'

    def widget(self) -> Any:
        return self.diagnosis.widget() if self.diagnosis is not None else None


_COMPILED_PURPOSE = ("explain recorded it (torch.compile would trace the recorder's function mode into the "
                     "model, recompile it, and turn its errors into tracing errors)")


class ExplainScope:
    """The context manager returned by :func:`explain`.

    Compiled code runs eagerly inside the block (:class:`CompiledCode`, as under the other op-level
    watches): the recorder sees its calls, an error in it is the eager error at the model's own line,
    and it runs compiled again afterwards, with nothing recompiled.
    """

    def __init__(self, namespace: UserNamespace, check_indices: bool) -> None:
        # The caller's locals and globals (or the given namespace), read live when they are needed: a
        # model created inside the block is named too, and a function's locals are not kept alive.
        self._namespace = namespace
        self.result = Explanation()
        self._recorder = ExplainRecorder(namespace, check_indices=check_indices)
        self._compiled = CompiledCode(namespace, _COMPILED_PURPOSE)

    def __enter__(self) -> Explanation:
        self._compiled.__enter__()
        start_within(self._compiled, self._recorder.start)
        return self.result

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> Literal[False]:
        try:
            try:
                self._recorder.stop()
            finally:
                self._compiled.__exit__(None, None, None)
            self.result.note = self._compiled.note
            if isinstance(exc, Exception):
                self.result.raised = type(exc).__name__
                diagnosis = _safe_diagnosis(exc, self._namespace, self._recorder)
                if diagnosis is not None and self.result.note:
                    diagnosis = dataclasses.replace(diagnosis, note=self.result.note)
                self.result.diagnosis = diagnosis
        finally:
            self._recorder.clear()
            self.result.finished = True
            self._namespace.release()  # keep neither the caller's frame nor its locals
        return False


def _safe_diagnosis(exc: BaseException, namespace: Optional[Mapping[str, Any]],
                    recorder: Optional[ExplainRecorder]) -> Optional[Diagnosis]:
    """Never let explaining replace the user's exception: our own failure gives no diagnosis."""
    try:
        before = recorder.old_graph_before() if recorder is not None else None
        root = recorder.backward_root() if recorder is not None else None
        names = dict(namespace.items()) if namespace is not None else None
        facts: FailureFacts = failure_facts(exc, names, before, root)
        del root, names
        recording: Optional[Recording] = None
        if recorder is not None:
            wanted = tuple(seq for _, seq in facts.freed_nodes) + facts.freed_users + \
                tuple(o.node_seq for o in facts.operands)
            recording = recorder.recording(wanted)
            facts = dataclasses.replace(facts, operands=tuple(_producer(o, recording) for o in facts.operands))
        data = diagnose(facts, recording)
        if data is not None:
            data = _with_cells(data)
    except Exception:  # noqa: BLE001 - an explanation is a bonus; the user's error must stay theirs
        return None
    return Diagnosis.of(data) if data is not None else None


def _with_cells(d: DiagnosisData) -> DiagnosisData:
    """The cell the card is shown under and the cells of its lines, so it says ``In [2], line 3`` for a
    line that is not in the cell it is shown under (as every view does)."""
    return dataclasses.replace(d, here=running_cell_number(),
                               cell=cell_number(d.filename) if d.filename else None,
                               culprit_cell=cell_number(d.culprit_filename) if d.culprit_filename else None)


def _producer(operand: Operand, recording: Recording) -> Operand:
    """Name the module and line that made an operand, where the recording saw it made."""
    site = recording.site_of(operand.node_seq) if operand.node_seq >= 0 else None
    if site is None:
        return operand
    where = f"{site.op} in {site.module}" if site.module else site.op
    return dataclasses.replace(operand, producer=f"{where}, line {site.lineno}" if site.lineno else where)


def explain(*, check_indices: bool = False, namespace: Optional[Mapping[str, Any]] = None) -> ExplainScope:
    """Record the block lightly; if it raises a PyTorch error, ``ex.diagnosis`` explains it.

    ``with explain() as ex: ...`` — the exception passes through unchanged; catch it outside the
    block and read ``ex.diagnosis`` (kind, op, module, line, culprit, operands, hint).
    check_indices: validate index arguments (embedding ids, class targets, gather/index_select
    indices) before each op runs, so an out-of-range index stops at its line with the value instead of
    a CUDA device-side assert. namespace: where to find the names of models (default: the caller's).
    """
    if not isinstance(check_indices, bool):
        raise InputError(f"explain: check_indices must be True or False, not {check_indices!r}")
    if namespace is not None and not isinstance(namespace, Mapping):
        raise InputError(f"explain: namespace must be a mapping of names to objects (like globals()), "
                         f"not {type(namespace).__name__}")
    return ExplainScope(caller_namespace(namespace), check_indices)


def explain_exception(exc: BaseException, namespace: Optional[Mapping[str, Any]] = None) -> Optional[Diagnosis]:
    """Explain a caught exception post mortem, from its traceback; None when it is not a PyTorch error.

    namespace: where to find model names (default: the globals of the traceback's user frames, innermost first).
    """
    if not isinstance(exc, BaseException):
        raise InputError(f"explain_exception needs an exception object (e.g. `except Exception as e: "
                         f"explain_exception(e)`), not {type(exc).__name__}")
    return _safe_diagnosis(exc, namespace, None)
