"""The dispatch mode that sees every ATen op (forward and backward)."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from torch_nbdebug.record import compat
from torch_nbdebug.record.compat import EagerDispatchMode

from torch_nbdebug.errors import NanBirthError
from torch_nbdebug.record.nanwatch.core.ops import pre_state


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
