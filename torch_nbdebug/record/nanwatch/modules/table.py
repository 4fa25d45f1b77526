"""The module layer every watch runs: at each module exit the output's statistics go to the per-layer table
(read at once on a CPU, queued on the device on the deferred path), and a hook on the output reads the
gradient into it. The output then goes where the watch's strategy wants it: module mode's verdicts
(:mod:`modules.verdicts`), or replay's kept outputs (:mod:`replay.outputs`), checked when the model returns.
"""
from __future__ import annotations

import contextlib
import math
import sys
import threading
from typing import Any, Callable, Optional, Protocol

import torch

from torch_nbdebug.errors import NanBirthError
from torch_nbdebug.record import compat
from torch_nbdebug.record.nanwatch.context import ModuleQueue, WatchContext
from torch_nbdebug.record.nanwatch.core import ops
from torch_nbdebug.record.nanwatch.core.layers import LayerRecorder, Later, first_float_tensor, nonfinite_reading
from torch_nbdebug.record.nanwatch.core.live import LiveRef
from torch_nbdebug.record.nanwatch.modules.tracker import CallWatcher, WatchThread
from torch_nbdebug.record.nanwatch.modules.verdicts import ModuleVerdicts
from torch_nbdebug.record.nanwatch.replay import outputs as _outputs
from torch_nbdebug.record.nanwatch.replay.kept import Kept
from torch_nbdebug.record.nanwatch.replay.outputs import KeptOutputs, declares_inplace

_MAX_BACKLOG = 4096  # deferred module statistics waiting before they are read early
_NOTHING = contextlib.nullcontext()
_get_ident = threading.get_ident
_dispatch_stack_len = compat.dispatch_stack_len
_isfinite = math.isfinite


class _Stepping(Protocol):
    """What the module layer reads of the optimizer watch: ``active`` > 0 while a step runs."""

    active: int


class ModuleTable(CallWatcher):
    """Module exit and gradient hooks feeding the per-layer table. ``depth`` is the module nesting (1: a
    top-level model), ``busy`` is True while an optimizer step runs (its modules are not checked).
    ``verdicts`` judges outputs in module mode; ``keeper`` (replay) keeps them for the check at the model's
    return. Without replay each output is read as its module exits: on a CPU that is as cheap (the same
    statistics ops, and reading a CPU scalar is no synchronisation), and CUDA has its deferred path."""

    def __init__(self, ctx: WatchContext, layers: LayerRecorder, thread: WatchThread, verdicts: ModuleVerdicts,
                 deferred: Optional[ModuleQueue], depth: Callable[[], int], busy: Callable[[], bool]) -> None:
        self.ctx, self.layers, self.thread, self.verdicts = ctx, layers, thread, verdicts
        self._depth, self._busy = depth, busy
        self._deferred = deferred is not None
        # (the options are frozen: read once here, not at every module exit)
        self._module_mode, self._backward = ctx.options.mode == "module", ctx.options.backward
        self._queue = deferred if self._module_mode else None  # deferred module mode: its checks are queued
        self.keeper: Optional[KeptOutputs] = None
        # (output, its values, its gradient hook) of the last exit: a container returning it unchanged has its numbers
        self._last_exit: Optional[tuple[LiveRef, Optional[list[float]], Optional[_GradHook]]] = None
        self._awaiting: Optional[int] = None  # id of the model whose forward waits for its backward's start
        # replay: told of each non-finite gradient into a module output (replay.backward marks the model call)
        self.bad_gradient: Optional[Callable[[str, torch.Tensor], None]] = None
        self.stack: list[str] = []  # the module tracker's path stack (the recorder hands it over)
        # the optimizer watch (the recorder hands it over): its ``active`` is ``busy()``, read without two frames
        self.optim: Optional[_Stepping] = None

    # -- module calls ---------------------------------------------------------------------------
    def call_entered(self, path: str, module: torch.nn.Module) -> None:
        if len(self.stack) == 1:
            self.ctx.clock.forward()
        self.layers.enter(path)
        keeper = self.keeper
        if keeper is not None and keeper.kept.entries and declares_inplace(module):
            keeper.before(module)

    def exit_kw(self, module: torch.nn.Module, args: Any, *rest: Any) -> None:
        """The exit hook with the call's keyword arguments (replay needs them): ``(kwargs, output)``.
        Installed with ``always_call``: torch also calls it while a forward's exception propagates, then
        as ``(module, args, None)``."""
        keeper = self.keeper
        if len(rest) != 2:
            if rest and rest[0] is None and sys.exc_info()[0] is not None:
                kwargs = compat.failed_call_kwargs(module)
                if kwargs is not None:
                    self._raised(module, args, kwargs)
            return
        kwargs, output = rest
        if keeper is not None:
            if type(output) is torch.Tensor and self._at_once(module, output, keeper):
                return
            keeper.kwargs = kwargs
        try:
            self.exit(module, args, output)
        finally:
            if keeper is not None:
                keeper.kwargs = {}

    def _at_once(self, module: torch.nn.Module, t: torch.Tensor, keeper: Optional[KeptOutputs]) -> bool:
        """The common exit in one frame: a call of the watching thread returned a finite float32/64 CPU tensor,
        not its last child's (a container's), and no dispatch mode is on. Its reading is taken now: replay
        (``keeper``) keeps it for the table when the model returns, a nested call only (:meth:`KeptOutputs._keep`'s
        finite CPU case); module mode (immediate) gives the table its row. The gradient into it is hooked. All as
        the general path (:meth:`exit`) does it. False: not that case, or the output is non-finite; the general
        path then runs (the reading is pure, nothing was kept)."""
        thread, stack = self.thread, self.stack
        if thread.replaying or _get_ident() != thread.thread_id or not stack or not t.is_cpu or t.dtype in ops.HALF \
                or not t.is_floating_point() or t.layout != torch.strided or _dispatch_stack_len():
            return False
        optim = self.optim
        if optim is not None and optim.active > 0:  # (busy())
            return False
        if keeper is not None and (len(stack) < 2 or not _outputs.READ_AT_EXIT):
            return False
        last = self._last_exit
        if last is not None and last[0].alive() is t:  # a container returning its child's output
            return False
        try:
            numel = t.numel()
            if not numel:
                return False
            x = t.detach()
            lo, hi = torch.aminmax(x)
            values = [lo.item(), hi.item(), x.sum().item() / numel]
            if not (_isfinite(values[0]) and _isfinite(values[1]) and _isfinite(values[2])):
                return False
            path, ref = stack[-1], LiveRef(t)
            grad = t.requires_grad
            if keeper is not None:
                keeper.kept.entries.append(Kept(t if grad else None, [path], self.ctx.clock.iteration, module,
                                                values=values, live=ref))
            else:
                self.layers.take_finite_forward(path, values)
            hook = None
            if grad and self._backward and torch.is_grad_enabled():
                hook = _GradHook(self, path)
                self.ctx.keep_handle(t.register_hook(hook))
            self._last_exit = (ref, None if keeper is not None else values, hook)
            if keeper is not None and keeper.kept.full():
                with self.ctx.quiet():
                    self.ctx.flush()
        except NanBirthError:
            raise
        except Exception as exc:  # noqa: BLE001 - see OpWatchMode
            self.ctx.internal_error(f"the output of {type(module).__name__}", exc)
        return True

    def _raised(self, module: torch.nn.Module, args: Any, kwargs: dict) -> None:
        if self.thread.replaying or self.keeper is None or not self.thread.mine() or self._depth() != 1 \
                or self._busy():
            return
        self.keeper.raised(module, args, kwargs)

    def exit_now(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """The exit hook without replay: module mode, and op mode with ``replay=False``."""
        if type(output) is torch.Tensor and not self._deferred and self._at_once(module, output, None):
            return
        self.exit(module, args, output)

    def exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.thread.replaying or not self.thread.mine():
            return
        try:
            self._check_exit(module, args, output)
            if self._depth() == 1 and not self._busy():
                if self.keeper is not None:  # replay now: outside any backward, the weights unchanged
                    with self.ctx.quiet():
                        self.ctx.flush()
                elif self._deferred:
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
        backward = self._backward and t is not None and t.requires_grad and torch.is_grad_enabled()
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
        self.verdicts.forget()
        if self.keeper is not None:
            self.keeper.forget()

    def _check_exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        path = self.ctx.module_path()
        if path is None or self._busy():
            return
        keeper = self.keeper
        t: Optional[torch.Tensor] = first_float_tensor(output)
        leaves = ops.float_leaves(output) if keeper is not None and not isinstance(output, torch.Tensor) else []
        if t is None and leaves:
            t = leaves[0]  # a dataclass (or deeper) output
        if t is None:
            return
        last = self._last_exit
        if last is not None and last[0].get() is not t:
            last = None  # another tensor, or the same one written in place (ReLU(inplace=True)): new numbers
        if keeper is not None:  # replay: kept, read when the model returns
            if keeper.keep_exit(path, module, args, t, last is not None, [x for x in leaves if x is not t]):
                if last is not None and last[2] is not None:
                    last[2].paths.append(path)
                return
            self._last_exit = (LiveRef(t), None, self._grad_hook(t, path))
            if keeper.kept.full():
                with self.ctx.quiet():
                    self.ctx.flush()
            return
        if last is not None and last[1] is not None:
            # A container returning its last child's output (Sequential, a model's head): same numbers.
            self.layers.take_forward(path, last[1])
            if last[2] is not None:
                last[2].paths.append(path)
            if self._module_mode:
                self.verdicts.passed_up(path, module, args, t)
            return
        if self._module_mode:  # no dispatch mode runs: our statistics ops need no quieting
            self._record_exit(path, module, args, t)
        else:
            with self.ctx.quiet():
                self._record_exit(path, module, args, t)

    def _record_exit(self, path: str, module: torch.nn.Module, args: Any, t: torch.Tensor) -> None:
        """Without replay: the output's statistics now (CPU) or queued on the device (deferred), the
        module-mode check, and the hook that reads the gradient into the output."""
        queue = self._queue
        if queue is not None:  # judged from the table's reading of the output, when the flush reads it
            later = Later()
            values = self.layers.forward(path, t, later)
            queue.queue_module(path, module, args, t, later, self.verdicts.coming_in)
        else:
            values = self.layers.forward(path, t)
            if self._module_mode and nonfinite_reading(values):
                self.verdicts.output(path, module, args, t)
        self._last_exit = (LiveRef(t), values, self._grad_hook(t, path))
        if self.layers.deferred:
            self._bound_backlog()

    def _grad_hook(self, t: torch.Tensor, path: str) -> Optional["_GradHook"]:
        """The hook that reads the gradient into ``t`` (when a backward can reach it)."""
        if not (self._backward and t.requires_grad and torch.is_grad_enabled()):
            return None
        hook = _GradHook(self, path)
        self.ctx.keep_handle(t.register_hook(hook))
        return hook

    def _bound_backlog(self) -> None:
        """Deferred statistics are read once per forward (see ``_model_done``); code without modules
        reads them every few thousand instead of keeping them all until the end of the watch."""
        if self.layers.backlog > _MAX_BACKLOG:
            self.ctx.flush()

    # -- gradients ------------------------------------------------------------------------------
    def on_grad(self, paths: list[str], grad: torch.Tensor) -> None:
        """A gradient reached a module's output (tensor hook): table stats, and module-mode check."""
        ctx = self.ctx
        if not ctx.clock.saw_backward:
            self.backward_started()
        ctx.clock.saw_backward = True
        if grad is None or not grad.is_floating_point() or grad.numel() == 0:
            return
        path = paths[0]
        # No dispatch mode on at all (the backward of replay=True, module mode): nothing to keep quiet.
        with ctx.quiet() if compat.dispatch_stack_len() else _NOTHING:
            queue = self._queue
            later = Later() if queue is not None else None
            values = self.layers.gradient(path, grad, later)
            for other in paths[1:]:
                if values is not None:
                    self.layers.take_gradient(other, values)
            if self.layers.deferred:
                self._bound_backlog()
            if not self._module_mode:
                if self.bad_gradient is not None and nonfinite_reading(values):
                    self.bad_gradient(path, grad)
                return
            if queue is not None and later is not None:
                queue.queue_grad(path, grad, later)
            elif nonfinite_reading(values):
                self.verdicts.gradient_birth(path, grad, ctx.clock.iteration)


class _GradHook:
    """Tensor hook that only reads the gradient (returns None, so the value is unchanged)."""

    __slots__ = ("table", "paths")

    def __init__(self, table: ModuleTable, path: str) -> None:
        self.table, self.paths = table, [path]

    def __call__(self, grad: torch.Tensor) -> None:
        try:
            self.table.on_grad(self.paths, grad)
        except NanBirthError:
            raise
        except Exception as exc:  # noqa: BLE001 - see OpWatchMode
            self.table.ctx.internal_error(f"the gradient into {self.paths[0]}", exc)
