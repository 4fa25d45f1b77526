"""Base for the package's anywidget views: the ES module is read from a file shipped in the package.

Each view's JavaScript is plain ES (no bundler, no CDN, no framework), so it works offline and the
copy stored with every widget instance in a saved notebook stays small.
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

import anywidget


def esm_path(name: str) -> Path:
    """Path of an ES module in ``torch_nbdebug/render/static``."""
    return Path(str(resources.files("torch_nbdebug.render").joinpath("static", name)))


class View(anywidget.AnyWidget):
    """Common base of torch_nbdebug widgets (subclasses set ``_esm = esm_path("x.js")``)."""
