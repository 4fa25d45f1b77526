"""What the per-op watch remembers of the forward: where each op that made an autograd node ran (a backward
birth names its forward op's module and line), and the small constants a half-precision op rounded to 0 (the
hint of a 0/0 born there, by iteration and module)."""
from __future__ import annotations

from typing import Any, Optional

from torch_nbdebug.record.nanwatch.core.events import Place, here

_NODE_CAP = 200_000  # forward places remembered for backward births (oldest dropped first)
_EPS_CAP = 4096  # rounded constants remembered (a long loop: the earlier iterations' are forgotten)


class ForwardPlaces:
    """``by_seq``: autograd sequence number -> where its forward op ran."""

    __slots__ = ("by_seq", "_rounded")

    def __init__(self) -> None:
        self.by_seq: dict[int, Place] = {}
        self._rounded: dict[tuple[int, Optional[str]], float] = {}  # (iteration, module) -> an eps rounded to 0

    def remember(self, seq: int, module: Optional[str], func: Any) -> None:
        places = self.by_seq
        if len(places) > _NODE_CAP:
            for key in list(places)[: _NODE_CAP // 2]:
                del places[key]
        places[seq] = here(module, func)

    def note_rounded(self, iteration: int, module: Optional[str], value: float) -> None:
        if len(self._rounded) >= _EPS_CAP:
            self._rounded.clear()
        self._rounded[(iteration, module)] = value

    def rounded(self, iteration: int, module: Optional[str]) -> Optional[float]:
        return self._rounded.get((iteration, module))

    def clear(self) -> None:
        self.by_seq.clear()
        self._rounded.clear()
