"""Where in the user's own code something happened."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Optional


def is_cell_file(filename: str) -> bool:
    """Whether ``filename`` is a name IPython gave a notebook cell (its temp file names mean nothing
    to users: ``/tmp/ipykernel_42/3270359850.py``, ``<ipython-input-7-...>``)."""
    return "ipykernel_" in filename or filename.startswith("<ipython-input")


def line_label(lineno: int, filename: Optional[str], cell: Optional[int] = None,
               here: Optional[int] = None) -> str:
    """How a view names a line: ``line 3`` in the cell the view is under (execution count ``here``),
    else ``In [2], line 3`` (another numbered cell), ``another cell, line 3`` or ``train.py, line 3``.

    Without cell numbers (no IPython), a notebook cell's line is ``line 3`` as before."""
    if cell is not None and cell == here:
        return f"line {lineno}"
    if cell is not None:
        return f"In [{cell}], line {lineno}"
    if not filename or is_cell_file(filename):
        return f"line {lineno}" if here is None or not filename else f"another cell, line {lineno}"
    return f"{os.path.basename(filename)}, line {lineno}"


@dataclass(frozen=True)
class SourceLine:
    """A line of the user's code: a notebook cell or a file of theirs, never torch internals.

    ``filename`` is what Python compiled (for a notebook cell, IPython's cell name); ``lineno`` is
    1-based within it; ``text`` is the line itself, stripped; ``function`` is the enclosing
    function (``<module>`` for top-level cell code); ``cell`` is the execution count of the notebook
    cell (the 7 of ``In [7]``) when known, as IPython numbers it in its own tracebacks.
    """

    filename: str
    lineno: int
    function: str = "<module>"
    text: str = ""
    cell: Optional[int] = None

    @property
    def location(self) -> str:
        """``In [7], line 14`` for a numbered cell, ``cell line 14`` for another cell, else ``file.py:14``;
        `` in fn()`` added inside a function."""
        if self.cell is not None:
            where = f"In [{self.cell}], line {self.lineno}"
        elif is_cell_file(self.filename):
            where = f"cell line {self.lineno}"
        else:
            where = f"{self.filename}:{self.lineno}"
        if self.function and self.function != "<module>":
            where += f" in {self.function}()"
        return where

    def __str__(self) -> str:
        return f"{self.location}: {self.text}" if self.text else self.location

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
