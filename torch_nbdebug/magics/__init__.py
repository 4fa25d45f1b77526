"""IPython glue: the only layer that imports IPython. Loaded lazily from ``load_ipython_extension``."""
from __future__ import annotations

import importlib
from typing import Any

from torch_nbdebug.record.interrupts import deferred_interrupts

# One module per feature; each defines ``MAGICS``, an IPython ``Magics`` subclass, and may define
# ``load(ip)``/``unload(ip)`` for what it installs beyond magics (explain's exception hook).
_FEATURES: tuple[str, ...] = ("nanwatch", "graph", "grads", "memory", "explain", "repro")
_FEATURES += ("monitor", "profile")


def _magic_classes() -> list[Any]:
    return [importlib.import_module(f"torch_nbdebug.magics.{name}").MAGICS for name in _FEATURES]


def _feature_hooks(name: str) -> list[Any]:
    modules = [importlib.import_module(f"torch_nbdebug.magics.{feature}") for feature in _FEATURES]
    return [getattr(module, name) for module in modules if callable(getattr(module, name, None))]


def load_ipython_extension(ip: Any) -> None:
    # Import everything first (a Stop there changes nothing and `%load_ext` can simply be run
    # again), then register all or nothing: a Stop while registering is raised once it is done.
    classes, loads = _magic_classes(), _feature_hooks("load")
    with deferred_interrupts():
        for cls in classes:
            ip.register_magics(cls)
        for load in loads:
            load(ip)


def unload_ipython_extension(ip: Any) -> None:
    classes, unloads = _magic_classes(), _feature_hooks("unload")
    with deferred_interrupts():  # like loading: removed all or nothing
        for unload in unloads:
            unload(ip)
        registry = ip.magics_manager.magics
        for cls in classes:
            for kind, names in cls.magics.items():
                for name in names:
                    registry[kind].pop(name, None)
        for cls in classes:
            ip.magics_manager.registry.pop(cls.__name__, None)
