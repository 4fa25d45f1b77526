"""Where in the user's own code something happened."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class SourceLine:
    """A line of the user's code: a notebook cell or a file of theirs, never torch internals.

    ``filename`` is what Python compiled (for a notebook cell, IPython's cell name); ``lineno`` is
    1-based within it; ``text`` is the line itself, stripped; ``function`` is the enclosing
    function (``<module>`` for top-level cell code).
    """

    filename: str
    lineno: int
    function: str = "<module>"
    text: str = ""

    def __str__(self) -> str:
        where = f"{self.filename}:{self.lineno}"
        if self.function and self.function != "<module>":
            where += f" in {self.function}()"
        return f"{where}: {self.text}" if self.text else where

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
