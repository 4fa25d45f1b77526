"""Base for the package's anywidget views: the ES module is read from a file shipped in the package.

Each view's JavaScript is plain ES (no bundler, no CDN, no framework), so it works offline. A saved
notebook stores a copy of the module and stylesheet with every widget instance, so they are sent
compacted (:func:`compact_js`, :func:`compact_css`: no comments, no indentation) and then deflated
together into a small loader module (:func:`pack`): the browser inflates them with its own
``DecompressionStream``, adds the stylesheet to the page and imports the module as anywidget itself
does (a ``blob:`` URL). A widget's saved state carries ~8 KB of code instead of ~20 KB.

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

import base64
import functools
import json
import re
import zlib
from importlib import resources
from pathlib import Path
from typing import Any

import anywidget
import ipywidgets
import traitlets

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


# The ES module anywidget loads: inflates [module, stylesheet], puts the stylesheet in the page (under the
# id anywidget would give it) and returns the module's widget, as anywidget does with a module it imports.
_LOADER = ('const Z="{z}";export default async()=>{{'
           'const b=Uint8Array.from(atob(Z),(c)=>c.charCodeAt(0));'
           'const[js,css]=JSON.parse(await new Response(new Blob([b]).stream()'
           '.pipeThrough(new DecompressionStream("deflate"))).text());'
           'if(css){{let s=document.getElementById("{id}");if(!s){{s=document.createElement("style");'
           's.id="{id}";document.head.appendChild(s);}}if(s.textContent!==css)s.textContent=css;}}'
           'const u=URL.createObjectURL(new Blob([js],{{type:"text/javascript"}}));'
           'try{{const m=await import(u);return typeof m.default==="function"?await m.default():m.default;}}'
           'finally{{URL.revokeObjectURL(u);}}}};')
_PACKED = re.compile(r'^const Z="([A-Za-z0-9+/=]*)";')


def pack(js: str, css: str, name: str) -> str:
    """The module ``js`` and stylesheet ``css`` as one small loader module (see the module's docstring);
    ``name`` (the widget class's full name) identifies the stylesheet in the page."""
    payload = zlib.compress(json.dumps([js, css], separators=(",", ":")).encode("utf-8"), 9)
    return _LOADER.format(z=base64.b64encode(payload).decode("ascii"), id=re.sub(r"[^\w.-]", "", name))


def unpack(esm: str) -> tuple[str, str]:
    """The module and stylesheet a :func:`pack` loader carries."""
    found = _PACKED.match(esm)
    if found is None:
        raise ValueError("not a packed torch_nbdebug module")
    js, css = json.loads(zlib.decompress(base64.b64decode(found.group(1))).decode("utf-8"))
    return js, css


class View(anywidget.AnyWidget):
    """Common base of torch_nbdebug widgets (subclasses set ``_esm = esm_path("x.js")`` and optionally
    ``_css``, a path or the text of a stylesheet): the module stands alone, its imports of ``static/``
    siblings resolved by :func:`module_source`, compacted, and sent packed with the stylesheet in ``_esm``."""

    # No Layout model of its own: ipywidgets gives every widget one, ~1.2 KB of nulls saved with each
    # output and one more comm to open. Front ends skip a null layout (ipywidgets 8's DOMWidgetView).
    layout = traitlets.Instance(ipywidgets.Layout, allow_none=True, default_value=None).tag(
        sync=True, **ipywidgets.widget_serialization)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        esm, css = cls.__dict__.get("_esm"), cls.__dict__.get("_css")
        if isinstance(esm, Path):
            sheet = _compacted(css) if isinstance(css, Path) else compact_css(css) if isinstance(css, str) else ""
            cls._esm = pack(_compacted(esm), sheet, f"{cls.__module__}.{cls.__qualname__}")
            if "_css" in cls.__dict__:
                del cls._css  # in the packed module: no second copy in the widget's state
        super().__init_subclass__(**kwargs)
