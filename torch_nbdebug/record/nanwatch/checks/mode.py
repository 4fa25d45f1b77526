"""The dispatch mode that sees every ATen op (forward and backward), and its switch (on, suspended, off)."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from torch_nbdebug.record import compat
from torch_nbdebug.record.compat import EagerDispatchMode

from torch_nbdebug.errors import NanBirthError
from torch_nbdebug.record.lifecycle import HookScope
from torch_nbdebug.record.nanwatch.core.ops import pre_state

_stack_len = compat.dispatch_stack_len
_stack_at = compat.dispatch_mode_at


class OpWatchMode(EagerDispatchMode):
    """Runs each op, then hands (func, args, kwargs, out) to ``on_op``; never changes a result.

    A failure inside our own checking must not break the user's program: it goes to ``on_error``
    (which notes it) and the op's result is returned as usual. Only ``NanBirthError`` (asked for
    with raise_on_birth) passes through.
    """

    def __init__(self, on_op: Callable[[Any, tuple, dict, Any, Optional[torch.Tensor]], None],
                 on_error: Callable[[str, Exception], None]) -> None:
        super().__init__()
        self._on_op = on_op
        self._on_error = on_error

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        __tracebackhide__ = True  # noqa: F841 - IPython hides this frame in the user's tracebacks
        kwargs = kwargs or {}
        try:
            # An in-place op (``x.log_()``) overwrites its input: keep its finiteness from before.
            pre = pre_state(func, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - a debugging aid must not change the program
            pre = None
            self._on_error(str(func), exc)
        out = func(*args, **kwargs)
        try:
            self._on_op(func, args, kwargs, out, pre)
        except NanBirthError:
            raise
        except Exception as exc:  # noqa: BLE001 - a debugging aid must not change the program
            self._on_error(str(func), exc)
        return out


def take_function_mode(mode: Any) -> None:
    """Take ``mode`` out of the function-mode stack from under modes pushed after it (kept, in order)."""
    above = []
    while compat.function_stack_len():
        top = compat.pop_function_mode()
        if top is mode:
            break
        above.append(top)
    for top in reversed(above):
        compat.push_function_mode(top)


class ModeSwitch:
    """A watch's per-op mode on the dispatch stack, and replay's backward gate on the function-mode stack:
    put on at the start, taken off (only when on top) while our own code or an optimizer step runs, off
    for a rerun or a replay's backward, and off for good at the end."""

    __slots__ = ("mode", "gate", "_held_mode", "_held_gate")

    def __init__(self) -> None:
        self.mode: Optional[OpWatchMode] = None
        self.gate: Any = None  # replay.backward.BackwardGate, a function mode
        self._held_mode: Optional[OpWatchMode] = None  # suspended: taken off, to be put back by resume
        self._held_gate: Any = None

    def put_on(self, scope: HookScope, mode: OpWatchMode, gate: Any = None) -> None:
        """Enter ``mode`` (and ``gate``); ``scope`` takes each off again, only if it was entered."""
        mode.__enter__()
        self.mode = mode
        scope.callback(self._take_off_mode)
        if gate is not None:
            gate.__enter__()
            self.gate = gate
            scope.callback(self._take_off_gate)

    @property
    def suspended(self) -> bool:
        return self._held_mode is not None

    def on_top(self) -> bool:
        mode = self.mode
        return mode is not None and bool(_stack_len()) and _stack_at(_stack_len() - 1) is mode

    def on_stack(self) -> bool:
        mode = self.mode
        return mode is not None and any(_stack_at(i) is mode for i in range(_stack_len()))

    def pop(self) -> None:
        compat.pop_dispatch_mode()

    def push(self) -> None:
        compat.push_dispatch_mode(self.mode)

    def suspend(self) -> None:
        """Take the mode off the stack (only when it is on top): the ops that run meanwhile are not checked,
        so they should not pay the Python dispatch. The gate goes with it (a compiled model sees no mode)."""
        mode = self.mode
        if mode is not None and self._held_mode is None and _stack_len() and _stack_at(_stack_len() - 1) is mode:
            compat.pop_dispatch_mode()
            self._held_mode = mode
            gate = self.gate
            if gate is not None and compat.function_stack_len() and \
                    compat.function_mode_at(compat.function_stack_len() - 1) is gate:
                compat.pop_function_mode()
                self._held_gate = gate

    def resume(self) -> None:
        mode, self._held_mode = self._held_mode, None
        gate, self._held_gate = self._held_gate, None
        if mode is not None:
            compat.push_dispatch_mode(mode)
        if gate is not None:
            compat.push_function_mode(gate)

    def _take_off_gate(self) -> None:
        gate, self.gate = self.gate, None
        if gate is None:
            return
        if compat.function_stack_len() and compat.function_mode_at(compat.function_stack_len() - 1) is gate:
            gate.__exit__(None, None, None)
        else:  # the user's own function mode above it (left on by their code): take ours out only
            take_function_mode(gate)

    def _take_off_mode(self) -> None:
        mode, self.mode = self.mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
