"""Python twin of ``%cudamem`` / ``%%cudamem``: ``memory_state()`` and ``with memory_timeline() as tl``.

Wires the recorders (dispatch mode on CPU; allocator history joined with the dispatch-mode tags on
CUDA) to the processors and the renderers. On a machine without CUDA both work on CPU tensors and
say so in one line.
"""
from __future__ import annotations

import pickle
import warnings
from dataclasses import fields, replace
from typing import Any, Mapping, Optional

import torch

from torch_nbdebug.api._block import start_within
from torch_nbdebug.data import memory as data
from torch_nbdebug.data.memory import NO_CUDA_NOTE
from torch_nbdebug.errors import InputError
from torch_nbdebug.process.memory import build_timeline, cpu_snapshot
from torch_nbdebug.record.source import caller_namespace, skipped_note
from torch_nbdebug.record.compiled import CompiledCode
from torch_nbdebug.render.bundle import Displayable

__all__ = ["memory_state", "memory_timeline", "write_snapshot", "MemoryState", "MemoryTimeline"]


class MemoryTimeline(Displayable, data.MemoryTimeline):
    """A block's memory timeline; displays as text, a static SVG and a zoomable widget."""

    @classmethod
    def from_data(cls, tl: data.MemoryTimeline) -> "MemoryTimeline":
        return cls(**{f.name: getattr(tl, f.name) for f in fields(data.MemoryTimeline)})

    def text(self) -> str:
        from torch_nbdebug.render.memory import timeline_text

        return timeline_text(self)

    def html(self) -> str:
        from torch_nbdebug.render.memory import timeline_html

        return timeline_html(self)

    def widget(self) -> Any:
        from torch_nbdebug.render.memory import TimelineView

        return TimelineView(self)

    def to_json(self) -> str:
        """The timeline as the versioned JSON document a script run writes (``torch_nbdebug.load`` reads it)."""
        from torch_nbdebug.data.ranks import to_json

        return to_json("cudamem", self.to_dict())

    def to_tensorboard(self, logdir: Any) -> str:
        """Write bytes by category over time and the peak as TensorBoard event files in ``logdir``
        (returns it); needs ``pip install torch_nbdebug[tensorboard]``. See torch_nbdebug.api.tensorboard."""
        from torch_nbdebug.api.tensorboard import to_tensorboard

        return to_tensorboard(self, logdir)


class MemoryState(Displayable, data.MemoryState):
    """Memory now; displays as text, a static bar + table and a widget."""

    @classmethod
    def from_data(cls, st: data.MemoryState) -> "MemoryState":
        return cls(**{f.name: getattr(st, f.name) for f in fields(data.MemoryState)})

    def text(self) -> str:
        from torch_nbdebug.render.memory import state_text

        return state_text(self)

    def html(self) -> str:
        from torch_nbdebug.render.memory import state_html

        return state_html(self)

    def widget(self) -> Any:
        from torch_nbdebug.render.memory import StateView

        return StateView(self)


def resolve_device(device: Optional[str]) -> tuple[str, int, str]:
    """``(device_type, cuda_index, note)``: CUDA when asked or available, else CPU with the note."""
    name = "cuda" if device is None and torch.cuda.is_available() else str(device or "cpu").strip().lower()
    if name == "cpu":
        return "cpu", 0, NO_CUDA_NOTE if device is None else ""
    kind, _, number = name.partition(":")
    if kind != "cuda":
        raise InputError(f"device {device!r} is not supported: use 'cpu' or 'cuda' (or 'cuda:N')")
    if number and not number.isdigit():
        raise InputError(f"device {device!r}: write cuda:N with a device number, e.g. cuda:0")
    if not torch.cuda.is_available():
        return "cpu", 0, NO_CUDA_NOTE
    return "cuda", int(number) if number else torch.cuda.current_device(), ""


def memory_state(namespace: Optional[Mapping[str, Any]] = None, *, device: Optional[str] = None,
                 top: int = 10) -> MemoryState:
    """Memory now: live tensor bytes by category and the ``top`` largest tensors named by their holder.

    ``namespace`` names holders (default: the caller's locals and globals); ``device`` is "cpu" or "cuda"
    (default: CUDA when available).
    """
    from torch_nbdebug.record.memory import capture_state

    if int(top) < 0:
        raise InputError(f"top={top}: pass a count of tensors to list, e.g. top=10")
    device_type, _, note = resolve_device(device)
    ns = caller_namespace(namespace)
    try:
        state = capture_state(ns, device_type=device_type, top=int(top), note=note)
        return MemoryState.from_data(replace(state, note=join_notes(state.note, skipped_note(ns.skipped))))
    finally:
        ns.release()


class memory_timeline:
    """``with memory_timeline() as tl:`` records the block; ``tl`` is filled when the block ends.

    The timeline is built even when the block raises (the exception still propagates unchanged).
    ``export="file.pickle"`` writes a snapshot PyTorch's memory viewer opens (on CPU, the same format
    that ``torch.cuda._memory_viz.profile_plot`` builds for CPU profiles). Tensors alive before the
    block are found through ``namespace`` (and adopted when an op first touches one it missed);
    ``scan_gc=True`` finds every one through the garbage collector instead (slower in big sessions).
    """

    def __init__(self, namespace: Optional[Mapping[str, Any]] = None, *, device: Optional[str] = None,
                 export: Optional[str] = None, top: int = 10, record_lines: bool = True,
                 scan_gc: bool = False) -> None:
        self.namespace = caller_namespace(namespace)  # read live when the block starts and ends
        self.device_type, self.cuda_index, self.note = resolve_device(device)
        self.export = export
        self.top = int(top)
        self.record_lines = record_lines
        self.scan_gc = scan_gc
        self.timeline = MemoryTimeline()
        self._recorder: Any = None
        self._history: Any = None
        self._compiled: Optional[CompiledCode] = None

    def __enter__(self) -> MemoryTimeline:
        from torch_nbdebug.record.memory import MemoryRecorder

        # The recorder's dispatch mode would make torch.compile drop compiled code for good.
        self._compiled = CompiledCode(self.namespace, "memory_timeline recorded it (compiled code cannot run under "
                                      "the recorder's dispatch mode), so the timeline shows eager memory use"
                                      ).__enter__()
        start_within(self._compiled, lambda: self._start(MemoryRecorder))
        return self.timeline

    def _start(self, recorder_class: Any) -> None:
        if self.device_type == "cuda":
            from torch_nbdebug.record.memory import CudaHistory

            self._history = CudaHistory()
            self._history.__enter__()
        # The allocator history we turn on records each allocation's Python stack, and the timeline
        # takes the user's line from it (record/memory/cuda.py): the recorder need not also walk the
        # stack per allocation. A history the user turned on may have no stacks: then it does.
        walk_lines = self.record_lines and (self._history is None or self._history.was_enabled)
        self._recorder = recorder_class(self.namespace, device_type=self.device_type,
                                        record_lines=walk_lines, scan_gc=self.scan_gc)
        start_within(self._history, self._recorder.start)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            try:
                recording = self._recorder.stop()  # removes the mode and hooks whatever happens
            finally:
                try:
                    if self._history is not None:
                        self._history.__exit__(None, None, None)
                finally:
                    if self._compiled is not None:
                        self._compiled.__exit__(None, None, None)
            self.timeline._fill(build_timeline(self._recording(recording), top=self.top))
            if self.export:
                self._write_export()
        except Exception as err:
            if exc_type is None:
                raise
            # The user's exception matters more than ours: report ours, let theirs propagate.
            warnings.warn(f"torch_nbdebug could not build the memory timeline: {err!r}", RuntimeWarning)
        finally:
            self._recorder = None
            self.namespace.release()  # keep neither the caller's frame nor its locals

    def _recording(self, recording: data.MemoryRecording) -> data.MemoryRecording:
        if self._history is None:
            return replace(recording, note=self._note())
        from torch_nbdebug.record.memory import recording_from_snapshot

        snapshot = self._history.snapshot or {}
        return recording_from_snapshot(snapshot, self.cuda_index, tagged=recording,
                                       start_us=self._history.start_us, note=self._note())

    def _note(self) -> str:
        """The device note; when compiled code ran eagerly under the recording, a sentence on that; and
        what in the namespace could not be inspected."""
        compiled = self._compiled.note if self._compiled is not None else ""
        return join_notes(self.note, compiled, skipped_note(self.namespace.skipped))

    def _write_export(self) -> None:
        write_snapshot(self.timeline, str(self.export))


def join_notes(*notes: str) -> str:
    """The one-line notes of a memory view, in order, without empty ones."""
    return "; ".join(n for n in notes if n)


def write_snapshot(tl: data.MemoryTimeline, path: str) -> str:
    """Pickle ``tl``'s snapshot (the allocator's on CUDA, the equivalent built from the timeline on CPU)."""
    snapshot = tl.snapshot if tl.snapshot is not None else cpu_snapshot(tl)
    try:
        with open(path, "wb") as f:
            pickle.dump(snapshot, f)
    except OSError as err:
        raise InputError(f"cannot write the snapshot to {path!r}: {err.strerror}; "
                         f"pass a writable path such as memory.pickle") from None
    return path
