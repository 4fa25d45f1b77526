"""torch_nbdebug: deep PyTorch debugging made visible in the notebook.

In a notebook: ``%load_ext torch_nbdebug``. In Python, each magic has a twin:

- ``with nanwatch() as report:`` — where the first NaN/Inf was born (``%%nanwatch``)
- ``graph(tensor_or_model, ...)`` — the computation-graph explorer (``%graph``)
- ``grads(model)`` / ``with record_gradients(model) as trace:`` — the gradient stepper (``%grads``)
- ``memory_state()`` / ``with memory_timeline() as tl:`` — memory by category (``%cudamem``)
- ``repro(fn, state=(model, opt))`` — run twice from one state; the first op that differs, and why (``%%repro``)
- ``with explain() as ex:`` / ``explain_exception(exc)`` — where and why a PyTorch error happened (``%explain``)
- ``with monitor("loss") as mon:`` — values and per-layer gradients at every optimizer step, live (``%%monitor``)
- ``with profile() as prof:`` — why a training step is slow: a verdict, the line and the module (``%%profile``)
- ``load(path)`` — a report written by ``python -m torch_nbdebug TOOL script.py`` (all ranks) or ``to_json()``
- ``to_tensorboard(result, logdir)`` — write a monitor, gradient trace, memory timeline or nanwatch report for TensorBoard

Names are imported lazily so ``import torch_nbdebug`` stays cheap and pulls in no widget code.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "nanwatch": "torch_nbdebug.api.nanwatch",
    "NanReport": "torch_nbdebug.api.nanwatch",
    "NanEvent": "torch_nbdebug.api.nanwatch",
    "last_report": "torch_nbdebug.api.nanwatch",
    "graph": "torch_nbdebug.api.graph",
    "GraphData": "torch_nbdebug.api.graph",
    "GraphExplorer": "torch_nbdebug.api.graph",
    "record_graph": "torch_nbdebug.api.graph",
    "grads": "torch_nbdebug.api.grads",
    "record_gradients": "torch_nbdebug.api.grads",
    "GradTrace": "torch_nbdebug.api.grads",
    "memory_state": "torch_nbdebug.api.memory",
    "memory_timeline": "torch_nbdebug.api.memory",
    "MemoryState": "torch_nbdebug.api.memory",
    "MemoryTimeline": "torch_nbdebug.api.memory",
    "write_snapshot": "torch_nbdebug.api.memory",
    "repro": "torch_nbdebug.api.repro",
    "ReproReport": "torch_nbdebug.api.repro",
    "NbdebugError": "torch_nbdebug.errors",
    "InputError": "torch_nbdebug.errors",
    "NanBirthError": "torch_nbdebug.errors",
    "explain": "torch_nbdebug.api.explain",
    "explain_exception": "torch_nbdebug.api.explain",
    "Diagnosis": "torch_nbdebug.api.explain",
    "monitor": "torch_nbdebug.api.monitor",
    "Monitor": "torch_nbdebug.api.monitor",
    "MonitorHistory": "torch_nbdebug.api.monitor",
    "MonitorRules": "torch_nbdebug.api.monitor",
    "profile": "torch_nbdebug.api.profile",
    "Profile": "torch_nbdebug.api.profile",
    "to_tensorboard": "torch_nbdebug.api.tensorboard",
    "load": "torch_nbdebug.api.ranks",
    "RunReport": "torch_nbdebug.api.ranks",
}

__all__ = sorted(_EXPORTS) + ["load_ipython_extension", "unload_ipython_extension"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torch_nbdebug' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


def load_ipython_extension(ip: Any) -> None:
    """``%load_ext torch_nbdebug``: register %%nanwatch, %graph, %grads and %cudamem."""
    from torch_nbdebug.magics import load_ipython_extension as load

    load(ip)


def unload_ipython_extension(ip: Any) -> None:
    """``%unload_ext torch_nbdebug``: remove every magic the package registered."""
    from torch_nbdebug.magics import unload_ipython_extension as unload

    unload(ip)
