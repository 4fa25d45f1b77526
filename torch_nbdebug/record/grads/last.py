"""A recording's trace and its exact last step, made now or when first read, for :mod:`torch_nbdebug.record.grads`.

:class:`Rows` holds the numbers of every recorded step on the host, the last one as sampled; made exact
(:meth:`Rows.make_exact`) from the result of :func:`~torch_nbdebug.record.grads.stats.sampled_exact_job`,
they give the :class:`GradTrace`. The recorder runs that job at the block's end on the gradients
themselves, or leaves it to :class:`LazyTrace`: a copy of the last step's gradients (the recorder's own,
taken at the block's end, at most :data:`COPY_LIMIT` bytes and, on CUDA, :data:`COPY_SHARE_OF_FREE` of
the device's free memory then) from which the job runs when the trace is first read, the copy dropped
as soon as it has. On CUDA the copy is queued at the block's end and the job's work runs at that first
read. The numbers are the same either way; at most one such copy is kept in a process (:func:`settle`).
"""
from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from torch_nbdebug.data.grads import FIELD, GradTrace, LayerInfo, ParamInfo
from torch_nbdebug.record.grads.stats import LastJob, run_job, sampled_exact_job, to_host

COPY_LIMIT = 256 << 20      # bytes of the last step's gradients copied to make it exact when first read
COPY_SHARE_OF_FREE = 0.25   # ... and on CUDA at most this share of the device's free memory at the block's end


class Rows:
    """The host arrays of a recording's trace (parameters in the trace's order), the last row as sampled
    until :meth:`make_exact`. ``new``: the trace's index of each recorder's parameter index."""

    def __init__(self, name: str, infos: tuple[ParamInfo, ...], layers: tuple[LayerInfo, ...],
                 steps: tuple[int, ...], stats: np.ndarray, exact: np.ndarray, kept: tuple[int, ...],
                 hist: np.ndarray, rng: np.ndarray, new: np.ndarray, *, kind: str, order: str, sample: int,
                 activations: Optional[np.ndarray], notes: list[str], estimated: set[int], hist_every: int,
                 max_hists: int) -> None:
        self.name, self.infos, self.layers, self.steps = name, infos, layers, steps
        self.stats, self.exact, self.kept, self.hist, self.rng, self.new = stats, exact, kept, hist, rng, new
        self.kind, self.order, self.sample, self.activations = kind, order, sample, activations
        self.notes = notes            # the recording's own (a failure, skipped gradients)
        self.estimated = estimated    # steps with an overflowed sum estimated from the sample
        self.hist_every = hist_every  # histograms kept for every hist_every-th step...
        self.max_hists = max_hists    # ... at most this many

    def make_exact(self, done: tuple[Any, ...], big: list[int], whole: list[int], matrices: list[int]) -> None:
        """Write the exact last step (``done``, the job's result) over its sampled numbers: the sampled
        parameters ``big`` (and the few whole ones the job measured again) over every element, the dead
        units of the whole ``matrices`` (recorder's indices). Computed aside, then set at once."""
        cols, counts, lo_hi, fixed, dead_whole = done
        redone = self.new[big + [whole[j] for j in fixed]]
        stats, hist, rng = self.stats[-1].copy(), self.hist[-1].copy(), self.rng[-1].copy()
        for key, values in cols.items():  # the sampled parameters (and a few whole), over every element
            stats[redone, FIELD[key]] = values
        stats[self.new[matrices], FIELD["dead_units"]] = dead_whole  # all the sample could not say
        hist[redone], rng[redone] = counts, lo_hi  # the last row always keeps its histogram
        self.stats[-1], self.hist[-1], self.rng[-1], self.exact[-1] = stats, hist, rng, True
        self.estimated = self.estimated - {self.steps[-1]}

    def trace(self, extra: Sequence[str] = ()) -> GradTrace:
        notes = list(self.notes)
        if not self.exact.all():
            notes.append(f"histograms, mean |g|, zero/NaN/Inf counts and update ratios of parameters over "
                         f"{self.sample} elements are estimated from a fixed random sample of {self.sample}")
        if self.estimated:
            notes.append(f"the float32 sum of squares of a finite gradient overflowed at {len(self.estimated)} "
                         f"step(s) (first: step {min(self.estimated)}): the norms and sums of parameters over "
                         f"{self.sample} elements there are estimated from their sample")
        if self.hist_every > 1:
            notes.append(f"histograms kept for every {self.hist_every}th step (at most {self.max_hists})")
        return GradTrace(self.name, self.infos, self.layers, self.steps, self.stats, self.exact, self.kept,
                         self.hist, self.rng, step_kind=self.kind, order=self.order, sample=self.sample,
                         activations=self.activations, notes=tuple(notes) + tuple(extra))


def copy_fits(tensors: Sequence[torch.Tensor], limit: int,
              free: Callable[[torch.device], int] = lambda d: torch.cuda.mem_get_info(d)[0]) -> bool:
    """Whether a copy of ``tensors`` may be kept until the trace is read: at most ``limit`` bytes in
    all and, on each CUDA device, at most :data:`COPY_SHARE_OF_FREE` of its free memory (``free``);
    on other devices than the CPU and CUDA, never (their free memory is not known)."""
    size: dict[torch.device, int] = {}
    for t in tensors:
        size[t.device] = size.get(t.device, 0) + t.numel() * t.element_size()
    if sum(size.values()) > limit:
        return False
    return all(device.type == "cpu" or device.type == "cuda" and n <= COPY_SHARE_OF_FREE * free(device)
               for device, n in size.items())


class LastCopy:
    """What the exact last step's job needs, the user's tensors left out: copies of the sampled
    gradients ``big`` and of those taken whole (``whole``, recorder's indices), the norm, sum, min and
    max of the sampled ones measured at the step (``known``), the whole ones' columns from their
    sample (``columns``, set after the final flush) and the whole ``matrices``."""

    def __init__(self, copies: list[torch.Tensor], known: torch.Tensor, big: list[int], whole: list[int],
                 matrices: list[int], bins: int) -> None:
        self.copies, self.known, self.big, self.whole, self.matrices, self.bins = copies, known, big, whole, matrices, bins
        self.columns: Optional[np.ndarray] = None

    def drop(self) -> None:
        self.copies, self.known = [], self.known.new_zeros(0, 4)

    def job(self) -> LastJob:
        n = len(self.big)
        return sampled_exact_job(self.copies[:n], self.known, self.copies[n:], self.bins)


class LazyTrace:
    """A recording's trace whose last step is made exact when first read (:meth:`resolve`), from the
    copy of its gradients in ``last``. ``partial``: the trace with that step as sampled, whose steps,
    layers and parameters are those of the result. If the job fails then (a device error surfacing
    at that first read, say), the result is ``partial`` with a note saying why: never an exception."""

    def __init__(self, rows: Rows, last: LastCopy) -> None:
        self._rows: Optional[Rows] = rows
        self._last: Optional[LastCopy] = last
        self._done: Optional[GradTrace] = None
        self._lock = threading.Lock()  # a training thread's settle() and the notebook's read may meet
        self.partial = rows.trace()
        global _LATEST
        _LATEST = weakref.ref(self)

    @property
    def pending(self) -> bool:
        """Whether the copy is still kept (the trace not read yet)."""
        return self._last is not None

    def resolve(self) -> GradTrace:
        with self._lock:
            if self._done is None:
                self._done = self._resolve()
            return self._done

    def _resolve(self) -> GradTrace:
        rows, last = self._rows, self._last
        assert rows is not None and last is not None
        self._last = self._rows = None  # dropped once the job is done, whatever happens
        try:
            rows.make_exact(_run(last), last.big, last.whole, last.matrices)
            return rows.trace()
        except Exception as exc:  # noqa: BLE001 - the view shows the rest, and why this is missing
            return self._missing(f"{type(exc).__name__}: {exc}")
        except BaseException:  # a Stop or Ctrl-C while it ran: said in the view, and raised
            self._done = self._missing("interrupted")
            raise

    def _missing(self, why: str) -> GradTrace:
        return dataclasses.replace(self.partial, notes=self.partial.notes + (
            f"the exact statistics of the last step could not be computed when the recording was first read "
            f"({why}): its numbers are estimated from the sample, as at the other steps",))


def _run(last: LastCopy) -> tuple[Any, ...]:
    """The job on the copy, its first copy to the host joined with the whole ones' columns (two copies)."""
    assert last.columns is not None
    job = last.job()
    last.copies = []  # the job holds them now, and drops them when it ends
    try:
        first = to_host(next(job))
        return run_job(job, first + [last.columns])[0]
    finally:
        job.close()


_LATEST: "Optional[weakref.ref[LazyTrace]]" = None


def settle() -> None:
    """Make the last lazy trace of this process exact now if it is still alive and unread: a new
    recording's copy then never adds to an older one's (memory stays flat however many are kept)."""
    latest = _LATEST() if _LATEST is not None else None
    if latest is not None and latest.pending:
        latest.resolve()
