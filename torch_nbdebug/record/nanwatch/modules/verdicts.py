"""Module-level verdicts: the cheap ``mode="module"`` check (a module's non-finite output or the gradient into
it, judged by :func:`~torch_nbdebug.record.nanwatch.modules.rule.judge_call`), and the module-level report
replay falls back to when a call cannot be replayed."""
from __future__ import annotations

import math
import weakref
from typing import Any, Callable, Optional

import torch

from torch_nbdebug.data.nanwatch import Kind
from torch_nbdebug.data.stats import TensorStats
from torch_nbdebug.record import compat
from torch_nbdebug.record.nanwatch.context import WatchContext
from torch_nbdebug.record.nanwatch.core import ops
from torch_nbdebug.record.nanwatch.core.events import Place, here, kind_of, make_event, stats_of
from torch_nbdebug.record.nanwatch.core.params import bad_parameters
from torch_nbdebug.record.nanwatch.core.rules import judge_gradient, judge_module
from torch_nbdebug.record.nanwatch.modules.rule import LeftAt, judge_call, module_event
from torch_nbdebug.record.nanwatch.modules.tracker import CallWatcher
from torch_nbdebug.record.nanwatch.replay.kept import Kept


class ModuleVerdicts(CallWatcher):
    """Judges module calls and gradients at module level. ``depth`` is the module nesting (1: a top-level
    model); ``note`` (replay) says why a call was reported at module level. Subscribed to the tracker in
    module mode only (the outermost call's first autograd node: :meth:`coming_in`)."""

    def __init__(self, ctx: WatchContext, depth: Callable[[], int],
                 note: Optional[Callable[[str], None]] = None) -> None:
        self.ctx, self._depth, self._note = ctx, depth, note
        self._model_seq = 0  # the outermost call's first autograd node number
        self._left_inside: Optional[weakref.ref[torch.Tensor]] = None  # an output left to its enclosing module
        self.left_at = LeftAt()  # calls left to their enclosing module

    def outermost_started(self) -> None:
        self._model_seq = compat.next_sequence_nr()  # (see coming_in)

    def coming_in(self, inputs: list[torch.Tensor]) -> tuple[bool, ...]:
        """Which of a call's inputs count as data coming in. A top-level call's do; a nested call's unless
        the model's call made them (:func:`~torch_nbdebug.record.nanwatch.core.ops.made_since`): an enclosing
        module's code between its submodules (no op is watched there), and that module is judged when it
        returns."""
        if self._depth() <= 1:
            return tuple(True for _ in inputs)
        seq = self._model_seq
        return tuple(not ops.made_since(x, seq) for x in inputs)

    def output(self, path: str, module: torch.nn.Module, args: Any, t: torch.Tensor) -> None:
        """A module returned a non-finite output (read at its exit)."""
        left = self.module_birth(path, module, args, t, coming_in=self.coming_in)
        self._left_inside = weakref.ref(t) if left else None

    def passed_up(self, path: str, module: torch.nn.Module, args: Any, t: torch.Tensor) -> None:
        """A container returned its child's output unchanged: judged here if the child left it to us."""
        if self._left_inside is not None and self._left_inside() is t:
            if not self.module_birth(path, module, args, t, coming_in=self.coming_in):
                self._left_inside = None

    def module_birth(self, path: str, module: torch.nn.Module, args: Any, t: torch.Tensor,
                     place: Optional[Place] = None, iteration: Optional[int] = None, first: int = 0,
                     coming_in: Optional[Callable[[list[torch.Tensor]], tuple[bool, ...]]] = None) -> bool:
        """``coming_in`` (module mode): which inputs are data coming in (:meth:`coming_in`). True when
        the output is left to the enclosing module (inputs an enclosing module's own code made)."""
        log = self.ctx.log
        inputs = ops.float_inputs(args, {})
        bad = [not math.isfinite(ops.sum_value(x)) and ops.any_nonfinite(x) for x in inputs]
        verdict = judge_call(self.left_at, log, path, first, bad, None if coming_in is None else coming_in(inputs),
                             module)
        if verdict == "left":
            return True  # an enclosing module's own code made them: judged as that module returns
        if verdict == "propagation":
            return False
        out = stats_of([t], 1)[0]
        kind = kind_of([out])
        if self.ctx.options.ignore_inf and kind == "inf":
            return False
        log.add(module_event(self.ctx, place or here(path, None), f"{type(module).__name__} (module output)", verdict,
                             stats_of(inputs), out, kind, module, any(bad),
                             self.ctx.clock.iteration if iteration is None else iteration))
        return False

    def module_fallback(self, entry: Kept, first: int = 0) -> None:
        """A kept forward call reported at module level (replay impossible or not reproducing);
        ``first``: the log's length when the check began."""
        assert entry.module is not None
        t, inputs = entry.value(), entry.live_inputs()
        if t is None:
            self._freed_birth(entry, first)
            return
        self.module_birth(entry.paths[0], entry.module, inputs or (), t, entry.place, entry.iteration, first)

    def _freed_birth(self, entry: Kept, first: int) -> None:
        """A weakly kept (no-grad) output freed before the check: the event has what was read of it
        (its kind; shape and dtype), not its full statistics."""
        log, path = self.ctx.log, entry.paths[0]
        inner = any(e.module and e.module.startswith(path + ".") for e in log.since(first))
        params_bad = not inner and bool(bad_parameters(entry.module))
        # Its inputs were freed with it: after a birth they are taken as carrying it (the modules after a
        # non-finite one in generation are not births of their own).
        verdict = judge_module(True, log.has_events(), params_bad, log.has_events(), inner)
        if verdict == "propagation":
            return
        # min and max say NaN (aminmax propagates it); a mean of +Inf and -Inf is NaN without one
        kind: Kind = "nan" if math.isnan(entry.values[0]) or math.isnan(entry.values[1]) else "inf"
        if self.ctx.options.ignore_inf and kind == "inf":
            return
        shape, dtype, device, numel = entry.meta
        out = TensorStats(tuple(shape), str(dtype).replace("torch.", ""), str(device), numel,
                          note="freed before the check: statistics not kept")
        op = f"{type(entry.module).__name__} (module output)"
        if self._note is not None:
            self._note(f"{path}: its output was freed before the check (no_grad: generation or evaluation) "
                       "and the model's call could not be replayed; reported at module level")
        log.add(module_event(self.ctx, entry.place or here(path, None), op, verdict, (), out, kind, entry.module,
                             False, entry.iteration))

    def gradient_birth(self, path: str, grad: "torch.Tensor | TensorStats | None", iteration: int) -> None:
        """A non-finite gradient into a module output, a birth when nothing came before (module mode; replay
        when the model call could not be replayed)."""
        ctx = self.ctx
        if judge_gradient(ctx.log.has_events()) != "birth":
            return
        out = stats_of([grad], 1)[0] if isinstance(grad, torch.Tensor) else grad
        kind = kind_of([out]) if out is not None else "nan"
        if not (ctx.options.ignore_inf and kind == "inf"):
            place = Place(None, path, None, None, "<module>")
            ctx.log.add(make_event("backward", f"gradient into {path}", place, (), out, kind=kind,
                                   iteration=iteration))

    def forget(self) -> None:
        self.left_at.clear()
