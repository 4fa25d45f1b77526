"""One lifecycle for every recorder: what it installs, and taking all of it off again.

A recorder installs several things (module hooks, optimizer hooks, a dispatch mode, a module tracker)
and must leave none of them behind, whatever happens: an error while installing, a failing undo, a
Jupyter Stop (an asynchronous ``KeyboardInterrupt``) between two steps. :class:`HookScope` is an
``ExitStack`` for exactly that, so a recorder's ``start`` is the list of what it installs::

    self._scope.open(self._install)      # def _install(self, scope): scope.hook(...); scope.enter(mode)
    ...
    self._scope.close()

- :meth:`HookScope.open` runs the installing steps with a Stop held (:class:`deferred_interrupts`): they
  all run, then the Stop is raised. If installing fails (or a Stop is raised at its end), everything
  installed so far is undone before the error propagates.
- :meth:`HookScope.close` undoes in reverse order with a Stop held, and once more outside the held
  block in case a Stop came before the block took effect (every undo is taken off the list before it
  runs, so nothing is undone twice). An undo that fails does not stop the others: they all run, then
  the first failure is raised, with the others added as notes.

Also: the small modes a recorder enters to see each call (:class:`CallDispatchMode`, :class:`CallFunctionMode`),
the hooks it puts on tensors while it runs (:class:`TensorHooks`), and ``with recorder:`` (:class:`Recorder`).
Imports torch, record/compat.py and record/interrupts.py.
"""
from __future__ import annotations

import abc

from typing import Any, Callable, ContextManager, Protocol, TypeVar

from torch.overrides import TorchFunctionMode

from torch_nbdebug.record.compat import TorchDispatchMode
from torch_nbdebug.record.interrupts import deferred_interrupts

__all__ = ["CallDispatchMode", "CallFunctionMode", "HookScope", "Recorder", "Removable", "TensorHooks"]

C = TypeVar("C", bound=ContextManager[Any])
R = TypeVar("R", bound="Recorder")


class Removable(Protocol):
    """What torch's hook registrations return (``RemovableHandle``): ``remove()`` is idempotent."""

    def remove(self) -> None: ...


_ExcInfo = tuple[Any, Any, Any]
_NO_EXC: _ExcInfo = (None, None, None)


class HookScope:
    """The hooks, modes and callbacks a recorder installed, undone in reverse order by :meth:`close`."""

    __slots__ = ("_undo",)

    def __init__(self) -> None:
        # each undo gets the exception (type, value, traceback) the recording ended with, or Nones
        self._undo: list[Callable[[_ExcInfo], object]] = []

    # -- what a recorder installs ----------------------------------------------------------------
    def hook(self, handle: Removable) -> Removable:
        """Remember a hook's handle (from ``register_*_hook``): removed on close."""
        self._undo.append(lambda exc: handle.remove())
        return handle

    def enter(self, manager: C) -> C:
        """Enter a context manager (a mode, a tracker); it is exited on close with the recording's
        exception. Pushed only once entered: close exits nothing that was not entered."""
        manager.__enter__()
        self._undo.append(lambda exc: manager.__exit__(*exc))
        return manager

    def callback(self, undo: Callable[[], object]) -> None:
        """Run ``undo()`` on close (for what has no handle, or a mode that may already be off)."""
        self._undo.append(lambda exc: undo())

    def __len__(self) -> int:
        return len(self._undo)

    # -- the lifecycle ---------------------------------------------------------------------------
    def open(self, install: Callable[["HookScope"], None]) -> None:
        """Run ``install(scope)`` with a Stop held; on any failure, undo what it installed and re-raise."""
        try:
            with deferred_interrupts():  # a Stop now is raised once everything is installed...
                install(self)
        except BaseException:
            self.close()  # ...and then all of it is removed again
            raise

    def close(self, exc_type: Any = None, exc: Any = None, tb: Any = None) -> None:
        """Undo everything, last installed first; safe to call again (then it undoes nothing)."""
        info: _ExcInfo = (exc_type, exc, tb) if exc_type is not None else _NO_EXC
        try:
            with deferred_interrupts():  # a Stop here is raised once everything is undone
                self._undo_all(info)
        finally:
            self._undo_all(info)  # if a Stop came before the block above took effect; else a no-op

    def _undo_all(self, info: _ExcInfo) -> None:
        failures: list[BaseException] = []
        while self._undo:
            undo = self._undo.pop()
            try:
                undo(info)
            except BaseException as failure:  # keep undoing: a mode left behind breaks the user's session
                failures.append(failure)
        if failures:
            first = failures[0]
            for other in failures[1:]:
                first.add_note(f"also failed while removing a recorder's hooks: {type(other).__name__}: {other}")
            raise first


class TensorHooks:
    """The hooks a recorder puts on tensors and autograd nodes while it runs, each removed when it stops;
    past ``cap`` of them, those whose tensor or node is gone are forgotten (a long loop)."""

    __slots__ = ("_handles", "_cap")

    def __init__(self, cap: int = 4096) -> None:
        self._handles: list[Any] = []
        self._cap = cap

    def keep(self, handle: Any) -> None:
        self._handles.append(handle)
        if len(self._handles) > self._cap:
            self._handles = [h for h in self._handles if h.hooks_dict_ref() is not None]

    def remove_all(self, failed: Callable[[Exception], None]) -> None:
        """Remove every one, even when removing another failed (a hook left behind changes the program):
        each failure goes to ``failed``."""
        handles, self._handles = self._handles, []
        for handle in handles:
            try:
                handle.remove()
            except Exception as exc:  # noqa: BLE001 - keep removing
                failed(exc)


class Recorder(abc.ABC):
    """A recorder as a context manager: ``with recorder:`` is ``start()``, then ``stop()`` whatever happens."""

    @abc.abstractmethod
    def start(self) -> None:
        """Install everything (with a :class:`HookScope`); on failure, nothing is left installed."""

    @abc.abstractmethod
    def stop(self) -> Any:
        """Remove everything; what was recorded."""

    def __enter__(self: R) -> R:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


Handler = Callable[[Any, Any, dict], Any]


class _Handled:
    """A mode that hands each call to its recorder's ``handler(func, args, kwargs)``, which runs it."""

    def __init__(self, handler: Handler) -> None:
        super().__init__()
        self.handler = handler


class CallDispatchMode(_Handled, TorchDispatchMode):
    """Each ATen op goes to ``handler(func, args, kwargs)``; what it returns is the op's result."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        __tracebackhide__ = True  # noqa: F841 - IPython hides this frame in the user's tracebacks
        return self.handler(func, args, kwargs or {})


class CallFunctionMode(_Handled, TorchFunctionMode):
    """Each torch function goes to ``handler(func, args, kwargs)``; what it returns is the call's result."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        __tracebackhide__ = True  # noqa: F841 - IPython hides this frame in the user's tracebacks
        return self.handler(func, args, kwargs or {})
