"""Replay's view of the model calls, as the module tracker reports them.

- :class:`ModelBoundaries`: the per-op mode is off while a model's forward runs (its module layer watches
  it); a new forward names the backward births of the last one first; a model call that ran without the
  per-op mode hands its outputs to the backward layer (:mod:`replay.backward`).
- :class:`ModuleMoves` (when the backward layer is off): the module boundaries crossed in forward, so a
  backward birth of an op run inside a model, where no mode ran, is given its module and the model call's
  line.
"""
from __future__ import annotations

import bisect
import contextlib
from typing import Any, Callable, Iterator, Optional, Protocol

import torch

from torch_nbdebug.record import compat
from torch_nbdebug.record.nanwatch.checks.mode import ModeSwitch
from torch_nbdebug.record.nanwatch.core.events import Place, here
from torch_nbdebug.record.nanwatch.modules.tracker import CallWatcher
from torch_nbdebug.record.nanwatch.replay.backward import BackwardWatch
from torch_nbdebug.record.nanwatch.replay.forward import ModelCalls

_NODE_CAP = 200_000  # module boundaries remembered for backward births (oldest dropped first)


class BoundaryHost(Protocol):
    """What the model boundaries use of the recorder."""

    def module_path(self) -> Optional[str]: ...

    def internal_error(self, where: str, exc: Exception) -> None: ...

    def name_backward_births(self) -> None: ...


class ModelBoundaries(CallWatcher):
    """``backward`` (replay's backward layer, when backward ops are watched) checks the backward of a model
    call whose forward ran without the per-op mode. ``busy``: an optimizer step runs."""

    def __init__(self, host: BoundaryHost, switch: ModeSwitch, model_calls: ModelCalls,
                 backward: Optional[BackwardWatch], busy: Callable[[], bool]) -> None:
        self.host, self.switch, self.model_calls, self.backward, self._busy = host, switch, model_calls, backward, busy
        self.model_off = False  # the mode was taken off while a model's forward runs

    def outermost_started(self) -> None:
        if compat.current_autograd_node() is not None:
            return  # a forward run by backward (checkpointing): part of the running backward
        switch = self.switch
        if self.model_calls.calls and switch.mode is not None:
            self.host.name_backward_births()  # a new forward: the last one's backward is done
        if not switch.on_top() or switch.suspended or self._busy():
            return
        switch.suspend()
        self.model_off = True

    def outermost_returned(self, module: torch.nn.Module, output: Any, path: Optional[str]) -> None:
        if self.model_off and self.backward is not None and torch.is_grad_enabled():
            # its backward is checked by the backward layer (the gradients into its outputs are kept until then)
            try:
                self.backward.model_called(module, output, path)
            except Exception as exc:  # noqa: BLE001 - see OpWatchMode
                self.host.internal_error(f"the output of {type(module).__name__}", exc)
        if self.model_off:
            self.model_off = False
            self.switch.resume()


class ModuleMoves(CallWatcher):
    """(sequence nr, module path now) at each module boundary in forward, and the model call's line."""

    def __init__(self, host: BoundaryHost) -> None:
        self.host = host
        self._moves: list[tuple[int, Optional[str]]] = []
        self._model_place: Optional[Place] = None

    def outermost_started(self) -> None:
        if compat.current_autograd_node() is None:  # (a forward run by backward: the running backward's)
            self._model_place = here(None, None)

    def call_entered(self, path: str, module: torch.nn.Module) -> None:
        self._moved()

    def call_returned(self, module: torch.nn.Module, output: Any, path: Optional[str], outermost: bool) -> None:
        self._moved()

    def _moved(self) -> None:
        if len(self._moves) > _NODE_CAP:
            del self._moves[: _NODE_CAP // 2]
        self._moves.append((compat.next_sequence_nr(), self.host.module_path()))

    def place_of(self, seq: int) -> Optional[Place]:
        """The place of an op inside a model's forward, where no mode ran: its module, the model call's line."""
        if not self._moves:
            return None
        i = bisect.bisect_right(self._moves, (seq, "\uffff")) - 1
        path = self._moves[i][1] if i >= 0 else None
        if path is not None and self._model_place is not None:
            return self._model_place._replace(module=path)
        return None

    @contextlib.contextmanager
    def isolated(self) -> Iterator[None]:
        """A replay's own boundaries: its module calls are not the user's forward's."""
        saved = (self._moves, self._model_place)
        self._moves = []
        try:
            yield
        finally:
            self._moves, self._model_place = saved

    def forget(self) -> None:
        self._moves.clear()
        self._model_place = None
