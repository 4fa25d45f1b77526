"""What the ``with`` twins share around their recorders: a recorder started inside what was entered
before it (compiled code run eagerly, the allocator's history) leaves nothing entered when it fails to
start; and a block on a finishing recorder (``monitor()``, ``profile()``) runs once, its recorder ends
with how the block ended, and an error of ours never hides the user's."""
from __future__ import annotations

from typing import Any, Callable, ClassVar, ContextManager, Generic, Literal, Optional, TypeVar

from torch_nbdebug.errors import InputError

__all__ = ["Ending", "RecorderBlock", "ending", "start_within"]

Ending = Literal["finished", "stopped", "failed"]
R = TypeVar("R")


def start_within(entered: Optional[ContextManager[Any]], start: Callable[[], object]) -> None:
    """``start`` a recorder inside ``entered`` (already entered; None: nothing); when starting fails,
    ``entered`` is exited before the error propagates."""
    try:
        start()
    except BaseException:
        if entered is not None:
            entered.__exit__(None, None, None)
        raise


def ending(exc_type: Optional[type[BaseException]]) -> Ending:
    """How a block ended: it finished, was stopped (Jupyter's Stop is a ``KeyboardInterrupt``) or failed."""
    if exc_type is None:
        return "finished"
    return "stopped" if issubclass(exc_type, KeyboardInterrupt) else "failed"


class RecorderBlock(Generic[R]):
    """A ``with`` block around one recorder, usable once: ``__enter__`` takes the recorder with
    :meth:`_claim`; ``__exit__`` gives it up and hands it to :meth:`_end` with the block's ending, then
    runs :meth:`_ended` whatever happened."""

    _recorder: Optional[R]
    _entered: bool
    _reused: ClassVar[str]  # the error of a second ``with`` on the same object

    def _claim(self) -> R:
        recorder = self._recorder
        if recorder is None or self._entered:
            raise InputError(self._reused)
        self._entered = True
        return recorder

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        recorder, self._recorder = self._recorder, None
        assert recorder is not None
        try:
            self._end(recorder, ending(exc_type))
        except Exception:
            if exc_type is None:
                raise  # otherwise the user's own exception propagates, not ours
        finally:
            self._ended()

    def _end(self, recorder: R, status: Ending) -> None:
        """Finish the recorder (it removes what it installed first) and keep its result."""
        raise NotImplementedError

    def _ended(self) -> None:
        """After :meth:`_end`, also when it failed (nothing by default)."""
