"""Base for the package's anywidget views: the ES module is read from a file shipped in the package.

Each view's JavaScript is plain ES (no bundler, no CDN, no framework), so it works offline. A saved
notebook stores a copy of the module and stylesheet with every widget instance, so they are sent
compacted (:func:`compact_js`, :func:`compact_css`: no comments, no indentation): a third smaller.
"""
from __future__ import annotations

import functools
import re
from importlib import resources
from pathlib import Path
from typing import Any

import anywidget


def esm_path(name: str) -> Path:
    """Path of an ES module in ``torch_nbdebug/render/static``."""
    return Path(str(resources.files("torch_nbdebug.render").joinpath("static", name)))


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
    text = path.read_text(encoding="utf-8")
    return compact_css(text) if path.suffix == ".css" else compact_js(text)


class View(anywidget.AnyWidget):
    """Common base of torch_nbdebug widgets (subclasses set ``_esm = esm_path("x.js")``)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        for key in ("_esm", "_css"):
            value = cls.__dict__.get(key)
            if isinstance(value, Path):
                setattr(cls, key, _compacted(value))
        super().__init_subclass__(**kwargs)
