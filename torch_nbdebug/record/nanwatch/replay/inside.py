"""Replay's check of the kept module outputs when a model returns, and what tells a NaN made by a module's
own code between its submodules from data coming in.

A forward runs without the per-op watch inside a model, so a submodule whose inputs the code of an enclosing
module made non-finite (attention scores overflowing inside the attention module, fed to its output
projection) would only see them come in, "input data". Such a call is left to the enclosing call, whose replay
under the per-op watch names the op; a tensor counts as made inside when autograd numbered its node from the
model call's first on (data passed in, by keyword or not, or a view of it, was made before), or, for a
replay only, when it was made without autograd and shares no storage with the model's arguments.
"""
from __future__ import annotations

from math import isfinite as _isfinite
from typing import Optional, Protocol

import torch

from torch_nbdebug.record.nanwatch.core import ops
from torch_nbdebug.record.nanwatch.replay.forward import Replayer
from torch_nbdebug.record.tensors import storage_key

from torch_nbdebug.record.nanwatch.context import ModuleReports, WatchContext
from torch_nbdebug.record.nanwatch.core.layers import LayerRecorder
from torch_nbdebug.record.nanwatch.replay.kept import Kept, KeptReadings


class KeptOwner(Protocol):
    """What a check of the kept outputs touches of replay's module layer (``KeptOutputs``): the kept outputs,
    the per-layer table, and the module-level report when no replay names the op."""

    ctx: WatchContext
    layers: LayerRecorder
    kept: KeptReadings
    verdicts: ModuleReports


class KeptCheck:
    """One check of the kept outputs (``KeptOutputs.check_kept``): ``outer`` is the model's call when it
    returned (None: an early check while it runs), ``model_seq`` its first autograd node number."""

    def __init__(self, checks: KeptOwner, replayer: Replayer, outer: Optional[Kept],
                 model_seq: Optional[int]) -> None:
        self.checks, self.replayer, self.outer, self.model_seq = checks, replayer, outer, model_seq

    def run(self) -> None:
        checks, outer, log = self.checks, self.outer, self.checks.ctx.log
        first = log.mark()  # events of earlier checks are other births, not this output's
        freed: list[Kept] = []
        overflowed_freed = False  # a call that may have overflowed inside was freed before its replay
        inside: list[Kept] = []
        waiting: list[Kept] = []  # enclosing calls of ``inside`` that could not be replayed
        later: list[Kept] = []  # an early check (the model still runs): ``inside`` ones wait for its end
        # The storages of the model call's tensor arguments: data coming in (an early check knows none yet).
        arg_keys = {storage_key(t) for t in outer.call.tensors} if outer is not None and outer.call is not None \
            else None
        strong: set[int] = set()  # ids of ``inside`` entries whose inputs autograd saw made inside the call
        take_forward = checks.layers.take_forward
        for entry in checks.kept.take():
            values = entry.values
            if entry.table:
                for path in entry.paths:
                    take_forward(path, values)
            if not (_isfinite(values[0]) and _isfinite(values[1]) and _isfinite(values[2])):  # (nonfinite_reading)
                if entry.value() is None or (entry.call is not None and entry.call.resolved() is None):
                    freed.append(entry)  # no_grad, freed: a replay of an enclosing call may still name the op
                elif self.model_seq is not None and (how := self._made_inside(entry, self.model_seq, arg_keys)):
                    # an enclosing call's own code made its inputs: that call is replayed
                    (inside if outer is not None else later).append(entry)
                    if how == 2:
                        strong.add(id(entry))
                elif inside and encloses(entry, inside):  # at module level only once the model's replay failed
                    if not self.replayer.birth(entry, first, fallback=False) and not log.since(first):
                        waiting.append(entry)
                else:
                    self.replayer.birth(entry, first)
            elif entry.call is not None and self._overflowed_inside(entry):  # (a finite output kept with its call)
                # names the op, if the replay sees one; a call whose arguments are gone (no_grad): the model's
                if not self.replayer.birth(entry, first, fallback=False) and entry.call.resolved() is None:
                    overflowed_freed = True
        if later:
            for entry in later:
                entry.parts = ()  # (read already)
            checks.kept.entries[:0] = later
        if inside and outer is not None:
            self._inside_births(inside, waiting, outer, first, strong)
        if overflowed_freed and outer is not None and not log.since(first):
            self.replayer.birth(outer, first, fallback=False)
        if freed and outer is not None and not any(
                e.module and (e.module == outer.paths[0] or e.module.startswith(outer.paths[0] + "."))
                for e in log.since(first)):
            if self.replayer.birth(outer, first, fallback=False):  # the whole model's call names the ops
                freed = []
        for entry in freed:
            path = entry.paths[0]
            if not any(e.module and (e.module == path or e.module.startswith(path + ".")) for e in log.since(first)):
                checks.verdicts.module_fallback(entry, first)

    def _overflowed_inside(self, entry: Kept) -> bool:
        """A finite half-precision output whose call's inputs reach the square root of the dtype's largest
        number: an Inf may have been born inside and absorbed before the output (``x.pow(2)`` then ``rsqrt``:
        0, finite and wrong). Its replay under the per-op watch finds it, as the always-on watch does."""
        if entry.call is None or entry.meta[1] not in ops.HALF or self.checks.ctx.log.has_events():
            return False
        if entry.squares_risk is not None:
            return entry.squares_risk
        inputs = entry.live_inputs()
        return inputs is not None and ops.squares_may_overflow(inputs)

    def _made_inside(self, entry: Kept, model_seq: int, arg_keys: Optional[set[Optional[int]]]) -> int:
        """A nested call's non-finite output whose non-finite inputs code of an enclosing module made,
        between its submodules (the unwatched part of a forward), before any birth: replaying this call
        would only see them come in ("input data"). 2: autograd made them all inside the model's call (nodes
        numbered from the call's first on: :func:`~torch_nbdebug.record.nanwatch.core.ops.made_since`); 1: the others were made without autograd and
        share no storage with the model's arguments (``arg_keys``; None: not known yet, an early check), so an
        enclosing call's replay can tell (never enough for a module-level answer); 0: data coming in (an
        argument, by keyword or not, or a view of one)."""
        if self.checks.ctx.log.has_events():
            return 0  # an earlier birth flowing through: the replayer judges it
        inputs = entry.live_inputs() or ()
        bad = [x for x in inputs if not isinstance(x, torch.nn.Parameter) and not ops.finite(x)]
        if not bad:
            return 0
        made = [ops.made_since(x, model_seq) for x in bad]
        if all(made):
            return 2
        return int(all(m or (x.grad_fn is None and (arg_keys is None or storage_key(x) not in arg_keys))
                       for m, x in zip(made, bad)))

    def _inside_births(self, inside: list[Kept], waiting: list[Kept], outer: Kept, first: int,
                       strong: set[int]) -> None:
        """Outputs of calls whose inputs an enclosing module's own code made non-finite (``_made_inside``).
        An enclosing call kept as non-finite has been replayed by now, innermost first; if none named the
        op (the enclosing output came out finite, or its call could not be replayed: ``waiting``), the
        model's whole call is replayed; if that names nothing either, the enclosing calls are reported at
        module level; without them, the module that called one whose inputs autograd saw made inside
        (``strong``); else each call is replayed as before (its inputs reported)."""
        log = self.checks.ctx.log
        if log.since(first):
            return  # an enclosing call's replay named the op: these outputs carry its values
        if self.replayer.birth(outer, first, fallback=False) or log.since(first):
            return
        for entry in waiting:
            self.replayer.birth(entry, first)  # replays again, then reports at module level, with the reason
            if log.since(first):
                return
        for entry in inside:
            if id(entry) in strong and self._enclosing_birth(entry, outer, first):
                return
        for entry in inside:
            self.replayer.birth(entry, first)

    def _enclosing_birth(self, entry: Kept, outer: Kept, first: int) -> bool:
        """No call could be replayed: the module whose code called ``entry``'s module (and made its inputs)
        is reported at module level, at the line of that call, with a note."""
        assert outer.module is not None
        child, root = entry.paths[0], outer.paths[0]
        parent = child.rpartition(".")[0]
        t = entry.value()
        if t is None or not (parent == root or parent.startswith(root + ".")):
            return False
        try:
            module = outer.module if parent == root else outer.module.get_submodule(parent[len(root) + 1:])
        except (AttributeError, TypeError):  # named from another root (a shared submodule): no module here
            return False
        place = entry.place._replace(module=parent) if entry.place is not None else None
        self.checks.verdicts.module_birth(parent, module, (), t, place, entry.iteration, first)
        if not self.checks.ctx.log.since(first):
            return False
        self.replayer.note(f"{parent}: its own code made the NaN/Inf that {child} received, and neither it nor "
                           "the model's call could be replayed; reported at module level")
        return True


def encloses(entry: Kept, inside: list[Kept]) -> bool:
    """Whether one of ``entry``'s module paths encloses a module path of an ``inside`` entry."""
    return any(other.startswith(path + ".") for path in entry.paths for e in inside for other in e.paths)

