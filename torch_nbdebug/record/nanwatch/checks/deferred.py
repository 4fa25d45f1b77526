"""The deferred check path (CUDA by default): flags stay on the device and are read together later.

Each checked op queues one small device tensor of flags (its outputs', then its inputs' sums) with
what is known without reading it: the :class:`Site`, storage keys, which inputs came from outside.
The recorder's flush reads the whole queue (with the layer statistics) in one transfer per device once
per forward: when the backward starts (the model and its loss done), or at the end of the model's
forward when no backward follows — while the activations the checks name are alive, for their exact
statistics. :meth:`DeferredChecks.replay` replays it in order through the same rules as the immediate
path (:func:`judge`, the event log's where-trap and held-backward bookkeeping), so both paths report
the same births. ``where``/``masked_fill`` ops, each backward node's finished gradients and the
optimizer step's parameter norms are queued too and read with the next forward's checks: one host
synchronisation per training step. With ``raise_on_birth`` every check is read at once: raising at the
birth line needs that.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any, Callable, Optional, Union

import torch

from torch_nbdebug.data.nanwatch import Kind
from torch_nbdebug.data.stats import TensorStats
from torch_nbdebug.record.nanwatch.checks.queued import (AbsorbCheck, GradCheck, ModuleCheck, NodeCheck, OpCheck,
                                                         Queued, StepCheck)
from torch_nbdebug.record.nanwatch.context import NodeDone, WatchContext, op_site, report_op, shown_inputs
from torch_nbdebug.record.nanwatch.core import ops
from torch_nbdebug.record.nanwatch.core.events import Place, Shape, Site, here, make_event, node_input_producer, producer
from torch_nbdebug.record.nanwatch.core.layers import Later
from torch_nbdebug.record.nanwatch.core.rules import InputFact, OpFacts, OpPhase, Verdict, judge, judge_absorb, \
    judge_gradient
from torch_nbdebug.record.nanwatch.modules.rule import LeftAt, judge_call, module_event
from torch_nbdebug.record.tensors import storage_key

_MAX_QUEUE = 4096  # read earlier when this many checks wait
_INF = math.inf


class DeferredChecks:
    def __init__(self, ctx: WatchContext) -> None:
        self.ctx = ctx
        self.pending: list[Queued] = []
        self._hooked: Optional[int] = None  # id of the last backward node given a post hook
        # Storages the hooked node's queued ops wrote: its finished gradients are usually among them,
        # so their flags are reused rather than summed again (a weight gradient is a full pass).
        self._node_outs: set[int] = set()
        self._bad_keys: dict[int, bool] = {}  # replay: the latest flag of each storage the node wrote
        self.left_at = LeftAt()  # module mode: calls left to their enclosing module

    # -- queueing (no device read) -----------------------------------------------------------------
    def queue_op(self, func: Any, args: tuple, kwargs: dict, outs: list[torch.Tensor], phase: OpPhase, node: Any,
                 pre: Optional[torch.Tensor], seq: Optional[int]) -> None:
        """Queue one op's check. ``pre`` is an in-place op's input from before the op (see pre_state)."""
        if ops.has_nonfinite_scalar(args, kwargs):
            return
        ctx = self.ctx
        inputs = ops.op_inputs(func, args, kwargs)  # out= tensors are outputs, not inputs
        external = tuple(not ctx.produced.contains(t) for t in inputs)
        keys = tuple(storage_key(t) for t in inputs) + tuple(storage_key(t) for t in outs)
        inplace = pre is not None and bool(inputs) and inputs[0] is args[0]
        if pre is not None and inplace:
            inputs = [pre.reshape(1)] + inputs[1:]
        site = op_site(ctx, func, phase, node, seq, sys._getframe(1))
        if phase == "backward":
            self._watch_node(node)
            self._node_outs.update(k for k in keys[len(inputs):] if k is not None)
            node_key: Optional[int] = id(node)
            made_by = node_input_producer(node)
        else:  # named now: the input (and so its grad_fn) may be gone when the flags are read
            node_key, made_by = None, producer(inputs[0]) if inputs else None
        self._push(OpCheck(_flags(outs + inputs), _shapes(outs), _shapes(inputs), keys, external, site,
                           ctx.clock.iteration, node_key, made_by, inplace))

    def queue_absorb(self, args: tuple, kwargs: dict, outs: list[torch.Tensor], backward: bool) -> None:
        """A where/masked_fill: replayed in order, it tells whether a born value was thrown away."""
        inputs = ops.float_inputs(args, kwargs)
        if not inputs:
            return
        out_keys = tuple(storage_key(t) for t in outs)
        keys = tuple(storage_key(t) for t in inputs)
        if backward:  # a gradient formula masking inside its node (the norm's masked_fill_)
            self._node_outs.update(k for k in out_keys if k is not None)
        self._push(AbsorbCheck(_flags(outs + inputs), len(outs), keys + out_keys, tuple(k in out_keys for k in keys)))

    def queue_module(self, path: str, module: torch.nn.Module, args: Any, t: torch.Tensor, reading: Later,
                     coming_in: Callable[[list[torch.Tensor]], tuple[bool, ...]]) -> None:
        """Module mode: queue a module's output (no op-level tracking: ``coming_in`` tells which inputs are
        data coming in, the others an enclosing module's own code made). The output's flag is the layer
        table's ``reading`` of it (no second reduction); its inputs are summed."""
        inputs = ops.float_inputs(args, {})
        site = Site("forward", f"{type(module).__name__} (module output)", here(path, None))
        self._push(ModuleCheck(_flags(inputs) if inputs else None, (Shape.of(t),), _shapes(inputs), coming_in(inputs),
                               site, self.ctx.clock.iteration, module, reading))

    def queue_grad(self, path: str, grad: torch.Tensor, reading: Later) -> None:
        """Module mode: queue the gradient into a module's output, flagged by the layer table's ``reading`` of it."""
        site = Site("backward", f"gradient into {path}", Place(None, path, None, None, "<module>"))
        self._push(GradCheck((Shape.of(grad),), site, self.ctx.clock.iteration, reading))

    def queue_step(self, norms: torch.Tensor, judge: Callable[[list[float]], None]) -> None:
        """An optimizer step's parameter (and gradient) norms: ``judge`` gets their values, in order."""
        self._push(StepCheck(norms, judge))

    def _watch_node(self, node: Any) -> None:
        """Give each backward node with a checked op a post hook that queues its gradients' flags."""
        key = id(node)
        if key != self._hooked:
            self._hooked = key
            self._node_outs = set()
            self.ctx.keep_handle(node.register_hook(NodeDone(self, key)))

    def node_done(self, key: int, grad_inputs: Any) -> None:
        """Queue what the node's gradients are: flags of its own queued outputs, else new sums."""
        with self.ctx.quiet():
            grads = [g for g in grad_inputs if isinstance(g, torch.Tensor) and ops.checkable(g) and g.numel()]
            keys = [storage_key(g) for g in grads]
            reused = tuple(k for k in keys if k is not None and k in self._node_outs)
            fresh = [g for g, k in zip(grads, keys) if k is None or k not in self._node_outs]
            self._push(NodeCheck(_flags(fresh) if fresh else None, reused, key))

    def _push(self, p: Queued) -> None:
        self.pending.append(p)
        if len(self.pending) > _MAX_QUEUE or self.ctx.options.raise_on_birth:
            self.ctx.flush()

    # -- reading and replaying ---------------------------------------------------------------------
    def take(self) -> tuple[list[Queued], list[torch.Tensor]]:
        """Hand over the queue and the device tensors to read for it (the recorder reads them all at once)."""
        pending, self.pending = self.pending, []
        return pending, [p.flags for p in pending if p.flags is not None]

    def replay(self, pending: list[Queued], readings: list[list[float]]) -> None:
        """Replay the checks :meth:`take` handed over, in order, with the values read for them."""
        self.left_at.clear()  # (a forward's modules are queued and read together)
        values = iter(readings)
        for p in pending:
            sums = next(values) if p.flags is not None else []
            if isinstance(p, StepCheck):
                p.judge(sums)
                continue
            bad = [not math.isfinite(v) for v in sums]
            if isinstance(p, NodeCheck):
                # A gradient no replayed check wrote (another node's storage) counts as non-finite: keep.
                self.ctx.log.node_done(p.node_key, bad + [self._bad_keys.get(k, True) for k in p.reused])
                self._bad_keys.clear()
                continue
            nan, neg = [v != v for v in sums], [v < 0 for v in sums]
            if isinstance(p, (ModuleCheck, GradCheck)):  # the output's flags (first), from the table's reading
                out_bad, out_nan, out_neg = reading_flags(p.reading.values, p.outputs[0].dtype == "float64")
                if out_bad:
                    self._replay_call(p, [out_bad] + bad, [out_nan] + nan, [out_neg] + neg)
            elif isinstance(p, AbsorbCheck):
                self._note_written(p.keys[len(p.keys) - p.n_out:], bad[: p.n_out])
                self._replay_absorb(p, bad)
            else:
                n = len(p.outputs)
                if p.site.phase == "backward":
                    self._note_written(p.keys[len(p.inputs):], bad[:n])
                if any(bad[:n]):
                    self._replay_op(p, bad, nan, neg, any(v == _INF for v in sums[:n]))

    def _note_written(self, keys: tuple[Optional[int], ...], bad: list[bool]) -> None:
        """The flags of the storages a backward check wrote: its node's gradients are among them."""
        self._bad_keys.update((k, b) for k, b in zip(keys, bad) if k is not None)

    def _replay_absorb(self, p: AbsorbCheck, bad: list[bool]) -> None:
        log = self.ctx.log
        keys = p.keys[: len(p.keys) - p.n_out]
        born = [log.is_born(k) for k in keys]
        if any(born):
            log.absorb(keys, judge_absorb(any(bad[: p.n_out]), born, bad[p.n_out:], p.written))

    def _replay_op(self, p: OpCheck, bad: list[bool], nan: list[bool], neg: list[bool], pos_inf: bool) -> None:
        n, log, phase = len(p.outputs), self.ctx.log, p.site.phase
        in_bad, in_nan = bad[n:], nan[n:]
        keys = p.keys[: len(p.inputs)]
        facts = OpFacts(phase, any(nan[:n]), tuple(
            InputFact(b, a, b and not a and s, b and e, phase == "backward" and b and log.from_absorbed(k))
            for b, a, s, e, k in zip(in_bad, in_nan, neg[n:], p.external, keys)), log.has_events(), pos_inf)
        verdict = judge(facts)
        if verdict == "propagation":
            if phase == "forward":
                log.propagated([k for k, b in zip(keys, in_bad) if b])
            return
        kind, output, stats, detail = _found(p, verdict, bad, nan, neg, p.inplace)
        culprits = [k for k, b in zip(keys, in_bad) if b]
        event = report_op(self.ctx, p.site, verdict, kind, stats, output, culprits, p.made_by, p.iteration,
                          deferred=True, detail=detail)
        if event is None:
            return
        if phase == "backward" and verdict == "birth" and p.node_key is not None:
            log.hold(p.node_key, event)
        else:
            log.add(event, [k for k, b in zip(p.keys[len(p.inputs):], bad[:n]) if b])

    def _replay_call(self, p: Union[ModuleCheck, GradCheck], bad: list[bool], nan: list[bool],
                     neg: list[bool]) -> None:
        """Module mode: a module's output (or the gradient into it) came out non-finite."""
        ctx, in_bad = self.ctx, bad[1:]
        if isinstance(p, GradCheck):
            verdict: Verdict = judge_gradient(ctx.log.has_events())
        else:
            judged = judge_call(self.left_at, ctx.log, p.site.place.module or "", 0, in_bad, p.coming_in, p.module)
            # "left": an enclosing module's own code made them, judged as that module returns
            verdict = "propagation" if judged == "left" else judged
        if verdict == "propagation":
            return
        kind, output, stats, _ = _found(p, verdict, bad, nan, neg, False)
        if ctx.options.ignore_inf and kind == "inf":
            return
        if isinstance(p, ModuleCheck):
            event = module_event(ctx, p.site.place, p.site.op, verdict, stats, output, kind, p.module, any(in_bad),
                                 p.iteration)
        else:
            event = make_event("backward", p.site.op, p.site.place, (), output, kind=kind, iteration=p.iteration)
        ctx.log.add(dataclasses.replace(event, deferred=True))


def _found(p: Union[OpCheck, ModuleCheck, GradCheck], verdict: Verdict, bad: list[bool], nan: list[bool],
           neg: list[bool], inplace: bool) -> tuple[Kind, TensorStats, tuple[TensorStats, ...], str]:
    """What an event shows of a check that found something: its kind, the first non-finite output, the
    inputs it names, and the detail line."""
    n = len(p.outputs)
    kind: Kind = "nan" if any(nan[:n]) else "inf"
    i = next(k for k in range(n) if bad[k])
    output = p.outputs[i].stats(nan[i], bad[i] and not nan[i], neg[i])
    in_bad = bad[n:]
    shown, detail = shown_inputs(verdict, in_bad, inplace)
    stats = tuple(p.inputs[k].stats(nan[n + k], in_bad[k] and not nan[n + k], neg[n + k]) for k in shown)
    return kind, output, stats, detail


def _shapes(tensors: list[torch.Tensor]) -> tuple[Shape, ...]:
    return tuple(Shape.of(t) for t in tensors)


def reading_flags(values: Optional[list[float]], float64: bool) -> tuple[bool, bool, bool]:
    """``bad, nan, negative``, as :func:`_flags`'s float64 sum of a tensor tells them, from the layer
    table's reading ``[min, max, mean]`` of the same tensor (no second reduction). A float64 tensor's
    reading sums in float64 too: its mean decides (huge finite values overflow both sums). Finite
    values of a narrower dtype cannot overflow a float64 sum: the min and max decide, NaN with a NaN
    or both infinities, else non-finite with one infinity. ``None`` (never read) counts as finite."""
    if values is None:
        return False, False, False
    lo, hi, mean = values
    if float64:
        return not math.isfinite(mean), mean != mean, mean < 0
    if lo != lo or hi != hi or (lo == -_INF and hi == _INF):
        return True, True, False
    if hi == _INF:
        return True, False, False
    return lo == -_INF, False, lo == -_INF or mean < 0


def _flags(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's propagating sum, on the device, no sync: NaN/Inf in a tensor make its sum NaN/Inf,
    and a sum of -inf means only -inf values (an additive mask). The flags ``bad, nan, negative`` are
    derived on the host after the one transfer (no kernels for them here). The sums accumulate in
    float64 so that huge finite values (bfloat16 reaches 3.4e38) cannot overflow them: these flags
    are never confirmed against the tensor later."""
    if len(tensors) == 1:
        return tensors[0].sum(dtype=torch.float64).reshape(1)
    return torch.stack([t.sum(dtype=torch.float64) for t in tensors])
