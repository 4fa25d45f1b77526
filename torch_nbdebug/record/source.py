"""Find the user's own line of code from inside torch: skip torch, torch_nbdebug, IPython and the stdlib.

The walk is cached per file name, so repeated calls cost a dictionary lookup per frame rather than
path string tests.
"""
from __future__ import annotations

import linecache
import os
import sys
import sysconfig
import types
from typing import Optional

import torch

from torch_nbdebug.data.source import SourceLine

_LIBRARY_DIRS = tuple(
    os.path.normcase(os.path.abspath(p)) + os.sep
    for p in {
        os.path.dirname(torch.__file__),
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # torch_nbdebug itself
        sysconfig.get_paths().get("stdlib") or "",
        sysconfig.get_paths().get("platstdlib") or "",
    }
    if p
)
# Keyed by file name (what the answer depends on), so no cell's code object is kept alive.
_is_user_cache: dict[str, bool] = {}


def is_user_code(code: types.CodeType) -> bool:
    """True when ``code`` belongs to the user (a notebook cell, a script, a test), not a library."""
    cached = _is_user_cache.get(code.co_filename)
    if cached is None:
        cached = is_user_file(code.co_filename)
        _is_user_cache[code.co_filename] = cached
    return cached


def is_user_file(filename: str) -> bool:
    """True when a file is the user's (a cell, a script), not torch, torch_nbdebug, stdlib or site-packages."""
    if filename.startswith("<frozen"):
        return False
    norm = os.path.normcase(os.path.abspath(filename)) if not filename.startswith("<") else filename
    if norm.startswith(_LIBRARY_DIRS):
        return False
    # Installed libraries (transformers, timm, IPython...) are not the user's line: the notebook
    # line that called into them is, and the module path says where inside them.
    parts = norm.replace("\\", "/").split("/")
    return "site-packages" not in parts and "dist-packages" not in parts


def user_frame(start: Optional[types.FrameType] = None) -> Optional[types.FrameType]:
    """The innermost frame of user code at or above ``start`` (default: the caller)."""
    frame = start if start is not None else sys._getframe(1)
    while frame is not None:
        if is_user_code(frame.f_code):
            return frame
        frame = frame.f_back
    return None


def user_line(start: Optional[types.FrameType] = None) -> Optional[SourceLine]:
    """The user's current line as a :class:`SourceLine`, or None when only library code is running."""
    frame = user_frame(start if start is not None else sys._getframe(1))
    if frame is None:
        return None
    return line_of(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


def line_of(filename: str, lineno: int, function: str = "<module>") -> SourceLine:
    """Build a :class:`SourceLine`, reading the text through linecache (IPython registers cells there)."""
    text = linecache.getline(filename, lineno).strip()
    return SourceLine(filename=filename, lineno=int(lineno), function=function, text=text)


def cell_source(filename: str) -> str:
    """The whole source behind ``filename`` (a cell or file) or '' when unknown."""
    return "".join(linecache.getlines(filename))
