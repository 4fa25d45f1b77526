"""Deferred checks for CUDA: flags stay on the device and are read together at module boundaries.

Each checked op (or, in module mode, each module output and output gradient) queues one small
device tensor of flags; :func:`flush` reads the whole queue in one transfer per device and applies
the same birth / input / propagation rules as the synchronous CPU path, in the order things ran.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from torch_nbdebug.record import nanwatch_ops as ops
from torch_nbdebug.record.nanwatch_events import Place, Shape, here, make_event
from torch_nbdebug.record.nanwatch_mode import Pending, device_flags, read_all

if TYPE_CHECKING:  # pragma: no cover
    from torch_nbdebug.record.nanwatch import NanRecorder


def is_mask(external_sums: list[float], out_nan: bool) -> bool:
    from torch_nbdebug.record.nanwatch import is_mask as check

    return check(external_sums, out_nan)

_MAX_QUEUE = 4096  # read earlier than the next boundary when this many checks wait


def queue_op(rec: "NanRecorder", func: Any, args: tuple, kwargs: dict, outs: list[torch.Tensor],
             phase: str, node: Any, pre: Optional[torch.Tensor] = None) -> None:
    """Queue one op's check (forward or backward); nothing is read from the device here.

    ``pre`` is an in-place op's input sum from before the op: it stands in for the overwritten input."""
    if ops.has_nonfinite_scalar(args, kwargs):
        return
    inputs = ops.op_inputs(func, args, kwargs)  # out= tensors are outputs, not inputs
    external = tuple(not rec.produced.contains(t) for t in inputs)
    if pre is not None and inputs and inputs[0] is args[0]:
        inputs = [pre.reshape(1)] + inputs[1:]
    if phase == "backward":
        seq = node._sequence_nr()
        fwd = rec.forward_place(seq)
        place = fwd if fwd is not None else here(None, None)
        extra = dict(node=node.name(), seq=seq, fwd_op=ops.op_name(fwd.op) if fwd and fwd.op is not None else None)
    else:
        place, extra = here(rec.module_path(), func), dict(seq=rec.op_seq)
    _push(rec, outs, inputs, external, phase, ops.op_name(func), place, extra)


def queue_module(rec: "NanRecorder", path: str, module: torch.nn.Module, args: Any, t: torch.Tensor) -> None:
    """Module mode: queue the output of a module (inputs count as external: no op-level tracking)."""
    inputs = ops.float_inputs(args, {})
    place = here(path, None)
    _push(rec, [t], inputs, tuple(True for _ in inputs), "forward", f"{type(module).__name__} (module output)",
          place, dict(module_mode=True, path=path))


def queue_grad(rec: "NanRecorder", path: str, grad: torch.Tensor) -> None:
    _push(rec, [grad], [], (), "backward", f"gradient into {path}", Place(None, path, None, None, "<module>"),
          dict(grad=True))


def _push(rec: "NanRecorder", outs: list[torch.Tensor], inputs: list[torch.Tensor], external: tuple[bool, ...],
          phase: str, op: str, place: Place, extra: dict) -> None:
    rec.pending.append(Pending(
        flags=device_flags(outs + inputs), n_out=len(outs), external=external,
        outputs=tuple(Shape.of(t) for t in outs), inputs=tuple(Shape.of(t) for t in inputs),
        phase=phase, op=op, place=place, extra=extra, iteration=rec.iteration))
    if len(rec.pending) > _MAX_QUEUE:
        flush(rec)


def flush(rec: "NanRecorder", raising: bool = True) -> None:
    """Read every queued flag (one transfer per device) and turn flagged entries into events, in order."""
    pending, rec.pending = rec.pending, []
    if not pending:
        return
    for p, (bad, nan, neg) in zip(pending, read_all(pending)):
        if any(bad[: p.n_out]):
            event = _verdict(rec, p, bad, nan, neg)
            if event is not None:
                if not raising:
                    rec.raise_on_birth = False
                rec.add_event(event, [])


def _verdict(rec: "NanRecorder", p: Pending, bad: list[bool], nan: list[bool], neg: list[bool]) -> Optional[Any]:
    n = p.n_out
    in_bad, in_nan, out_nan = bad[n:], nan[n:], any(nan[:n])
    external = [float("nan") if a else float("-inf") if s else float("inf")
                for b, a, s, e in zip(in_bad, in_nan, neg[n:], p.external) if b and e]
    if p.extra.get("grad") and rec.has_events():
        return None  # module mode: a gradient made non-finite by an earlier birth
    if p.extra.get("module_mode") and any(e.module and e.module.startswith(p.extra["path"] + ".") for e in rec.events):
        return None  # a submodule already reported this one
    if not any(in_bad):
        verdict = "birth"
    elif external and not rec.has_events() and not is_mask(external, out_nan):
        verdict = "input"
    elif out_nan and not any(in_nan):
        verdict = "birth"  # NaN made from infinities
    else:
        return None
    kind = "nan" if out_nan else "inf"
    if rec.ignore_inf and kind == "inf":
        return None
    i = next(k for k in range(n) if bad[k])
    inputs = tuple(s.stats(a, b and not a) for s, a, b in zip(p.inputs, in_nan, in_bad))[:4]
    output = p.outputs[i].stats(nan[i], bad[i] and not nan[i])
    if p.phase == "backward" and "node" in p.extra:
        return make_event("backward", p.extra["node"], p.place, inputs, output, kind=kind, iteration=p.iteration,
                          aten_op=p.op, node_name=p.extra["node"], sequence_nr=p.extra["seq"],
                          forward_op=p.extra["fwd_op"], forward_module=p.place.module,
                          forward_lineno=p.place.lineno, deferred=True)
    phase = "input" if verdict == "input" else p.phase
    extra = {"aten_op": p.op, "sequence_nr": p.extra.get("seq")} if "seq" in p.extra else {}
    return make_event(phase, p.op, p.place, inputs, output, kind=kind, iteration=p.iteration, deferred=True, **extra)
