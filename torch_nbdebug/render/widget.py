"""Base for the package's anywidget views: the ES module is read from a file shipped in the package.

Each view's JavaScript is plain ES (no bundler, no CDN, no framework), so it works offline. A saved
notebook stores a copy of the module and stylesheet with every widget instance, so they are sent
compacted (:func:`compact_js`, :func:`compact_css`: no comments, no indentation): a third smaller.

Shared code: a widget's module must stand alone (the browser loads it from a string, with no sibling
files to fetch), so a view imports the shared helper as a plain ES module would,
``import { h, s, num } from "./dom.js";``, and :func:`module_source` puts the sibling's definitions in
place of that line when the view is loaded: the top-level declarations the names need (they and what
they use, in the sibling's order, ``export`` dropped), once per module however often it is imported, so
a view carries only the helpers it uses into every saved notebook. The names imported must be ones the
sibling exports, without ``as`` (the definitions keep their own names); a shared file holds only
top-level declarations, each starting a line (their bodies indented). The source files stay valid ES modules that import each other (``node`` runs
them as they are).
"""
from __future__ import annotations

import functools
import re
from importlib import resources
from pathlib import Path
from typing import Any

import anywidget

# `import { a, b } from "./file.js";` on a line of its own (the only import form the views use)
_IMPORT = re.compile(r'^import\s*\{([^}]*)\}\s*from\s*"\./([\w-]+\.js)";?[ \t]*$', re.M)
# a top-level declaration with the comment lines above it: `function f`, `export const x`, ...
_DECLARATION = re.compile(
    r"^((?:[ \t]*//.*\n)*)(export\s+)?((?:async\s+)?(?:function\*?|const|let|class)\s+([A-Za-z_$][\w$]*))", re.M)


def _declarations(text: str) -> dict[str, str]:
    """A shared file's top-level declarations by name, each with its comment and running to the next
    (``export`` dropped)."""
    starts = list(_DECLARATION.finditer(text))
    ends = [m.start() for m in starts[1:]] + [len(text)]
    return {m.group(4): m.group(1) + text[m.start(3):end] for m, end in zip(starts, ends)}


def _needed(wanted: list[str], found: dict[str, str]) -> list[str]:
    """The names of ``wanted`` and of every declaration they use, in the file's order."""
    keep, todo = set(), list(wanted)
    while todo:
        name = todo.pop()
        if name not in keep:
            keep.add(name)
            code = compact_js(found[name])  # what the comments say is not a use
            todo += [other for other in found if other not in keep
                     and re.search(rf"(?<![\w$.]){re.escape(other)}(?![\w$])", code)]
    return [name for name in found if name in keep]


def esm_path(name: str) -> Path:
    """Path of an ES module in ``torch_nbdebug/render/static``."""
    return Path(str(resources.files("torch_nbdebug.render").joinpath("static", name)))


def module_source(path: Path, _seen: frozenset[str] = frozenset()) -> str:
    """The module at ``path`` standing alone: each ``import { ... } from "./x.js";`` of a sibling in
    ``static/`` replaced by the declarations of x.js those names need (x.js's own imports resolved the
    same way), each declaration once. Raises ``ValueError`` for a name the sibling does not export
    and for a sibling that imports the module back."""
    included: set[tuple[str, str]] = set()

    def include(match: re.Match[str]) -> str:
        names = [n.strip() for n in match.group(1).split(",") if n.strip()]
        sibling = path.with_name(match.group(2))
        if sibling.name == path.name or sibling.name in _seen:
            raise ValueError(f"{path.name}: import circle through {sibling.name}")
        text = module_source(sibling, _seen | {path.name})
        exported = {m.group(4) for m in _DECLARATION.finditer(text) if m.group(2)}
        missing = sorted(set(names) - exported)
        if missing:
            raise ValueError(f"{path.name} imports {', '.join(missing)} that {sibling.name} does not export")
        found = _declarations(text)
        new = [n for n in _needed(names, found) if (sibling.name, n) not in included]
        included.update((sibling.name, n) for n in new)
        return "".join(found[n] for n in new)

    return _IMPORT.sub(include, path.read_text(encoding="utf-8"))


def compact_js(source: str) -> str:
    """The module without indentation, blank lines and whole-line ``//`` comments (line breaks kept,
    so automatic semicolons and line-ending comments mean what they meant)."""
    lines = (line.strip() for line in source.splitlines())
    return "\n".join(line for line in lines if line and not line.startswith("//"))


def compact_css(source: str) -> str:
    """The stylesheet without comments and with each run of white space as one space."""
    return re.sub(r"\s+", " ", re.sub(r"/\*.*?\*/", "", source, flags=re.S)).strip()


@functools.lru_cache(maxsize=None)
def _compacted(path: Path) -> str:
    if path.suffix == ".css":
        return compact_css(path.read_text(encoding="utf-8"))
    return compact_js(module_source(path))


class View(anywidget.AnyWidget):
    """Common base of torch_nbdebug widgets (subclasses set ``_esm = esm_path("x.js")``: the module
    standing alone, its imports of ``static/`` siblings resolved by :func:`module_source`, compacted)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        for key in ("_esm", "_css"):
            value = cls.__dict__.get(key)
            if isinstance(value, Path):
                setattr(cls, key, _compacted(value))
        super().__init_subclass__(**kwargs)
