"""Record which module created each autograd node during a forward pass (``%%graph``).

Two cheap observers, both removed on exit:

- a ``TorchFunctionMode`` that, after every torch function returns, walks back from the outputs'
  ``grad_fn`` over the nodes made since recording began and not yet seen, and files each under the
  innermost running module (from :class:`ModuleTracker`). Walking back, not only stamping the output
  node, catches composite functions that create several nodes (``cross_entropy`` = log_softmax +
  nll_loss);
- the tracker's forward post-hook does the same walk on each module's output, for nodes a torch
  function mode cannot see (a custom ``autograd.Function`` called directly).

Nodes are recorded by sequence number (``_sequence_nr()``, unique per thread and increasing), as
``{seq: (module path, node name)}``: strings and ints only. The autograd graph is not modified and
no tensor is kept (top-level module outputs are held by weak reference).
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Mapping, Optional

import torch
from torch import nn

from torch_nbdebug.record import compat
from torch_nbdebug.record.graph import NO_SEQUENCE, children_of, module_types, node_name
from torch_nbdebug.record.lifecycle import CallFunctionMode, HookScope
from torch_nbdebug.record.modules import ModuleTracker, module_roots

# The last recording's module map, so ``%graph loss`` in a later cell still knows the modules.
_LAST: dict[str, Any] = {"modules": {}, "types": {}}
_LAST_LOCK = threading.Lock()


def last_recording() -> tuple[dict[int, tuple[str, str]], dict[str, str]]:
    """Module map and module classes of the most recent recorded forward (empty if none)."""
    with _LAST_LOCK:
        return dict(_LAST["modules"]), dict(_LAST["types"])


def next_sequence_nr() -> int:
    """The sequence number the next autograd node made on this thread will get."""
    return compat.next_sequence_nr()


class GraphRecorder:
    """Context manager recording the module of every autograd node created inside it."""

    def __init__(self, namespace: Optional[Mapping[str, Any]] = None) -> None:
        self.namespace = namespace
        self.modules: dict[int, tuple[str, str]] = {}
        self.types: dict[str, str] = {}
        self.top_outputs: list[weakref.ref[torch.Tensor]] = []  # top-level module outputs, never kept alive
        self.tracker = ModuleTracker(namespace, on_enter=self._enter, on_exit=self._exit)
        self._mode = CallFunctionMode(self._stamp)
        self._scope = HookScope()
        self._start = NO_SEQUENCE
        self._thread = threading.get_ident()

    def __enter__(self) -> "GraphRecorder":
        self._start = next_sequence_nr()
        self.types = module_types(module_roots(self.namespace))
        self._scope.open(self._install)
        return self

    def _install(self, scope: HookScope) -> None:
        scope.enter(self.tracker)
        scope.enter(self._mode)

    def __exit__(self, *exc: Any) -> None:
        try:
            self._scope.close(*exc)
        finally:
            self.namespace = None  # a function's locals snapshot must not outlive the recording
            if self.modules:  # a recording that made no node keeps the previous one useful
                with _LAST_LOCK:
                    _LAST["modules"] = dict(self.modules)
                    _LAST["types"] = dict(self.types)

    def _stamp(self, func: Any, args: Any, kwargs: dict) -> Any:
        """Every torch function: run it, then claim the autograd nodes it made for the running module."""
        __tracebackhide__ = True  # noqa: F841 - IPython hides this frame in the user's tracebacks
        out = func(*args, **kwargs)
        self.claim(out, self.tracker.current)
        return out

    def outputs(self) -> list[torch.Tensor]:
        """The still-alive outputs of the top-level modules called while recording, with a grad_fn."""
        alive = (ref() for ref in self.top_outputs)
        return [t for t in alive if t is not None and t.grad_fn is not None]

    def _enter(self, path: str, module: nn.Module) -> None:
        self.types.setdefault(path, type(module).__name__)

    def _exit(self, path: str, module: nn.Module, output: Any) -> None:
        self.claim(output, path)
        if not self.tracker.stack:
            known = {id(r()) for r in self.top_outputs}
            self.top_outputs.extend(weakref.ref(t) for t in _tensors(output) if id(t) not in known)

    def claim(self, out: Any, module: Optional[str]) -> None:
        """File every new, unclaimed node behind ``out`` under ``module``."""
        if threading.get_ident() != self._thread:
            return  # sequence numbers are per thread; other threads' nodes are not ours
        stack = _grad_fns(out)
        seen = self.modules
        start = self._start
        while stack:
            node = stack.pop()
            seq = compat.node_sequence_nr(node)
            if seq < start or seq == NO_SEQUENCE or seq in seen:
                continue
            seen[seq] = (module or "", node_name(node))
            stack.extend(children_of(node))


def _grad_fns(out: Any) -> list[Any]:
    """The ``grad_fn`` of each tensor in ``out`` (a tensor, or a tuple/list/dict of them)."""
    if isinstance(out, torch.Tensor):
        return [out.grad_fn] if out.grad_fn is not None else []
    found: list[Any] = []
    if isinstance(out, (tuple, list)):
        for item in out:
            found.extend(_grad_fns(item) if isinstance(item, (torch.Tensor, tuple, list, dict)) else ())
    elif isinstance(out, dict):
        for item in out.values():
            found.extend(_grad_fns(item) if isinstance(item, (torch.Tensor, tuple, list, dict)) else ())
    return found


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors with a grad_fn in a module output (a tensor, or a tuple/list/dict of them)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.grad_fn is not None else []
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    found: list[torch.Tensor] = []
    for item in items:
        found.extend(_tensors(item))
    return found
