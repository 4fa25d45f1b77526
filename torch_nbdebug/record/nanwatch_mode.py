"""The dispatch mode that sees every ATen op (forward and backward) and the deferred flag queue."""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torch_nbdebug.errors import NanBirthError
from torch_nbdebug.record.nanwatch_events import Place, Shape
from torch_nbdebug.record.nanwatch_ops import pre_state


class OpWatchMode(TorchDispatchMode):
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


class Pending(NamedTuple):
    """One deferred check: device flags ``[bad, nan, negative]`` per output then per input, plus context."""

    flags: torch.Tensor
    n_out: int
    external: tuple[bool, ...]
    outputs: tuple[Shape, ...]
    inputs: tuple[Shape, ...]
    phase: str
    op: str
    place: Place
    extra: dict
    iteration: int


def device_flags(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``[[bad...], [nan...], [negative...]]`` of each tensor's propagating sum, on the device, no sync.

    A sum that is -inf (bad, not NaN, negative) means only -inf values: an additive mask. The sums
    accumulate in a wider type (float32 for half types, float64 for float32), so that huge finite
    values cannot overflow them: these flags are never confirmed against the tensor later."""
    sums = torch.stack([t.sum(dtype=_WIDER.get(t.dtype, t.dtype)).double() for t in tensors])
    return torch.stack([~torch.isfinite(sums), torch.isnan(sums), sums < 0])


_WIDER = {torch.float16: torch.float32, torch.bfloat16: torch.float32, torch.float32: torch.float64}


def read_all(pending: list[Pending]) -> list[list[list[bool]]]:
    """Read every queued flag with one transfer per device."""
    by_device: dict[torch.device, list[int]] = {}
    for i, p in enumerate(pending):
        by_device.setdefault(p.flags.device, []).append(i)
    result: list[Any] = [None] * len(pending)
    for indices in by_device.values():
        flat = torch.cat([pending[i].flags.flatten() for i in indices]).cpu().tolist()
        pos = 0
        for i in indices:
            n = pending[i].flags.shape[1]
            result[i] = [flat[pos:pos + n], flat[pos + n:pos + 2 * n], flat[pos + 2 * n:pos + 3 * n]]
            pos += 3 * n
    return result
