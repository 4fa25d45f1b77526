"""Module-level checks: per-module statistics at each module exit, gradients into module outputs,
and the cheap ``mode="module"`` check (only module outputs, no dispatch mode).

A mixin of :class:`~torch_nbdebug.record.nanwatch.NanRecorder`; it uses the recorder's state.
"""
from __future__ import annotations

import dataclasses
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any

import torch

from torch_nbdebug.errors import NanBirthError
from torch_nbdebug.record import nanwatch_deferred as deferred
from torch_nbdebug.record import nanwatch_ops as ops
from torch_nbdebug.record.nanwatch_events import Place, here, kind_of, make_event, stats_of
from torch_nbdebug.record.nanwatch_layers import first_float_tensor

if TYPE_CHECKING:  # pragma: no cover
    from torch_nbdebug.record.nanwatch import NanRecorder


class ModuleChecks:
    """Module exit / gradient callbacks of the recorder (methods typed with the recorder as self)."""

    def _module_enter(self: "NanRecorder", path: str, module: torch.nn.Module) -> None:
        if threading.get_ident() != self.thread_id:
            self.other_thread = True  # dispatch modes are per thread: that thread's ops go unchecked
        if self._tracker is not None and len(self._tracker.stack) == 1:
            self._forward_tick()
        self.layers.enter(path)

    def _module_exit(self: "NanRecorder", module: torch.nn.Module, args: Any, output: Any) -> None:
        try:
            self._check_module_exit(module, args, output)
        except NanBirthError:
            raise
        except Exception as exc:  # noqa: BLE001 - see OpWatchMode
            self.internal_error(f"the output of {type(module).__name__}", exc)

    def _check_module_exit(self: "NanRecorder", module: torch.nn.Module, args: Any, output: Any) -> None:
        path = self.module_path()
        if path is None or (self._optim is not None and self._optim.active):
            return
        t = first_float_tensor(output)
        if t is None:
            return
        last = self._last_exit
        if last is not None and last[0]() is t and last[1] is not None:
            # A container returning its last child's output (Sequential, a model's head): same numbers.
            self.layers.take_forward(path, last[1])
            if last[2] is not None:
                last[2].paths.append(path)
            return
        with self.quiet():
            values = self.layers.forward(path, t)
            hook = None
            if self.mode == "module":
                if self.layers.deferred:
                    deferred.queue_module(self, path, module, args, t)
                elif not all(v - v == 0 for v in values or ()):
                    self._module_birth(path, module, args, t)
            if self.backward and t.requires_grad and torch.is_grad_enabled():
                hook = _GradHook(self, path)
                self._grad_handles.append(t.register_hook(hook))
                if len(self._grad_handles) > 4096:  # long loops: forget hooks whose tensor is gone
                    self._grad_handles = [h for h in self._grad_handles if h.hooks_dict_ref() is not None]
            self._last_exit = (weakref.ref(t), values, hook)
            if self._tracker is not None and len(self._tracker.stack) == 1 and self.layers.deferred:
                self.flush()

    def _module_birth(self: "NanRecorder", path: str, module: torch.nn.Module, args: Any, t: torch.Tensor) -> None:
        if any(e.module and e.module.startswith(path + ".") for e in self.events):
            return  # a submodule already reported this one
        inputs = ops.float_inputs(args, {})
        in_bad = [ops.is_bad_value(ops.sum_value(x)) and ops.any_nonfinite(x) for x in inputs]
        # Weights an earlier step (or the code before the watch) made non-finite are inputs too.
        bad_params = [p for p in module.parameters() if ops.checkable(p) and ops.any_nonfinite(p)]
        if (any(in_bad) or bad_params) and self.has_events():
            return
        out = stats_of([t], 1)[0]
        kind = kind_of([out])
        if self.ignore_inf and kind == "inf":
            return
        phase = "input" if any(in_bad) or bad_params else "forward"
        place = here(path, None, sys._getframe(1))
        event = make_event(phase, f"{type(module).__name__} (module output)", place, stats_of(inputs), out,
                           kind=kind, iteration=self.iteration)
        if bad_params and not any(in_bad):
            event = dataclasses.replace(event, detail=self._describe_inputs(bad_params))
        self.add_event(event, [])

    def on_grad(self: "NanRecorder", paths: list[str], grad: torch.Tensor) -> None:
        """A gradient reached a module's output (tensor hook): table stats, and module-mode check."""
        self._saw_backward = True
        if grad is None or not grad.is_floating_point() or grad.numel() == 0:
            return
        path = paths[0]
        with self.quiet():
            values = self.layers.gradient(path, grad)
            for other in paths[1:]:
                if values is not None:
                    self.layers.take_gradient(other, values)
            if self.mode == "module" and self.layers.deferred:
                deferred.queue_grad(self, path, grad)
            elif self.mode == "module" and not all(v - v == 0 for v in values or ()) and not self.has_events():
                out = stats_of([grad], 1)[0]
                kind = kind_of([out])
                if not (self.ignore_inf and kind == "inf"):
                    place = Place(None, path, None, None, "<module>")
                    self.add_event(make_event("backward", f"gradient into {path}", place, (), out, kind=kind,
                                         iteration=self.iteration), [])



class _GradHook:
    """Tensor hook that only reads the gradient (returns None, so the value is unchanged)."""

    __slots__ = ("recorder", "paths")

    def __init__(self, recorder: "NanRecorder", path: str) -> None:
        self.recorder, self.paths = recorder, [path]

    def __call__(self, grad: torch.Tensor) -> None:
        try:
            self.recorder.on_grad(self.paths, grad)
        except NanBirthError:
            raise
        except Exception as exc:  # noqa: BLE001 - see OpWatchMode
            self.recorder.internal_error(f"the gradient into {self.paths[0]}", exc)
