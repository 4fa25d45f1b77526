"""The automatic explanation: IPython's custom exception hook shows a paragraph under the traceback.

ipykernel does not use ``sys.excepthook``; ``InteractiveShell.set_custom_exc`` is the supported hook.
The handler shows the traceback exactly as IPython would (or hands it to a custom handler that was
installed before us), then the explanation: the card of a ``%%explain`` run, or one paragraph read post
mortem (nothing re-run). It never raises, and stays silent for errors that are not PyTorch's. Removing
it restores the previous handler, unless someone installed theirs after ours (theirs then stays).
"""
from __future__ import annotations

import os
import sys
import types
from typing import Any, Optional

from IPython.display import display

_active: Optional["AutoExplainer"] = None
_pending: dict[int, Any] = {}  # id(exception) -> the Diagnosis of a %%explain run, shown under its traceback


class AutoExplainer:
    """Owns the shell's custom exception handler while the extension is loaded."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.enabled = True  # paragraphs for every PyTorch error (``%explain --auto off`` clears it)
        self._previous: tuple[tuple[type, ...], Any] = (tuple(shell.custom_exceptions), shell.CustomTB)
        self._ours: Any = None

    def install(self) -> None:
        self.shell.set_custom_exc((Exception,), _handler)
        self._ours = self.shell.CustomTB

    @property
    def installed(self) -> bool:
        return self._ours is not None and self.shell.CustomTB is self._ours

    def remove(self) -> None:
        if self.installed:
            self.shell.custom_exceptions, self.shell.CustomTB = self._previous
        self._ours = None

    def show_traceback(self, etype: type, value: BaseException, tb: Any, tb_offset: Optional[int]) -> None:
        previous_types, previous = self._previous
        if previous_types and isinstance(value, previous_types):
            previous(etype, value, tb, tb_offset=tb_offset)  # their handler shows its own traceback
            return
        self.shell.showtraceback((etype, value, _shown(tb, tb_offset or 0)), tb_offset=tb_offset, running_compiled_code=True)

    def explanation(self, value: BaseException) -> Any:
        """The card queued by ``%%explain`` for this exception, else (when enabled) a paragraph."""
        if id(value) in _pending:  # a %%explain run already explained it (None: quietly)
            card = _pending.pop(id(value))
            _pending.clear()
            return card
        _pending.clear()
        if not self.enabled or "torch" not in sys.modules:  # no torch imported: not a PyTorch error
            return None
        from torch_nbdebug.api.explain import explain_exception

        diagnosis = explain_exception(value, namespace=self.shell.user_ns)
        if diagnosis is None or (diagnosis.kind == "other" and not diagnosis.module):
            return None
        return diagnosis.paragraph()


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_MAGICS = os.path.join(_PACKAGE, "magics") + os.sep


def _shown(tb: Any, offset: int = 0) -> Any:
    """The traceback to show: the frames the user would see without us.

    Left out: the frames of ours that ask to be hidden (``__tracebackhide__``) -- IPython honours the
    flag but always shows the innermost frame, and when a torch op called from our recorder's mode
    raises in C, that frame is ours (``return func(*args, **kwargs)``); the cell line that called one of
    our cell magics (``get_ipython().run_cell_magic(...)``) and the shell's frames above the magic, as
    IPython hides its own; under one of our magics, the frame that runs a module's hooks (there
    because the watch installed global module hooks); and the frames the torch-function mode adds around a Python-level torch call
    (``handle_torch_function``, and the call it re-enters: ``Tensor.backward`` is shown once). A new
    chain: the exception's own ``__traceback__`` is left as it is. The first ``offset`` entries (the
    shell's own, which IPython skips by its ``tb_offset``) stay.
    """
    entries = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    ours = [_hidden_ours(t.tb_frame) for t in entries]
    magic = next((i for i, t in enumerate(entries) if ours[i] and _is_magic(t.tb_frame)), None)
    if magic is not None and not any(t.tb_frame.f_code.co_name == "run_cell_magic" for t in entries[:magic]):
        magic = None  # a line magic: the cell's line that called it is the user's own
    drop = set(range(offset, magic or 0))
    if magic is not None:  # the frames our watch's global module hooks add to every module call
        drop.update(i for i in range(magic, len(entries)) if _is_hook_runner(entries[i].tb_frame))
    for i in range(magic or 0, len(entries)):
        if ours[i] and i > 0 and not ours[i - 1] and _is_dispatcher(entries[i - 1].tb_frame):
            drop.add(i - 1)  # handle_torch_function, which called our mode
            after = next((j for j in range(i, len(entries)) if not ours[j]), None)
            if i >= 2 and after is not None and entries[i - 2].tb_frame.f_code is entries[after].tb_frame.f_code:
                drop.add(i - 2)  # the same torch function, entered again by the mode: shown once
    kept = [t for i, t in enumerate(entries) if not ours[i] and i not in drop]
    if not kept or len(kept) == len(entries):
        return entries[0] if entries else None
    shown = None
    for t in reversed(kept):
        shown = types.TracebackType(shown, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return shown


def _hidden_ours(frame: types.FrameType) -> bool:
    # Only our frames are read, and only after they finished (the traceback is being shown).
    return frame.f_code.co_filename.startswith(_PACKAGE) and bool(frame.f_locals.get("__tracebackhide__"))


def _is_magic(frame: types.FrameType) -> bool:
    return frame.f_code.co_filename.startswith(_MAGICS)


def _is_hook_runner(frame: types.FrameType) -> bool:
    code = frame.f_code
    return getattr(code, "co_qualname", "") == "Module._call_impl.<locals>.inner" and \
        code.co_filename.replace("\\", "/").endswith("torch/nn/modules/module.py")


def _is_dispatcher(frame: types.FrameType) -> bool:
    return frame.f_code.co_name == "handle_torch_function" and \
        frame.f_code.co_filename.replace("\\", "/").endswith("torch/overrides.py")


def _handler(shell: Any, etype: type, value: BaseException, tb: Any, tb_offset: Optional[int] = None) -> None:
    auto = _active
    if auto is None or auto.shell is not shell:
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset, running_compiled_code=True)
        return
    auto.show_traceback(etype, value, tb, tb_offset)
    try:
        shown = auto.explanation(value)
        if shown is not None:
            display(shown)
    except Exception:  # noqa: BLE001 - an explanation must never break the shell's error display
        pass


def install(shell: Any) -> AutoExplainer:
    """Install the handler (once per shell); ``%load_ext torch_nbdebug`` calls it."""
    global _active
    if _active is not None and _active.shell is shell and _active.installed:
        return _active
    _active = AutoExplainer(shell)
    _active.install()
    return _active


def uninstall(shell: Any) -> None:
    """Restore the previous handler; ``%unload_ext torch_nbdebug`` calls it."""
    global _active
    if _active is not None and _active.shell is shell:
        _active.remove()
        _active = None
    _pending.clear()


def active(shell: Any) -> Optional[AutoExplainer]:
    """The installed handler of ``shell``, or None."""
    return _active if _active is not None and _active.shell is shell and _active.installed else None


def queue_card(value: BaseException, card: Any) -> None:
    """Show ``card`` under the traceback of ``value`` (the handler displays it after the traceback);
    ``None``: show nothing more for it (quiet, or not a PyTorch error)."""
    _pending.clear()
    _pending[id(value)] = card
