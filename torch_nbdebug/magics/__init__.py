"""IPython glue: the only layer that imports IPython. Loaded lazily from ``load_ipython_extension``."""
from __future__ import annotations

import importlib
from typing import Any

# One module per feature; each defines ``MAGICS``, an IPython ``Magics`` subclass.
_FEATURES = ("nanwatch", "graph", "grads", "memory")


def _magic_classes() -> list[Any]:
    return [importlib.import_module(f"torch_nbdebug.magics.{name}").MAGICS for name in _FEATURES]


def load_ipython_extension(ip: Any) -> None:
    for cls in _magic_classes():
        ip.register_magics(cls)


def unload_ipython_extension(ip: Any) -> None:
    registry = ip.magics_manager.magics
    for cls in _magic_classes():
        for kind, names in cls.magics.items():
            for name in names:
                registry[kind].pop(name, None)
    for cls in _magic_classes():
        ip.magics_manager.registry.pop(cls.__name__, None)
