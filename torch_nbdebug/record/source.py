"""The user's code and names: their own line (skipping torch, torch_nbdebug, IPython and the stdlib),
the notebook cell it is in (:func:`cell_number`, the 7 of ``In [7]``), and their namespace as every
tool reads it (:func:`caller_namespace`).

The walk is cached per file name, so repeated calls cost a dictionary lookup per frame rather than
path string tests.
"""
from __future__ import annotations

import inspect
import linecache
import os
import re
import sys
import sysconfig
import types
from typing import Any, Iterator, Mapping, Optional

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
    frame: Optional[types.FrameType] = start if start is not None else sys._getframe(1)
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
    """Build a :class:`SourceLine`, reading the text through linecache (IPython registers cells there)
    and the cell's execution count through IPython's compiler."""
    text = linecache.getline(filename, lineno).strip()
    return SourceLine(filename=filename, lineno=int(lineno), function=function, text=text,
                      cell=cell_number(filename))


_INPUT_NAME = re.compile(r"<ipython-input-(\d+)-")


def cell_number(filename: str) -> Optional[int]:
    """The execution count of the notebook cell compiled as ``filename`` (7 for ``In [7]``), or None.

    IPython's caching compiler remembers it for its own tracebacks (``Cell In[7], line 14``), for
    every cell and every body a magic compiles through it (``%%nanwatch`` does); ipykernel's cell
    file names (a hash of the code) do not carry it. IPython is only looked up, never imported: the
    record layer runs without it, and then there are no cells.

    A number the shell has not reached yet is no cell's: IPython counts a cell before running it, so
    code compiled *during* cell 7 with the shell's ``execution_count`` (8) gets None, never a wrong
    ``In [8]`` (compile it with :func:`running_cell_number` instead).
    """
    shell = _shell()
    numbers = getattr(getattr(shell, "compile", None), "_filename_map", None)
    if isinstance(numbers, dict):
        number = numbers.get(filename)
        reached = getattr(shell, "execution_count", None)
        if isinstance(number, int) and 0 < number and (not isinstance(reached, int) or number < reached):
            return number
        return None
    match = _INPUT_NAME.match(filename)  # IPython before 8 named cells <ipython-input-7-hash>
    return int(match.group(1)) if match else None


def running_cell_number(start: Optional[types.FrameType] = None) -> Optional[int]:
    """The execution count of the innermost notebook cell running at or above ``start`` (default: the
    caller), or None outside a cell: the number to give code a magic compiles for that cell."""
    numbers = getattr(getattr(_shell(), "compile", None), "_filename_map", None)
    if not isinstance(numbers, dict):
        return None
    frame: Optional[types.FrameType] = start if start is not None else sys._getframe(1)
    while frame is not None:
        number = numbers.get(frame.f_code.co_filename)
        if isinstance(number, int) and number > 0:
            return number
        frame = frame.f_back
    return None


def _shell() -> Any:
    """The running IPython shell, if IPython is loaded at all (never imported from here)."""
    get_shell = getattr(sys.modules.get("IPython"), "get_ipython", None)
    return get_shell() if callable(get_shell) else None


def cell_source(filename: str) -> str:
    """The whole source behind ``filename`` (a cell or file) or '' when unknown."""
    return "".join(linecache.getlines(filename))


# -- the user's namespace ----------------------------------------------------------------------
def inspectable(value: Any) -> bool:
    """Whether ``isinstance`` can look at ``value``: its ``__class__`` can be read.

    ``isinstance`` falls back to ``value.__class__``, which an unbound lazy proxy (werkzeug's
    ``LocalProxy``, ``lazy_object_proxy``) or a ``weakref.proxy`` to a dead object raises from.
    """
    try:
        value.__class__  # noqa: B018 - the read is the test
    except Exception:  # noqa: BLE001 - whatever the user's object raises, we only skip it
        return False
    return True


class UserNamespace(Mapping[str, Any]):
    """The user's variables as every tool reads them: live, and only what can be inspected.

    Built over a mapping (the shell's ``user_ns``, an explicit ``namespace=``) or over the frame of
    the code that called a Python twin, whose locals shadow its globals. Locals are read at the
    moment they are needed, so a model created inside the ``with`` block is named too; nothing is
    kept between reads, and :meth:`release` drops the frame when the tool is done.

    Names that are not strings, and values that cannot be inspected, are left out and remembered in
    :attr:`skipped` (scans deeper in the objects add theirs with :meth:`skip`), so every scan below
    can use ``isinstance`` and the tools can say what they could not look at.
    """

    def __init__(self, mapping: Optional[Mapping[str, Any]] = None,
                 frame: Optional[types.FrameType] = None) -> None:
        self._mapping = mapping
        self._frame = frame
        self._skipped: dict[str, None] = {}  # ordered set

    # -- reading ---------------------------------------------------------------------------------
    def _layers(self) -> list[Mapping[Any, Any]]:
        """Where names are looked up, innermost first (a fresh read of the frame's locals)."""
        if self._frame is not None:
            local = frame_locals(self._frame)
            return [self._frame.f_globals] if local is None else [local, self._frame.f_globals]
        return [self._mapping] if self._mapping is not None else []

    def items(self) -> Any:  # a list: one read of the frame per scan
        merged: dict[str, Any] = {}
        for layer in reversed(self._layers()):
            try:
                pairs = list(layer.items())
            except Exception:  # noqa: BLE001 - a user's mapping that cannot be listed
                self.skip("<namespace>")
                continue
            merged.update(pairs)
        return [(k, v) for k, v in merged.items() if self._readable(k, v)]

    def values(self) -> Any:
        return [v for _, v in self.items()]

    def keys(self) -> Any:
        return [k for k, _ in self.items()]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.items())

    def __getitem__(self, key: str) -> Any:
        for layer in self._layers():
            try:
                value = layer[key]
            except KeyError:
                continue
            if not self._readable(key, value):
                raise KeyError(key)
            return value
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        try:
            self[key]  # type: ignore[index]
        except (KeyError, TypeError):
            return False
        return True

    def _readable(self, key: Any, value: Any) -> bool:
        if not issubclass(type(key), str):  # type() never runs the user's code; isinstance may
            return False
        if inspectable(value):
            return True
        self.skip(key)
        return False

    def mapping_ids(self) -> set[int]:
        """``id`` of the dicts read (the shell's ``user_ns``, the caller's globals): a walk of the
        values must not name everything again through ``ns = globals()``."""
        if self._frame is not None:
            return {id(self._frame.f_globals)}
        return {id(self._mapping)} if self._mapping is not None else set()

    # -- what could not be read ------------------------------------------------------------------
    def skip(self, name: str) -> None:
        """Remember a value (or a name inside one, ``cache["k"]``) that could not be inspected."""
        self._skipped[str(name)] = None

    @property
    def skipped(self) -> tuple[str, ...]:
        return tuple(self._skipped)

    def release(self) -> None:
        """Forget the frame (and so its locals): the tool is done with the caller."""
        self._frame = None
        self._mapping = None


def skipped_note(names: "tuple[str, ...] | list[str]") -> str:
    """One line for the user: how many objects were skipped, and which."""
    if not names:
        return ""
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return (f"skipped {len(names)} object(s) that could not be inspected ({shown}): they raise when their "
            f"type or contents are read, e.g. an unbound proxy or a dead weak reference")


def frame_locals(frame: types.FrameType) -> Optional[dict[str, Any]]:
    """The locals of a function's frame now, as a new dict; None for module-level code.

    Before Python 3.13 ``frame.f_locals`` fills a snapshot dict that stays attached to the frame and
    keeps every value it holds alive until the function returns, even after the function deletes
    the variable. The snapshot is emptied again after it is copied when nobody else holds it (the
    refcount is the frame's, ours and ``getrefcount``'s): the next ``locals()`` refills it, so the
    user's program sees no difference, and the tool's copy lives only as long as the scan using it.
    """
    if frame.f_locals is frame.f_globals:  # a notebook cell or a module: the globals are the locals
        return None
    if not frame.f_code.co_flags & inspect.CO_OPTIMIZED:  # class body or exec(..., locals): the real dict
        return frame.f_locals
    snapshot = frame.f_locals
    copy = dict(snapshot)
    if sys.version_info < (3, 13) and sys.getrefcount(snapshot) <= 3:
        snapshot.clear()
    return copy


def caller_namespace(namespace: Optional[Mapping[str, Any]] = None) -> UserNamespace:
    """The one way the tools read the user's variables.

    ``namespace`` when given (the magics pass the shell's ``user_ns``), else the live locals and
    globals of the nearest frame outside torch_nbdebug: the code that called the Python twin.
    Call :meth:`UserNamespace.release` when the tool is done, so the frame is not kept.
    """
    if isinstance(namespace, UserNamespace):
        return namespace
    if namespace is not None:
        return UserNamespace(namespace)
    frame = caller_frame()
    try:
        return UserNamespace(frame=frame) if frame is not None else UserNamespace({})
    finally:
        del frame


def caller_frame() -> Optional[types.FrameType]:
    """The nearest frame outside torch_nbdebug: the code that called a Python twin. Hold it only
    while it is needed (a frame keeps all its locals alive)."""
    frame: Optional[types.FrameType] = sys._getframe(1)
    while frame is not None and _is_ours(frame):
        frame = frame.f_back
    return frame


def _is_ours(frame: types.FrameType) -> bool:
    name = frame.f_globals.get("__name__")
    return isinstance(name, str) and (name == "torch_nbdebug" or name.startswith("torch_nbdebug."))


def user_position(start: Optional[types.FrameType]) -> Optional[tuple[str, int, str]]:
    """``(filename, lineno, function)`` of :func:`user_frame`'s frame (what :func:`line_of` takes), or
    None. For recorders that ask once per allocation: the per-file answer is read from
    :func:`is_user_code`'s cache inline, one dictionary lookup per frame walked instead of a call."""
    cache = _is_user_cache
    frame = start
    while frame is not None:
        code = frame.f_code
        user = cache.get(code.co_filename)
        if user is None:
            user = is_user_code(code)
        if user:
            return code.co_filename, frame.f_lineno, code.co_name
        frame = frame.f_back
    return None
