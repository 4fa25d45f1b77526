"""One base error for the package.

Messages name the value and the fix (see DESIGN.md section 6). The magics turn
:class:`InputError` into IPython's ``UsageError`` so users never see an internal traceback.
"""
from __future__ import annotations


class NbdebugError(Exception):
    """Base class of every error raised by torch_nbdebug itself."""


class InputError(NbdebugError, ValueError):
    """The user's input cannot be used: the message says what to pass instead."""


class NanBirthError(NbdebugError, FloatingPointError):
    """Raised by ``nanwatch(raise_on_birth=True)`` at the first NaN/Inf birth.

    ``report`` holds everything recorded up to the birth; ``event`` is the birth itself.
    """

    def __init__(self, message: str, event: object = None, report: object = None) -> None:
        super().__init__(message)
        self.event = event
        self.report = report
