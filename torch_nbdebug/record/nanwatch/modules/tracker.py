"""The module tracker of a watch: the path stack of the modules running in the watching thread, and the
subscribers it tells as calls start, enter the stack and return (the per-layer table; module mode's
verdicts; with replay, the model's boundaries and replay's kept outputs)."""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Mapping, Optional

import torch

from torch_nbdebug.record.modules import ModuleTracker


class WatchThread:
    """The thread a watch watches. Module hooks are global: another thread's modules (its own watch, a
    worker) are not ours, and say so in ``other_thread``. ``replaying``: a replay runs, the module layer
    keeps out of it."""

    __slots__ = ("thread_id", "other_thread", "replaying")

    def __init__(self) -> None:
        self.thread_id = threading.get_ident()
        self.other_thread = False
        self.replaying = False

    def mine(self) -> bool:
        if threading.get_ident() == self.thread_id:
            return True
        self.other_thread = True
        return False


class CallWatcher:
    """A subscriber of :class:`ThreadTracker`: what it overrides is called, in the order of subscription, for
    the watching thread's module calls, never while a replay runs."""

    def outermost_started(self) -> None:
        """An outermost call (a model's) starts: told before :meth:`call_started`."""

    def call_started(self, args: Any) -> None:
        """A call starts (its forward pre-hook), before its path enters the stack."""

    def call_entered(self, path: str, module: torch.nn.Module) -> None:
        """A call's path entered the stack."""

    def call_returned(self, module: torch.nn.Module, output: Any, path: Optional[str], outermost: bool) -> None:
        """A call returned (or raised: the hook is ``always_call``); its path left the stack."""

    def outermost_returned(self, module: torch.nn.Module, output: Any, path: Optional[str]) -> None:
        """An outermost call returned (or raised), told in the order of subscription with
        :meth:`call_returned` (a watcher that only needs the model's return is not called at every call)."""


class ThreadTracker(ModuleTracker):
    """Only modules running in the watching thread enter the path stack (another thread's modules, under
    their own watch or none, would be named in our events)."""

    def __init__(self, thread: WatchThread, namespace: Optional[Mapping[str, Any]]) -> None:
        super().__init__(namespace)
        self.thread = thread
        # the subscribers' overrides, by event (a loop over bound methods: runs at every module call)
        self._outermost: tuple[Callable[[], None], ...] = ()
        self._started: tuple[Callable[[Any], None], ...] = ()
        self._entered: tuple[Callable[[str, torch.nn.Module], None], ...] = ()
        self._returned: tuple[Callable[[torch.nn.Module, Any, Optional[str], bool], None], ...] = ()
        # (told when the outermost call returns: each ``call_returned`` and ``outermost_returned``, in order)
        self._outer_returned: tuple[Callable[[torch.nn.Module, Any, Optional[str]], None], ...] = ()

    def subscribe(self, watcher: CallWatcher) -> None:
        kind = type(watcher)
        if kind.outermost_started is not CallWatcher.outermost_started:
            self._outermost += (watcher.outermost_started,)
        if kind.call_started is not CallWatcher.call_started:
            self._started += (watcher.call_started,)
        if kind.call_entered is not CallWatcher.call_entered:
            self._entered += (watcher.call_entered,)
        if kind.call_returned is not CallWatcher.call_returned:
            self._returned += (watcher.call_returned,)
            self._outer_returned += (functools.partial(_returned_outermost, watcher.call_returned),)
        if kind.outermost_returned is not CallWatcher.outermost_returned:
            self._outer_returned += (watcher.outermost_returned,)

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        # Runs at every module call: ModuleTracker._pre and WatchThread.mine inlined.
        thread = self.thread
        if threading.get_ident() != thread.thread_id:
            thread.other_thread = True
            return
        stack, quiet = self.stack, thread.replaying
        if not quiet:
            if not stack:
                for outermost in self._outermost:
                    outermost()
            for started in self._started:
                started(args)
        path = self.namer.name(module, stack[-1] if stack else None)
        stack.append(path)
        if not quiet:
            for entered in self._entered:
                entered(path, module)

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        # Runs at every module call: ModuleTracker._post inlined.
        thread, stack = self.thread, self.stack
        if threading.get_ident() != thread.thread_id:
            return
        if stack:
            path: Optional[str] = stack.pop()
        else:
            path = None
            super()._post(module, args, output)
        if thread.replaying:
            return
        if stack:
            for returned in self._returned:
                returned(module, output, path, False)
        else:
            for outer in self._outer_returned:
                outer(module, output, path)


def _returned_outermost(returned: Callable[[torch.nn.Module, Any, Optional[str], bool], None], module: torch.nn.Module,
                        output: Any, path: Optional[str]) -> None:
    returned(module, output, path, True)


_untraced_call: Optional[Callable[..., Any]] = None


def _call(hook: Callable[..., Any], *args: Any) -> Any:
    return hook(*args)


def not_traced(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` as ``torch.compiler.disable(hook)`` runs it (Dynamo never traces into it), without that
    call's cost at every watch's start (about a tenth of an empty watch's start and stop): one disabled
    trampoline, made on first use, calls the watch's own hook. The hook's module is kept, as
    ``disable``'s wrapper keeps it: another watch's replay knows this package's hooks by it
    (``compat.global_module_hook_ids``)."""
    global _untraced_call
    if _untraced_call is None:
        _untraced_call = torch.compiler.disable(_call)
    wrapped = functools.partial(_untraced_call, hook)
    wrapped.__module__ = getattr(getattr(hook, "__func__", hook), "__module__", None)  # type: ignore[assignment]
    return wrapped
