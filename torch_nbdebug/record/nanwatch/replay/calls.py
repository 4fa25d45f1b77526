"""The model calls' side of nanwatch's unwatched backward (``replay=True``; see :mod:`replay.backward`).

A model call whose forward ran without the per-op mode is a :class:`Region` until the backward after it
is checked: the gradients into its float outputs are kept (tensor hooks) until the backward ends; a
non-finite gradient into one of its module outputs (``ModuleTable.on_grad``), into its arguments, or
in the ``.grad`` of its parameters (one ``_foreach_norm``, one read) marks it; when the gradients into
its outputs allow a birth inside (:func:`may_hold_birth`), its forward *and* backward are replayed
under the per-op watch (same arguments, weights and RNG; no ``.grad`` of the user's changes), in an
isolated event log, and the births found come over with the original call's sequence numbers and lines,
exactly as the always-on watch reports them. When a replay is not possible the birth is reported at
module level ("gradient into <module>") with a note saying why. The gradients are dropped after the check.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import torch

from torch_nbdebug.data.stats import TensorStats
from torch_nbdebug.record import compat
from torch_nbdebug.record.nanwatch.context import ReplayHost
from torch_nbdebug.record.nanwatch.core import ops
from torch_nbdebug.record.nanwatch.core.events import stats_of
from torch_nbdebug.record.nanwatch.checks.optim import nonfinite_norms
from torch_nbdebug.record.nanwatch.replay.graph import (_engine_run_backward, backward_of, dense_grads, detached,
                                                        float_grads, roots, tensors)
from torch_nbdebug.record.nanwatch.replay.forward import (NOT_REPLAYED, Call, at_place, replay_context, user_line,
                                                  why_not_replayable)

_MAX_REGIONS = 8  # model calls waiting for their backward (two forwards, then one backward)
_MAX_DROPPED = 4096  # sequence ranges of the calls dropped before one backward (to name its births)


def may_hold_birth(came_bad: bool, came_nan: bool, made_nan: bool, had_events: bool) -> bool:
    """Whether ops that made non-finite gradients can hold a birth or input data by the rules of
    ``core.rules.judge``, knowing only what reached them (``came_*``) and what they made: the
    gradients reached them finite, or nothing was reported yet (input data), or a NaN came out of
    infinities only. Otherwise every op there judges "propagation": nothing to run again."""
    return not came_bad or not had_events or (made_nan and not came_nan)



class Region:
    """One outermost model call whose forward ran without the per-op watch, until its backward is checked."""

    def __init__(self, module: torch.nn.Module, call: Call, end: int, where: Any, path: str) -> None:
        self.module, self.call, self.end, self.where, self.path = module, call, end, where, path
        self.grads: dict[int, torch.Tensor] = {}  # output leaf index -> the gradient into it (this backward)
        self.active = False  # a gradient reached the call in the running backward
        self.args_bad = self.args_nan = False
        self.inner: Optional[tuple[str, TensorStats]] = None  # the first non-finite module gradient
        self.absorbed = False  # a non-finite gradient reached a masking node inside (``replay.nodes.Absorber``)
        self.checked = False  # a backward through it was checked
        self.saved_hooks = compat.saved_tensors_hooks_active()  # a replay would run their pack/unpack again

    def reset(self) -> None:
        self.grads, self.active, self.args_bad, self.args_nan, self.inner = {}, False, False, False, None
        self.absorbed = False

    def owns(self, path: str) -> bool:
        return path == self.path or path.startswith(self.path + ".")


class _LeafGrad:
    """Tensor hook on a float output of a model call: keeps the gradient into it until the check (only
    in a backward the gate runs: one that the dispatch mode watches needs no check)."""

    __slots__ = ("region", "index", "watch")

    def __init__(self, region: Region, index: int, watch: "CallChecks") -> None:
        self.region, self.index, self.watch = region, index, watch

    def __call__(self, grad: Any) -> None:
        if isinstance(grad, torch.Tensor) and self.watch.unwatched:
            self.region.grads[self.index] = grad
            self.region.active = True


class _ArgGrad:
    """Tensor hook on a float argument of a model call that requires grad: notes a non-finite gradient."""

    __slots__ = ("region", "watch")

    def __init__(self, region: Region, watch: "CallChecks") -> None:
        self.region, self.watch = region, watch

    def __call__(self, grad: Any) -> None:
        if not self.watch.unwatched:
            return
        try:
            self.region.active = True
            if not ops.finite(grad):
                self.region.args_bad = True
                self.region.args_nan = self.region.args_nan or ops.has_nan(grad)
        except Exception as exc:  # noqa: BLE001 - a debugging aid must not change the program
            self.watch.host.internal_error("the gradient into a model's argument", exc)



OWN_TENSOR_HOOKS = (_LeafGrad, _ArgGrad)  # (not the user's: they keep a backward unwatched)


class CallChecks:
    """The model calls of the running training step and the check of their backward. ``host`` is the
    recorder, seen as a ``ReplayHost`` (its ``log``, ``clock``, ``model_calls``, ``verdicts``, ``produced``,
    ``keep_handle``, ``internal_error``, ``own_hook_ids``, ``quiet``, ``isolated`` and ``watched``);
    ``unwatched()`` says whether a backward runs without the per-op mode now (only then are gradients kept)."""

    def __init__(self, host: ReplayHost, note: Callable[[str], None], unwatched: Callable[[], bool]) -> None:
        self.host, self._note, self._unwatched = host, note, unwatched
        self.regions: list[Region] = []
        self.replays = 0
        self._reproduced = False  # the last replay's gradients were non-finite too
        self._params: dict[int, tuple[torch.nn.Module, list[torch.Tensor]]] = {}
        self._fresh: list[tuple[torch.Tensor, Optional[torch.Tensor]]] = []  # the last replay's gradients
        self._finite_before: set[int] = set()  # ids of the parameters whose .grad was finite as the backward began
        # the model calls dropped while waiting for their backward (more than _MAX_REGIONS): (seq, end, path, line)
        self.dropped: list[tuple[int, int, str, Any]] = []

    @property
    def unwatched(self) -> bool:
        return self._unwatched()

    def drop_gradients(self) -> None:
        """Whatever happened in the backward (a Stop): no gradient is kept past it."""
        for region in self.regions:
            if region.active:
                region.reset()
                region.checked = True

    def model_called(self, module: torch.nn.Module, output: Any, path: Optional[str]) -> None:
        """The outermost call ``module`` ran without the per-op watch and returned ``output``."""
        calls = self.host.model_calls.calls
        if not calls or calls[-1][0] is not module or path is None:
            return
        _, call, end, where = calls[-1]
        if any(r.call is call for r in self.regions):
            return
        leaves = ops.float_leaves(output)
        if not any(t.requires_grad for t in leaves):
            return
        region = Region(module, call, end, where, path)
        waiting = [r for r in self.regions if not r.checked]
        if len(waiting) >= _MAX_REGIONS and len(self.dropped) < _MAX_DROPPED:
            first = waiting[0]  # (its backward runs watched: the birth is named with the call's module)
            self.dropped.append((first.call.seq if first.call.seq is not None else 0, first.end, first.path,
                                 first.where))
        self.regions = waiting[-(_MAX_REGIONS - 1):] + [region]
        host = self.host
        for i, t in enumerate(leaves):
            if t.requires_grad:
                host.keep_handle(t.register_hook(_LeafGrad(region, i, self)))
        for t in call.tensors:
            if t.requires_grad and ops.checkable(t):
                host.keep_handle(t.register_hook(_ArgGrad(region, self)))

    def gradient_bad(self, path: str, grad: torch.Tensor) -> None:
        """A module output's gradient is non-finite (``ModuleTable.on_grad``): mark its model call."""
        if not self.unwatched:
            return
        node = compat.current_autograd_node()  # (in a tensor hook: the node that made the output's gradient)
        seq = compat.node_sequence_nr(node) if node is not None else None
        for region in self.regions:
            if region.inner is None and region.owns(path) and (
                    seq is None or region.call.seq is None or region.call.seq <= seq < region.end):
                region.active = True
                region.inner = (path, stats_of([grad], 1)[0])

    def forget(self, everything: bool = False) -> None:
        """Drop the model calls (a step changes the weights); ``everything``: the watch ends."""
        self.regions, self.dropped = [], []
        if everything:
            self._params.clear()

    def after(self, results: Any = None) -> None:
        """The backward ended: find the model calls where a gradient went non-finite, and replay them."""
        active = [r for r in self.regions if r.active]
        if not active:
            return
        try:
            suspects = [r for r in active if r.inner is not None or r.args_bad or r.absorbed]
            rest = [r for r in active if r.inner is None and not r.args_bad and not r.absorbed]
            if results is not None and rest and not all(
                    ops.finite(g) for g in (results if isinstance(results, (tuple, list)) else (results,))):
                suspects, rest = suspects + rest, []
            suspects += self._bad_weights(rest)
            left = []
            for region in sorted(suspects, key=self.regions.index, reverse=True):  # the engine's order
                if len(region.grads) > 1 or self._judged(region, list(region.grads.values())):
                    left.append(self._replay_or_report(region))  # (several outputs: the replay finds the roots)
            for pending in left:  # module-level answers once every replay is in (a replay may find the birth)
                if pending is not None:
                    self._report(*pending)
        finally:
            for region in active:
                region.reset()
                region.checked = True

    def _bad_weights(self, regions: list[Region]) -> list[Region]:
        """The calls whose parameters' ``.grad`` is non-finite: one batched norm, one read."""
        grads: list[torch.Tensor] = []
        owner: list[int] = []
        for i, region in enumerate(regions):
            found = float_grads(self._call_parameters(region))
            grads += found
            owner += [i] * len(found)
        values = nonfinite_norms(grads) if grads else None
        if values is None:
            return []
        bad = {owner[k] for k, v in enumerate(values) if not math.isfinite(v)}
        return [regions[i] for i in sorted(bad)]

    def _parameters(self, module: torch.nn.Module) -> list[torch.Tensor]:
        """The parameters that require grad, listed once per model and watch (walking the module tree
        each backward costs as much as the check)."""
        cached = self._params.get(id(module))
        if cached is None or cached[0] is not module:
            cached = self._params[id(module)] = (module, [p for p in module.parameters() if p.requires_grad])
        return cached[1]

    def _call_parameters(self, region: Region) -> "tuple[torch.Tensor, ...] | list[torch.Tensor]":
        """The call's parameters as listed when it ran (``ModelCalls.add``), else its module's."""
        return region.call.parameters or self._parameters(region.module)

    # -- the replay of a model call ------------------------------------------------------------
    def not_replayable(self, region: Region, forward: bool = False) -> str:
        """Why the call cannot be replayed exactly ("" when it can); asked before its backward starts
        (then that backward runs watched) and again after it. ``forward``: only the reasons that keep its
        forward from being replayed too (``replay.births.name_backward_births`` refuses the same)."""
        reason = why_not_replayable(region.call, region.module, self.host.own_hook_ids())
        if reason or forward:
            return reason
        return ("saved-tensor hooks were active at the call" if region.saved_hooks
                else "a parameter has a hook (register_hook or register_post_accumulate_grad_hook)"
                if compat.hooked_leaves(self._call_parameters(region), OWN_TENSOR_HOOKS)
                else "")

    def grads_before(self, regions: list[Region]) -> None:
        """As the backward starts: which parameters of ``regions`` hold a finite ``.grad`` (only those can
        overflow in this backward's accumulation; one batched norm, read when a ``.grad`` exists)."""
        pairs = [pair for r in regions for pair in dense_grads(self._call_parameters(r))]
        self._finite_before = set()
        if not pairs:
            return
        values = nonfinite_norms([g for _, g in pairs])
        self._finite_before = {id(p) for k, (p, _) in enumerate(pairs) if values is None or math.isfinite(values[k])}

    def _replay_or_report(self, region: Region) -> Optional[tuple[Region, str]]:
        """Replay the call; what is left to report at module level (after every replay), or None."""
        host = self.host
        why = self.not_replayable(region)
        before = host.log.mark()
        if why and not self._judged(region, list(region.grads.values())):
            return None  # the non-finite gradient came into the call from outside: a propagation
        if not why:
            try:
                if not self._replay(region):
                    return None
            except Exception as exc:  # noqa: BLE001 - the module-level answer stands
                why = f"the replay raised {type(exc).__name__}: {exc}"
            fresh, self._fresh = self._fresh, []
            if not why and not host.log.since(before):
                if not self._reproduced and region.inner is None and not region.args_bad:
                    self._accumulated(fresh)  # only a weight's .grad: finite gradients added up to Inf?
                if self._reproduced or (region.inner is None and not region.args_bad):
                    return None  # a propagation; or a .grad non-finite since an earlier backward
                why = "the replay stayed finite (randomness or state outside the call, or nondeterminism)"
        return (region, why) if why else None

    def _report(self, region: Region, why: str) -> None:
        before = self.host.log.mark()
        self._module_level(region)
        if self.host.log.since(before):
            self._note(NOT_REPLAYED.format(module=region.path, why=why))

    def _accumulated(self, fresh: list[tuple[torch.Tensor, Optional[torch.Tensor]]]) -> None:
        """``.grad += grad`` overflowed in a parameter's ``AccumulateGrad`` (no ``zero_grad``): this
        backward's gradient (the replay's) is finite, the ``.grad`` it was added to was finite when the
        backward began (:meth:`grads_before`), the sum is not. The in-place add is judged as the always-on
        watch judged it in the node."""
        host = self.host
        for p, new in fresh:
            g = p.grad
            if new is None or g is None or id(p) not in self._finite_before or ops.finite(g) or not ops.finite(new):
                continue
            with torch.enable_grad():
                node = p.view_as(p).grad_fn.next_functions[0][0]  # type: ignore[union-attr] # its AccumulateGrad
            with host.log.rerunning([]):
                _engine_run_backward(host.immediate, g, new, node)

    def _judged(self, region: Region, grads: list[torch.Tensor]) -> bool:
        """Whether the always-on watch could find a birth (or input data) inside the call, given the
        gradients into its outputs (``core.rules.judge``: finite ones, nothing reported yet, or
        a NaN inside from infinities only)."""
        came = [g for g in grads if not ops.finite(g)]
        if not came or not self.host.log.has_events():
            return True
        came_nan = any(ops.has_nan(g) for g in came)
        made_nan = (region.inner is not None and bool(region.inner[1].nan)) or region.args_nan or (
            not came_nan and any(p.grad is not None and ops.checkable(p.grad) and ops.has_nan(p.grad)
                                 for p in self._call_parameters(region)))
        return may_hold_birth(True, came_nan, made_nan, True)

    def _replay(self, region: Region) -> bool:
        """Forward and backward of the call again under the per-op watch, in an isolated log; its
        births come over with the original call's sequence numbers and lines. False when the
        gradients into the call's outputs say its non-finite values came from outside."""
        host, call, module = self.host, region.call, region.module
        indices = sorted(region.grads)
        args, kwargs, arg_inputs = detached(call.args), detached(call.kwargs), []
        for value in (args, kwargs):
            arg_inputs += [t for t in tensors(value) if t.requires_grad]
        self.replays += 1
        self._reproduced = False
        with host.isolated() as (log, places):
            probe, start = user_line(), compat.next_sequence_nr()
            with replay_context(module, call, lambda: host.watched(host.clock.iteration)) as changed:
                with torch.enable_grad():
                    leaves = ops.float_leaves(module(*args, **kwargs))
                    for seq, place in list(places.items()):  # a library module's ops: the call's line
                        if (place.filename, place.lineno) == probe and region.where is not None:
                            places[seq] = region.where._replace(op=place.op, module=place.module)
                    pairs = roots([(leaves[i], region.grads[i]) for i in indices
                                    if i < len(leaves) and leaves[i].requires_grad], start)
                    with host.quiet():  # (our reads are not the call's ops)
                        if not self._judged(region, [g for _, g in pairs]):
                            return False
                    inputs = list(self._parameters(module)) + arg_inputs
                    host.produced.add_all([g for _, g in pairs])  # made by backward ops, as for the always-on watch
                    if pairs and inputs:
                        made = backward_of([o for o, _ in pairs], [g for _, g in pairs], inputs, start)
                        with host.quiet():
                            self._reproduced = not all(ops.finite(g) for g in made if g is not None)
                        self._fresh = list(zip(inputs, made))  # read by _replay_or_report, then dropped
                        del made
            log.commit_held()
            events, absorbed = list(log.events), set(log.absorbed)
        if changed:
            self._note(f"{region.path}: the replay changed the module's attributes (put back)")
        shift = call.seq - start if call.seq is not None else None
        real = host.log
        for i, event in enumerate(events):
            if event.phase == "backward" and event.sequence_nr is not None and (
                    event.sequence_nr == compat.NO_SEQUENCE or event.sequence_nr < start):
                continue  # not the call's node (a tensor hook on a parameter, run again by autograd.grad)
            if event.sequence_nr is not None and event.sequence_nr != compat.NO_SEQUENCE:
                event = dataclasses.replace(event, sequence_nr=event.sequence_nr + shift if shift is not None
                                            else None)
            if event.phase == "forward" and (event.filename, event.lineno) == probe and region.where is not None:
                event = at_place(event, region.where)
            if event.phase == "forward" and i in absorbed:
                real.add_absorbed(event)
            elif event.phase == "forward" and not real.reported_forward(event):
                real.add(event)  # inside a module whose output came out finite (tanh of an Inf): unseen at the exit
            if event.phase == "forward" or (event.phase == "input" and event.node_name is None):
                continue  # a forward birth the check at the model's exit reported already
            real.add(event)
        return True

    def _module_level(self, region: Region) -> None:
        """No replay: the birth at module level, the first non-finite gradient the watch saw there."""
        if region.inner is not None:
            path, stats = region.inner
        elif region.args_bad:
            path, stats = region.path, None
        else:
            found = next(((name, p.grad) for name, p in region.module.named_parameters()
                          if p.grad is not None and not ops.finite(p.grad)), None)
            if found is None:
                return
            path, stats = f"{region.path}.{found[0]}", stats_of([found[1]], 1)[0]
        self.host.verdicts.gradient_birth(path, stats, self.host.clock.iteration)
