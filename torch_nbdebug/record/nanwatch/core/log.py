"""The one owner of a watch's events: the list, what was absorbed, held backward births, and when to raise.

Every path (op checks now or deferred, module mode, optimizer steps, GradScaler) hands its events here;
nothing else appends to the list or raises :class:`NanBirthError`. Keys are storage keys (ints) and
autograd sequence numbers: no tensor is kept.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterable, Iterator, Optional, Sequence

from torch_nbdebug.data.nanwatch import NanEvent
from torch_nbdebug.errors import NanBirthError
from torch_nbdebug.record.nanwatch.core.rules import keeps_backward_birth
from torch_nbdebug.record.nanwatch.core.events import birth_message


class EventLog:
    def __init__(self, max_events: int, raise_on_birth: bool) -> None:
        self.max_events = max_events
        self.raise_on_birth = raise_on_birth
        self.events: list[NanEvent] = []
        self.absorbed: set[int] = set()  # indices of forward births a where/masked_fill threw away
        self.dropped = 0
        self.scaler_skips: set[int] = set()  # iterations whose optimizer step GradScaler skipped
        self._scaler_mark = 0  # events before this index were seen by an earlier GradScaler check
        self._birth_keys: dict[int, int] = {}  # storage key of a forward birth's output -> event index
        self._birth_seqs: dict[int, int] = {}  # autograd sequence nr of a forward birth -> event index
        self._held: dict[int, list[NanEvent]] = {}  # backward births waiting for their node to finish
        self._carried: dict[int, int] = {}  # storage key of an op output carrying a forward birth on -> its index
        self._differentiable: set[int] = set()  # forward births whose values reached a tensor requiring grad
        self._rerun: Optional[list[int]] = None  # while a node runs again: the nodes of the births held meanwhile

    # -- questions ------------------------------------------------------------------------------
    def mark(self) -> int:
        """Where the log stands now: :meth:`since` tells what a check added after it."""
        return len(self.events)

    def since(self, mark: int) -> list[NanEvent]:
        """The events added after ``mark`` (:meth:`mark`)."""
        return self.events[mark:]

    def has_events(self) -> bool:
        return bool(self.events) or self.dropped > 0

    def full(self) -> bool:
        return len(self.events) >= self.max_events

    def tracking_births(self) -> bool:
        """Whether an absorbing op (where, masked_fill) could throw a birth away: only after one."""
        return bool(self._birth_keys)

    def carries_birth(self, key: Optional[int]) -> bool:
        """Whether this storage holds a forward birth's output, or an op's output that carried it on."""
        return key is not None and (key in self._birth_keys or key in self._carried)

    def is_born(self, key: Optional[int]) -> bool:
        return key is not None and key in self._birth_keys

    def reported_forward(self, event: NanEvent) -> bool:
        """Whether this forward birth is in the log already (by its autograd sequence number, else by its
        op, line and iteration)."""
        if event.sequence_nr is not None and event.sequence_nr in self._birth_seqs:
            return True
        return any(e.phase == "forward" and (e.op, e.filename, e.lineno, e.iteration) ==
                   (event.op, event.filename, event.lineno, event.iteration) for e in self.events)

    def from_absorbed(self, key: Optional[int]) -> bool:
        """Is this storage the output of a forward birth that was thrown away (the where trap)?"""
        return bool(self.absorbed) and key is not None and self._birth_keys.get(key) in self.absorbed

    # -- adding ---------------------------------------------------------------------------------
    def add(self, event: NanEvent, out_keys: Iterable[Optional[int]] = (), differentiable: bool = False) -> None:
        """Keep a birth (raising if asked); forward births remember their outputs' storage keys.
        ``differentiable``: its outputs require grad (see :meth:`cast_away`)."""
        if event.phase == "backward" and event.sequence_nr is not None:
            fwd = self._birth_seqs.get(event.sequence_nr)
            if fwd is not None and fwd not in self.absorbed:
                return  # the gradient of an op whose forward output was already reported as non-finite
        if self.full():
            self.dropped += 1
            return
        self.events.append(event)
        index = len(self.events) - 1
        if event.phase == "forward":
            if differentiable:
                self._differentiable.add(index)
            if event.sequence_nr is not None:
                self._birth_seqs[event.sequence_nr] = index
            for key in out_keys:
                if key is not None:
                    self._birth_keys[key] = index
        if self.raise_on_birth:
            raise NanBirthError(birth_message(event), event=event)

    def add_absorbed(self, event: NanEvent) -> None:
        """A forward birth that a replay saw thrown away (the where trap), listed as absorbed (once: the
        replay of an enclosing call may see it again)."""
        same = (event.op, event.filename, event.lineno, event.iteration, event.sequence_nr)
        if any((e.op, e.filename, e.lineno, e.iteration, e.sequence_nr) == same for i, e in enumerate(self.events)
               if i in self.absorbed):
            return
        if self.full():
            self.dropped += 1
            return
        self.events.append(event)
        self.absorbed.add(len(self.events) - 1)

    def rewrite(self, i: int, event: NanEvent) -> None:
        """The one in-place edit: event ``i`` told more precisely (a forward op and line found by a replay)."""
        self.events[i] = event

    def renumber(self, start: int, shift: int) -> None:
        """Events from ``start`` on were made by a replay: their forward sequence numbers move by ``shift``
        to the original call's (the gradients of a reported forward birth stay quiet)."""
        for seq, index in list(self._birth_seqs.items()):
            if index >= start:
                del self._birth_seqs[seq]
                self._birth_seqs[seq + shift] = index

    @contextlib.contextmanager
    def not_raising(self) -> Iterator[None]:
        """While the watch stops (or reads flags after the user's own error): record, never raise."""
        raising, self.raise_on_birth = self.raise_on_birth, False
        try:
            yield
        finally:
            self.raise_on_birth = raising

    # -- the where trap ------------------------------------------------------------------------
    def absorb(self, keys: Sequence[Optional[int]], thrown: Sequence[bool]) -> None:
        for key, gone in zip(keys, thrown):
            if gone and key is not None and key in self._birth_keys:
                self.absorbed.add(self._birth_keys[key])

    def propagated(self, keys: Iterable[Optional[int]], out_keys: Iterable[Optional[int]] = (),
                   differentiable: bool = False) -> None:
        """A non-finite value flowed on: the forward birth it came from was not absorbed after all. Its
        outputs (``out_keys``; ``differentiable``: they require grad) carry that birth on (:meth:`cast_away`)."""
        came = None
        for key in keys:
            index = self._birth_keys.get(key, self._carried.get(key)) if key is not None else None
            if index is not None:
                self.absorbed.discard(index)
                came = index
                if differentiable:
                    self._differentiable.add(index)
        if came is not None and len(self._carried) < _MAX_CARRIED:
            for key in out_keys:
                if key is not None:
                    self._carried.setdefault(key, came)

    def cast_away(self, key: Optional[int]) -> None:
        """A tensor carrying a forward birth's NaN/Inf was cast to integers or booleans (T5's relative
        position bucket: ``log(0)`` cast to ``long``, then selected away): its values are gone, as in the
        where trap. Only a birth whose values never entered the autograd graph (none of the tensors carrying
        it required grad) is absorbed so: one that did may have reached the loss as well (a metric cast to
        ``long`` after the loss), and stays a birth."""
        index = self._birth_keys.get(key, self._carried.get(key)) if key is not None else None
        if index is not None and index not in self._differentiable:
            self.absorbed.add(index)

    # -- backward births wait for their node ----------------------------------------------------
    def hold(self, node_key: int, event: NanEvent) -> bool:
        """Hold a backward birth until its node finishes; True when its node needs a hook to tell when (not
        held yet, and not run again under :meth:`rerunning`, which decides itself)."""
        if self._rerun is not None:
            self._rerun.append(node_key)
        held = self._held.get(node_key)
        if held is None:
            self._held[node_key] = [event]
            return self._rerun is None
        held.append(event)
        return False

    @contextlib.contextmanager
    def rerunning(self, grads_bad: Sequence[bool]) -> Iterator[None]:
        """A backward node run again under the per-op watch, from its own hook: the births held meanwhile are
        decided when it returns by ``grads_bad`` (the gradients that left the node), not by hooks of their own."""
        outer, self._rerun = self._rerun, []
        try:
            yield
        finally:
            keys, self._rerun = self._rerun, outer
        for key in dict.fromkeys(keys):
            self.node_done(key, grads_bad)

    def is_held(self, node_key: int) -> bool:
        return node_key in self._held

    def node_done(self, node_key: int, grads_bad: Sequence[bool]) -> None:
        """The node finished: keep its held births if a non-finite gradient left it."""
        held = self._held.pop(node_key, [])
        if held and keeps_backward_birth(grads_bad):
            for event in held:
                self.add(event)

    def commit_held(self) -> None:
        """Births of nodes that never finished (the backward raised): keep them, without raising."""
        held, self._held = self._held, {}
        with self.not_raising():
            for events in held.values():
                for event in events:
                    self.add(event)

    # -- GradScaler ------------------------------------------------------------------------------
    def scaler_skipped(self, iteration: Optional[int]) -> None:
        """GradScaler checked the gradients: if it skips the step (``iteration`` given), this
        iteration's backward births since its last check are its calibration, not births."""
        start, self._scaler_mark = self._scaler_mark, len(self.events)
        if iteration is None:
            return
        self.scaler_skips.add(iteration)
        for i in range(start, len(self.events)):
            event = self.events[i]
            if event.phase == "backward" and i not in self.absorbed:
                self.events[i] = dataclasses.replace(event, cause="grad_scaler_skip", detail=SCALER_SKIPPED)
                self.absorbed.add(i)

    def clear_keys(self) -> None:
        self._birth_keys.clear()
        self._carried.clear()
        self._differentiable.clear()


_MAX_CARRIED = 4096  # outputs remembered as carrying a birth on (a training loop after a birth: bounded)
SCALER_SKIPPED = "GradScaler found this non-finite gradient and skipped the optimizer step"
