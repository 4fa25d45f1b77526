"""Replay's module layer: each module call's outputs kept as it returns (:mod:`replay.kept`), all checked
together when the model returns (:class:`~replay.inside.KeptCheck`: the per-layer table's rows, and a
non-finite output replayed under the per-op watch); the model calls kept for the replay of their backward
births (:class:`~replay.forward.ModelCalls`)."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch

from torch_nbdebug.record import compat
from torch_nbdebug.record.nanwatch.context import ModuleReports, WatchContext
from torch_nbdebug.record.nanwatch.core import ops
from torch_nbdebug.record.nanwatch.core.events import here
from torch_nbdebug.record.nanwatch.core.layers import LayerRecorder, nonfinite_reading, stat_values
from torch_nbdebug.record.nanwatch.modules.tracker import CallWatcher
from torch_nbdebug.record.nanwatch.replay.forward import ByClass, ModelCalls, Replayer, Start, call_start, capture
from torch_nbdebug.record.nanwatch.replay.inside import KeptCheck
from torch_nbdebug.record.nanwatch.replay.kept import CallSite, Kept, KeptReadings

HALF_UNWATCHED = ("float16/bfloat16 module calls ran without the per-op watch (replay): an Inf born inside a "
                  "module and absorbed before its output (its output finite, but wrong) is looked for only where "
                  "the module's inputs reach the square root of the dtype's largest number (256 in float16), "
                  "where squares overflow; run with --no-replay (replay=False) to watch every op")

_NOTHING = contextlib.nullcontext()
# A CPU output is read as its module returns (see ``KeptOutputs._keep``); an output on a device waits on it
# and is read with the others when the model returns. Tests switch this off to run the device's path on a CPU.
READ_AT_EXIT = True


class KeptOutputs(CallWatcher):
    """The outputs of the running model's calls, kept until the model returns. ``depth`` is the module
    nesting (1: a top-level model); ``verdicts`` gives the module-level report when no replay names the op."""

    def __init__(self, ctx: WatchContext, layers: LayerRecorder, replayer: Replayer, verdicts: ModuleReports,
                 model_calls: ModelCalls, depth: Callable[[], int]) -> None:
        self.ctx, self.layers, self.replayer, self.verdicts = ctx, layers, replayer, verdicts
        self.model_calls = model_calls  # the outermost calls, to name backward births' forward ops
        self._depth = depth
        self.kept = KeptReadings()
        self.kwargs: dict = {}  # the exiting call's keyword arguments (the exit hook's, while it runs)
        self._starts: list[Start] = []  # RNG state and argument versions of each running call, by depth
        self._outer_call: Optional[Kept] = None  # the outermost call, until its exit's check
        self.saw_half = False  # a float16/bfloat16 module output was kept (see HALF_UNWATCHED)
        self.stack: list[str] = []  # the module tracker's path stack (the recorder hands it over)

    # -- the tracker's calls ------------------------------------------------------------------
    def call_started(self, args: Any) -> None:
        """The forward pre-hook's view of a call (before it enters the stack)."""
        starts = self._starts
        del starts[len(self.stack):]
        starts.append(call_start(args))

    def outermost_returned(self, module: torch.nn.Module, output: Any, path: Optional[str]) -> None:
        self.forward_over()

    def forward_over(self) -> None:
        """The outermost module call ended (this hook runs also when it raised): what is still kept was
        not checked because the forward raised; drop it (an OOM-retry loop must not keep activations)."""
        self._starts.clear()
        self._outer_call = None
        self.kept.clear()

    def before(self, module: torch.nn.Module) -> None:
        """A module call starts: if it may overwrite a kept output, read what was kept first."""
        if self.kept.entries and declares_inplace(module):
            with self.ctx.quiet():
                self.ctx.flush()

    # -- keeping ------------------------------------------------------------------------------
    def keep_exit(self, path: str, module: torch.nn.Module, args: Any, t: torch.Tensor, same: bool,
                  others: list[torch.Tensor]) -> bool:
        """Keep a call's output ``t`` (and its ``others``: a tuple's 2nd element, a dataclass field, for births
        only); :meth:`check_kept` reads them later. ``same``: ``t`` is the last exit's output, unchanged. True
        when the call is a container returning its last child's output (kept once, under both paths)."""
        kept, ctx = self.kept, self.ctx
        depth = self._depth()
        site = CallSite(self._starts[depth - 1] if 0 < depth <= len(self._starts) else None, args, self.kwargs, path)
        if depth == 1:  # checked as this exit returns (``exit``), then dropped
            call, place = site.call(), site.place()
            if t.requires_grad:
                self.model_calls.add(module, call, compat.next_sequence_nr(), place._replace(module=None))
            self._outer_call = Kept(t, [path], ctx.clock.iteration, module, (), place, call=call)
        container = same and kept.entries and kept.entries[-1].value() is t
        main = kept.entries.pop() if container else None
        for other in others:
            self._keep(other, module, site, table=False)
        if main is not None:
            kept.entries.append(main)  # last again: the next container can find it
            main.paths.append(path)  # a container returning its last child's output
            return True
        self._keep(t, module, site)
        return False

    def _keep(self, t: torch.Tensor, module: torch.nn.Module, site: CallSite, table: bool = True) -> None:
        """Keep one output of a module call. A CPU output is read at once (reading a CPU scalar is no
        synchronisation): a finite one keeps only what the table needs (unless it is float16/bfloat16: see
        KeptCheck), a non-finite one what a replay needs too. Another device's statistics are computed now,
        while the output is still in the cache (not read: :meth:`check_kept` reads every entry's together).
        Our ops pass no dispatch mode."""
        weak = not t.requires_grad  # no autograd keeps it: neither do we (inference, generation)
        kept, iteration = self.kept, self.ctx.clock.iteration
        values = None
        if t.dtype in ops.HALF:
            self.saw_half = True
        with self.ctx.quiet() if compat.dispatch_stack_len() else _NOTHING:
            if t.is_cpu and READ_AT_EXIT:
                values = stat_values(t)
                # (a half-precision call is kept whole: its inputs may have overflowed inside, see KeptCheck)
                if not nonfinite_reading(values) and t.dtype not in ops.HALF:
                    if table:
                        kept.read(t, site.path, module, iteration, values, weak)
                    return
            entry = kept.output(t, site.path, module, site.inputs(), site.place(), iteration, weak, table, values)
            if t.dtype in ops.HALF and (weak or values is not None) and not nonfinite_reading(values):
                # (read now while the inputs live: a no-grad call's are gone by the check; on a device, a sync)
                entry.squares_risk = ops.squares_may_overflow(site.inputs())
        call = site.call()
        entry.call = call.weakened() if weak else call

    # -- checking -----------------------------------------------------------------------------
    def check_kept(self) -> None:
        """Read every kept output (one transfer), in the order the modules exited: the table's
        statistics, and a non-finite output goes to the replayer (innermost call first). See
        :class:`~replay.inside.KeptCheck`."""
        outer, self._outer_call = self._outer_call, None
        if not self.kept.entries:
            return
        # The model call's first autograd node (a tensor made from there on was made inside the call).
        model_seq = outer.call.seq if outer is not None and outer.call is not None else \
            self._starts[0][2] if self._starts else None
        KeptCheck(self, self.replayer, outer, model_seq).run()

    def raised(self, module: torch.nn.Module, args: Any, kwargs: dict) -> None:
        """The outermost forward raised (``torch.multinomial`` on NaN probabilities, an assert on the
        values): check what its inner modules returned, and if that names no birth, replay the whole
        call under the per-op watch up to the same error, as the always-on watch would have seen it."""
        try:
            path = self.ctx.module_path()
            call = capture(tuple(args), dict(kwargs), self._starts[0] if self._starts else None)
            first = self.ctx.log.mark()
            with self.ctx.quiet():
                self.ctx.flush()  # the kept outputs of the modules that returned
            if not self.ctx.log.since(first) and path is not None:
                entry = Kept(None, [path], self.ctx.clock.iteration, module, (), here(path, None), call=call)
                self.replayer.birth(entry, first, fallback=False)
        except Exception as exc:  # noqa: BLE001 - the user's own error is the one that propagates
            self.ctx.internal_error(f"the forward of {type(module).__name__} that raised", exc)

    def finish(self) -> None:
        """The watch ends: say what it did not see (half-precision calls, nothing found)."""
        if self.saw_half and not self.ctx.log.has_events():
            self.replayer.note(HALF_UNWATCHED)

    def forget(self) -> None:
        self._outer_call = None
        self._starts.clear()
        self.model_calls.clear()
        self.kept.clear()


def _inplace_from_class(cls: type) -> bool:
    return (any("inplace" in vars(k) for k in cls.__mro__)
            or getattr(cls, "__getattr__", None) is not torch.nn.Module.__getattr__)


# module class -> whether ``inplace`` may come from the class
_INPLACE_CLASSES = ByClass(_inplace_from_class)


def declares_inplace(module: torch.nn.Module) -> bool:
    """``getattr(module, "inplace", False) is True`` without ``Module.__getattr__``'s raise for the many
    modules that have no such attribute: an instance attribute (``nn.ReLU(inplace=True)``) is read from
    ``__dict__``; a class attribute, property or ``__getattr__`` of the class's own goes through getattr."""
    if _INPLACE_CLASSES.get(type(module)):
        return getattr(module, "inplace", False) is True
    return module.__dict__.get("inplace", False) is True
