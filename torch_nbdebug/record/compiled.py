"""Keep ``torch.compile``'d code compiled around a watch that pushes a ``TorchDispatchMode``.

Dynamo does not run compiled code while a (non-infra) dispatch mode is on the stack: the first call of
a compiled frame under the mode misses its guards, and dynamo then refuses the frame and marks its
code object "skip" for good (``CatchErrorsWrapper`` in ``torch/_dynamo/convert_frame.py`` returns the
default ``ConvertFrameReturn``, whose strategy is SKIP applied to the code). The model would run eagerly
for the rest of the process, new shapes too, and so would every other model sharing that code
(``nn.Sequential.forward``).

:class:`CompiledCode` is the one mechanism the op-level recorders share (``nanwatch()`` in op mode,
``memory_timeline()``): while it is active the compiler stance is ``force_eager``, so compiled code
runs eagerly *and is seen op by op* (which is what a NaN or memory watch needs: inside a fused kernel
there are no ops to check), dynamo is never asked about a frame, and nothing is marked. When
torch.compile is first used inside the watch (dynamo was not loaded when it began, so no stance could
be set without paying for its import), the frames dynamo refused are unmarked on exit instead.
``note`` says which compiled code ran eagerly under the watch, for the report. Module-mode nanwatch
uses it too: compiled, a model's submodules are fused into one GraphModule and their outputs unseen.

The stance is process-wide: compiled code in other threads also runs eagerly while the watch lasts.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Mapping, Optional

from torch.nn import Module
from torch.nn.modules.module import register_module_forward_pre_hook

from torch_nbdebug.record import compat
from torch_nbdebug.record.source import is_user_file

_MAX_NAMED = 8


class _EagerStance:
    """The process-wide ``force_eager`` stance, shared by every watch alive at once.

    ``set_stance`` restores "the stance before me" on exit, which is only right when watches end in
    the reverse order they began; watches in two threads (or a generator's) can end in any order. So
    the first watch sets the stance and the last one to end restores what was there before.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._token: Any = None

    def acquire(self) -> None:
        with self._lock:
            if self._users == 0:
                self._token = compat.force_eager()
            self._users += 1

    def held(self) -> bool:
        """Whether a watch holds the stance now: dynamo traces nothing (compiled code runs eagerly)."""
        return self._users > 0

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                token, self._token = self._token, None
                compat.restore_stance(token)


_EAGER = _EagerStance()


def eager_stance_held() -> bool:
    """Whether compiled code runs eagerly now (a :class:`CompiledCode` holds the ``force_eager`` stance):
    dynamo traces no frame, so a hook needs no ``torch.compiler.disable`` wrapper against being traced
    (the wrapper runs every frame of the hook through dynamo's frame evaluation: microseconds per call)."""
    return _EAGER.held()


class CompiledCode:
    """Context manager: compiled code runs eagerly inside, compiled again after; names what ran eagerly.

    ``purpose`` finishes the note's sentence: "ran eagerly while {purpose}".
    """

    def __init__(self, namespace: Optional[Mapping[str, Any]] = None, purpose: str = "it was watched") -> None:
        self.namespace = namespace
        self.purpose = purpose
        self.names: tuple[str, ...] = ()  # compiled code that ran eagerly under the watch (filled on exit)
        self.ran_eagerly = False
        self._stance: Optional[bool] = None  # True while this watch holds the shared eager stance
        self._handle: Any = None
        self._callables: dict[int, Any] = {}

    def __enter__(self) -> "CompiledCode":
        if compat.dynamo_loaded():
            _EAGER.acquire()
            self._stance = True
            try:
                compat.global_hook_warning.acquire()  # (released with the hook, in __exit__)
            except BaseException:
                self._stance = None
                _EAGER.release()
                raise
            try:
                self._handle = register_module_forward_pre_hook(self._on_module)
            except BaseException:
                compat.global_hook_warning.release()
                self._stance = None
                _EAGER.release()
                raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._handle is not None:
                self._handle.remove()
                compat.global_hook_warning.release()
        finally:
            self._handle = None
            if self._stance is not None:
                self._stance = None
                _EAGER.release()
                names = [self._name(fn) for fn in self._callables.values()]
            elif compat.dynamo_loaded():  # torch.compile was first used inside the watch
                codes = compat.unskip_dynamo_codes()
                names = [getattr(c, "co_qualname", c.co_name).rpartition("<locals>.")[2]
                         for c in codes if is_user_file(c.co_filename)]
                self.ran_eagerly = self.ran_eagerly or bool(codes)
            else:
                names = []
            self._callables.clear()
        self.names = tuple(dict.fromkeys(names))
        self.ran_eagerly = self.ran_eagerly or bool(self.names)

    @property
    def note(self) -> str:
        """One sentence for the report ("" when no compiled code ran under the watch)."""
        if not self.ran_eagerly:
            return ""
        which = f" ({', '.join(self.names)})" if self.names else ""
        return f"torch.compile'd code{which} ran eagerly while {self.purpose}; it runs compiled again afterwards"

    # -- hook ------------------------------------------------------------------------------------
    def _on_module(self, module: Any, args: Any) -> None:
        # Every compiled call runs through dynamo's wrapper frame: a module called under one is
        # running eagerly inside compiled code (a compiled model's own submodules, or a compiled step).
        if len(self._callables) >= _MAX_NAMED:
            return
        try:
            for fn in compat.compiled_callables(sys._getframe(1)):
                self._callables.setdefault(id(fn), fn)
        except Exception:  # noqa: BLE001 - the note is a courtesy: never disturb the user's forward
            return

    def _name(self, fn: Any) -> str:
        """The user's name for a compiled module (``model``) or the compiled function's name."""
        target = fn if isinstance(fn, Module) else getattr(fn, "__self__", None)
        if isinstance(target, Module):
            items = self._namespace_items()
            # The name the user calls (the compiled wrapper), else the name of the original module.
            for key, value in items:
                if compat.is_compiled_module(value) and compat.original_module(value) is target:
                    return str(key)
            return next((str(key) for key, value in items if value is target), type(target).__name__)
        name = str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__)
        return name.rpartition("<locals>.")[2]  # train_step, not main.<locals>.train_step

    def _namespace_items(self) -> list[tuple[Any, Any]]:
        if self.namespace is None:
            return []
        try:
            return [(k, v) for k, v in self.namespace.items() if isinstance(k, str) and not k.startswith("_")]
        except Exception:  # noqa: BLE001 - a strange namespace only costs the name
            return []
