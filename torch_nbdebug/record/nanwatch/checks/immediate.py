"""The immediate check path (CPU): a flagged op is judged at once, while its tensors are alive.

The recorder's hot path has already found a non-finite output sum; here the inputs are read, the facts
go to :func:`~torch_nbdebug.record.nanwatch.core.rules.judge`, and the event goes to the log. A backward
birth waits for its autograd node to finish (a post hook on the node reads the gradients it made).
"""
from __future__ import annotations

import math
import sys
from typing import Any, Optional

import torch

from torch_nbdebug.record.nanwatch.core import ops
from torch_nbdebug.record.nanwatch.core.rules import InputFact, OpFacts, OpPhase, judge, judge_absorb
from torch_nbdebug.record.nanwatch.context import NodeDone, WatchContext, op_site, report_op, shown_inputs
from torch_nbdebug.record.nanwatch.core.events import node_input_producer, producer, stats_of
from torch_nbdebug.record.nanwatch.core.params import copied_from
from torch_nbdebug.record.stats import summarize
from torch_nbdebug.record.tensors import storage_key

class ImmediateChecks:
    def __init__(self, ctx: WatchContext) -> None:
        self.ctx = ctx

    def examine(self, func: Any, args: tuple, kwargs: dict, bad: list[torch.Tensor], phase: OpPhase, node: Any,
                pre: Optional[torch.Tensor], seq: Optional[int]) -> None:
        """A cheap check flagged ``bad`` outputs: decide birth / input / propagation, precisely."""
        if ops.has_nonfinite_scalar(args, kwargs):
            return  # masked_fill(m, -inf), x * inf: the user asked for it
        inputs = ops.op_inputs(func, args, kwargs)  # out= tensors are outputs, not inputs
        values = [_confirmed(t, ops.sum_value(t)) for t in inputs]
        inplace = pre is not None and bool(inputs) and inputs[0] is args[0]
        if pre is not None and inplace:
            values[0] = float(pre.item())  # x.log_(): judge self by its value before the op
        in_bad = [not math.isfinite(v) for v in values]
        if not any(in_bad):
            bad = [t for t in bad if ops.any_nonfinite(t)]  # the sum may have overflowed
            if not bad:
                return
        log, produced = self.ctx.log, self.ctx.produced
        keys = [storage_key(t) if b else None for t, b in zip(inputs, in_bad)]
        facts = OpFacts(phase, any(ops.has_nan(t) for t in bad), tuple(
            InputFact(b, v != v, v == -math.inf, b and not produced.contains(t),
                      phase == "backward" and log.from_absorbed(k))
            for t, b, v, k in zip(inputs, in_bad, values, keys)), log.has_events(),
            any(ops.sum_value(t) == math.inf for t in bad))
        verdict = judge(facts)
        if verdict == "propagation":
            if phase == "forward":
                # (``seq``: the op made an autograd node, so its outputs require grad: see EventLog.cast_away)
                log.propagated(keys, [storage_key(t) for t in bad], seq is not None)
            return
        site = op_site(self.ctx, func, phase, node, seq, sys._getframe(1))
        shown, detail = shown_inputs(verdict, in_bad, inplace)
        made_by = node_input_producer(node) if phase == "backward" else producer(inputs[0]) if inputs else None
        if verdict == "input" and phase == "forward":  # a parameter's NaN copied by an unchecked op (embedding)
            keys = keys + copied_from([t for t, b in zip(inputs, in_bad) if b])
        event = report_op(self.ctx, site, verdict, "nan" if facts.out_nan else "inf",
                          stats_of([inputs[i] for i in shown]), summarize(bad[0]), keys, made_by,
                          self.ctx.clock.iteration, deferred=False, detail=detail)
        if event is None:
            return
        if phase == "backward" and verdict == "birth":
            self.hold(node, event)
        else:
            log.add(event, [storage_key(t) for t in bad], seq is not None)

    def hold(self, node: Any, event: Any) -> None:
        """A backward birth counts only once a non-finite gradient leaves its node (a post hook decides)."""
        key = id(node)
        if self.ctx.log.hold(key, event):  # (not while the node runs again: see EventLog.rerunning)
            self.ctx.keep_handle(node.register_hook(NodeDone(self, key)))

    def node_done(self, key: int, grad_inputs: Any) -> None:
        with self.ctx.quiet():
            grads = [g for g in grad_inputs if isinstance(g, torch.Tensor) and ops.checkable(g)]
            self.ctx.log.node_done(key, [not math.isfinite(ops.sum_value(g)) for g in grads])

    def absorb(self, args: tuple, kwargs: dict, outs: list[torch.Tensor]) -> None:
        """``torch.where``/``masked_fill`` with a finite result may have thrown a born NaN/Inf away."""
        log = self.ctx.log
        inputs = ops.float_inputs(args, kwargs)
        keys = [storage_key(t) for t in inputs]
        born = [log.is_born(k) for k in keys]
        if not any(born):
            return
        out_bad = any(not math.isfinite(ops.sum_value(t)) for t in outs)
        written = {storage_key(t) for t in outs}
        bad = [b and not math.isfinite(ops.sum_value(t)) for t, b in zip(inputs, born)]
        log.absorb(keys, judge_absorb(out_bad, born, bad, [k in written for k in keys]))


def _confirmed(t: torch.Tensor, total: float) -> float:
    """The input's propagating sum, or 0.0 when only the sum overflowed (huge but finite values: +-inf,
    or NaN where both signs overflowed)."""
    if not math.isfinite(total) and not ops.any_nonfinite(t):
        return 0.0
    return total

