"""One weak reference plus version: a tensor held without keeping it alive, given back only while it
still holds the values it had (its version counter, bumped by every in-place write, unchanged)."""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from torch_nbdebug.record.compat import tensor_version
from torch_nbdebug.record.nanwatch.core.ops import version_of


class LiveRef:
    """``t`` held weakly with its version when taken (-1: an inference tensor, which keeps no counter)."""

    __slots__ = ("_ref", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self._ref = weakref.ref(t)
        self.version = -1 if t.is_inference() else tensor_version(t)  # (version_of inlined: made at every module exit)

    @classmethod
    def of(cls, t: torch.Tensor) -> Optional["LiveRef"]:
        """A reference that can tell a change, or None: a tensor without weak references (some subclasses)
        or without a version counter (an inference tensor) cannot."""
        try:
            return None if t.is_inference() else cls(t)
        except (TypeError, RuntimeError):
            return None

    def alive(self) -> Optional[torch.Tensor]:
        """The tensor while it lives, changed or not."""
        return self._ref()

    def get(self) -> Optional[torch.Tensor]:
        """The tensor while it lives and holds the same values (not written in place since)."""
        t = self._ref()
        return t if t is not None and version_of(t) == self.version else None

    def changed(self) -> bool:
        """Alive, and written in place since it was taken."""
        t = self._ref()
        return t is not None and version_of(t) != self.version
