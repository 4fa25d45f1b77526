"""Module-level checks: per-module statistics at each module exit, gradients into module outputs,
and the cheap ``mode="module"`` check (only module outputs, no dispatch mode).
"""
from __future__ import annotations

import dataclasses
import math
import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from torch_nbdebug.data.nanwatch import Kind, NanEvent
from torch_nbdebug.data.stats import TensorStats
from torch_nbdebug.errors import NanBirthError
from torch_nbdebug.record import nanwatch_ops as ops
from torch_nbdebug.record.nanwatch_births import Verdict, judge_gradient, judge_module
from torch_nbdebug.record.nanwatch_context import WatchContext
from torch_nbdebug.record.nanwatch_events import Place, here, kind_of, make_event, stats_of
from torch_nbdebug.record.nanwatch_layers import LayerRecorder, first_float_tensor
from torch_nbdebug.record.nanwatch_params import carriers
from torch_nbdebug.record.tensors import storage_key

if TYPE_CHECKING:  # pragma: no cover
    from torch_nbdebug.record.nanwatch_deferred import DeferredChecks

_MAX_BACKLOG = 4096  # deferred module statistics waiting before they are read early


def bad_parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    """Weights an earlier step (or the code before the watch) made non-finite: inputs too."""
    return [p for p in module.parameters() if ops.checkable(p) and ops.any_nonfinite(p)]


def module_event(ctx: WatchContext, place: Place, op: str, verdict: Verdict, inputs: tuple[TensorStats, ...],
                 output: TensorStats, kind: Kind, module: torch.nn.Module, inputs_bad: bool,
                 iteration: int) -> NanEvent:
    """A module-mode event; a non-finite weight (with finite inputs) is named as the carrier."""
    event = make_event("input" if verdict == "input" else "forward", op, place, inputs, output, kind=kind,
                       iteration=iteration)
    if verdict == "input" and not inputs_bad:
        params = bad_parameters(module)
        if params:
            event = dataclasses.replace(event, **carriers(ctx.namespace, [storage_key(p) for p in params]).fields())
    return event


class ModuleChecks:
    """Module enter/exit and gradient callbacks. ``depth`` is the module nesting (1: a top-level
    model), ``busy`` is True while an optimizer step runs (its modules are not checked)."""

    def __init__(self, ctx: WatchContext, layers: LayerRecorder, deferred: Optional["DeferredChecks"],
                 depth: Callable[[], int], busy: Callable[[], bool]) -> None:
        self.ctx, self.layers, self.deferred = ctx, layers, deferred
        self._depth, self._busy = depth, busy
        self.thread_id = threading.get_ident()
        self.other_thread = False
        self._last_exit: Optional[tuple[Any, Optional[list[float]], Any]] = None  # (weakref, values, hook)
        self._awaiting: Optional[int] = None  # id of the model whose forward waits for its backward's start

    def mine(self) -> bool:
        """Module hooks are global: another thread's modules (its own watch, a worker) are not ours."""
        if threading.get_ident() == self.thread_id:
            return True
        self.other_thread = True
        return False

    def enter(self, path: str, module: torch.nn.Module) -> None:
        if self._depth() == 1:
            self.ctx.clock.forward()
        self.layers.enter(path)

    def exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not self.mine():
            return
        try:
            self._check_exit(module, args, output)
            if self.deferred is not None and self._depth() == 1 and not self._busy():
                self._model_done(module, output)
        except NanBirthError:
            raise
        except Exception as exc:  # noqa: BLE001 - see OpWatchMode
            self.ctx.internal_error(f"the output of {type(module).__name__}", exc)

    def _model_done(self, module: torch.nn.Module, output: Any) -> None:
        """A top-level module finished (deferred path): read what waits on the device while the
        activations it names are alive (exact statistics). When a backward will follow, wait for it
        to start instead: the loss computed after the model is read too, in the same single read."""
        t = first_float_tensor(output)
        backward = self.ctx.options.backward and t is not None and t.requires_grad and torch.is_grad_enabled()
        if backward and self._awaiting != id(module):  # the same model again without a backward: read now
            if self._awaiting is None:
                self._awaiting = id(module)
            return
        self._awaiting = None
        with self.ctx.quiet():
            self.ctx.flush()

    def backward_started(self) -> None:
        """The first backward op or gradient after a forward: read the forward's checks (see ``_model_done``)."""
        if self._awaiting is not None:
            self._awaiting = None
            with self.ctx.quiet():
                self.ctx.flush()

    def forget(self) -> None:
        self._last_exit = None
        self._awaiting = None

    def _check_exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        path = self.ctx.module_path()
        if path is None or self._busy():
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
        ctx = self.ctx
        with ctx.quiet():
            values = self.layers.forward(path, t)
            hook = None
            if ctx.options.mode == "module":
                if self.deferred is not None:
                    self.deferred.queue_module(path, module, args, t)
                elif not all(math.isfinite(v) for v in values or ()):
                    self._module_birth(path, module, args, t)
            if ctx.options.backward and t.requires_grad and torch.is_grad_enabled():
                hook = _GradHook(self, path)
                ctx.keep_handle(t.register_hook(hook))
            self._last_exit = (weakref.ref(t), values, hook)
            self._bound_backlog()

    def _bound_backlog(self) -> None:
        """Deferred statistics are read once per forward (see ``_model_done``); code without modules
        reads them every few thousand instead of keeping them all until the end of the watch."""
        if self.layers.backlog > _MAX_BACKLOG:
            self.ctx.flush()

    def _module_birth(self, path: str, module: torch.nn.Module, args: Any, t: torch.Tensor) -> None:
        log = self.ctx.log
        inner = any(e.module and e.module.startswith(path + ".") for e in log.events)
        inputs = ops.float_inputs(args, {})
        in_bad = any(not math.isfinite(ops.sum_value(x)) and ops.any_nonfinite(x) for x in inputs)
        params_bad = not inner and not in_bad and bool(bad_parameters(module))
        verdict = judge_module(True, in_bad, params_bad, log.has_events(), inner)
        if verdict == "propagation":
            return
        out = stats_of([t], 1)[0]
        kind = kind_of([out])
        if self.ctx.options.ignore_inf and kind == "inf":
            return
        place = here(path, None)
        log.add(module_event(self.ctx, place, f"{type(module).__name__} (module output)", verdict, stats_of(inputs),
                             out, kind, module, in_bad, self.ctx.clock.iteration))

    def on_grad(self, paths: list[str], grad: torch.Tensor) -> None:
        """A gradient reached a module's output (tensor hook): table stats, and module-mode check."""
        ctx = self.ctx
        if not ctx.clock.saw_backward:
            self.backward_started()
        ctx.clock.saw_backward = True
        if grad is None or not grad.is_floating_point() or grad.numel() == 0:
            return
        path = paths[0]
        with ctx.quiet():
            values = self.layers.gradient(path, grad)
            for other in paths[1:]:
                if values is not None:
                    self.layers.take_gradient(other, values)
            self._bound_backlog()
            if ctx.options.mode != "module":
                return
            if self.deferred is not None:
                self.deferred.queue_grad(path, grad)
            elif not all(math.isfinite(v) for v in values or ()) and judge_gradient(ctx.log.has_events()) == "birth":
                out = stats_of([grad], 1)[0]
                kind = kind_of([out])
                if not (ctx.options.ignore_inf and kind == "inf"):
                    place = Place(None, path, None, None, "<module>")
                    ctx.log.add(make_event("backward", f"gradient into {path}", place, (), out, kind=kind,
                                           iteration=ctx.clock.iteration))


class _GradHook:
    """Tensor hook that only reads the gradient (returns None, so the value is unchanged)."""

    __slots__ = ("checks", "paths")

    def __init__(self, checks: ModuleChecks, path: str) -> None:
        self.checks, self.paths = checks, [path]

    def __call__(self, grad: torch.Tensor) -> None:
        try:
            self.checks.on_grad(self.paths, grad)
        except NanBirthError:
            raise
        except Exception as exc:  # noqa: BLE001 - see OpWatchMode
            self.checks.ctx.internal_error(f"the gradient into {self.paths[0]}", exc)
