"""The module tracker of a watch: the path stack of the modules running in the watching thread, and the
subscribers told as calls start and end (the module checks; with replay, the recorder's model boundaries)."""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, Mapping, Optional

import torch

from torch_nbdebug.record.modules import ModuleTracker
from torch_nbdebug.record.nanwatch.modules.checks import ModuleChecks


class ThreadTracker(ModuleTracker):
    """Module hooks are global: only modules running in the watching thread enter its path stack
    (another thread's modules, under their own watch or none, would be named in our events)."""

    def __init__(self, checks: ModuleChecks, namespace: Optional[Mapping[str, Any]],
                 outer: Optional[Callable[[bool], None]] = None, moved: Optional[Callable[[], None]] = None,
                 ended: Optional[Callable[[torch.nn.Module, Any, Optional[str]], None]] = None, **kw: Any) -> None:
        super().__init__(namespace, **kw)
        self._checks = checks
        self._ended = ended  # replay: the outermost call returned (module, output, its path)
        self._outer = outer  # replay: told when the outermost module call starts (True) and ends (False)
        self._moved: Callable[[], None] = moved or (lambda: None)

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        # Runs at every module call: ModuleTracker._pre and ModuleChecks.mine inlined.
        checks = self._checks
        if threading.get_ident() != checks.thread_id:
            checks.other_thread = True
            return
        stack, outer = self.stack, self._outer
        if outer is not None and not checks.replaying:
            if not stack:
                outer(True)
            checks.started(args)
        elif not stack:
            checks.model_started()
        path = self.namer.name(module, stack[-1] if stack else None)
        stack.append(path)
        if self._on_enter is not None:
            self._on_enter(path, module)
        if outer is not None and not checks.replaying:
            self._moved()

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if threading.get_ident() == self._checks.thread_id:
            path = self.stack[-1] if self.stack else None
            super()._post(module, args, output)
            if self._outer is not None and not self._checks.replaying:
                self._moved()
                if not self.stack:
                    if self._ended is not None:
                        self._ended(module, output, path)
                    self._outer(False)
                    self._checks.forward_over()


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
