"""Optimizer births: a parameter that ``optimizer.step()`` turned non-finite, with its name and step.

Global optimizer step hooks (handle-based) bracket every step. After the step one L2 norm per
parameter (``_foreach_norm``, NaN/Inf propagate through it) is taken; only a flagged parameter is then
looked at precisely. The immediate path reads the norms at once; the deferred one queues them, with
what the step was (a :class:`StepRecord`), and judges them when the next forward's checks are read:
one host synchronisation per training step, and the step's line, settings and gradients as they were.
"""
from __future__ import annotations

import functools
import math
import threading
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

import torch

from torch_nbdebug.data.nanwatch import Kind
from torch_nbdebug.errors import NanBirthError
from torch_nbdebug.record import compat
from torch_nbdebug.record.modules import module_roots, parameter_names
from torch_nbdebug.record.nanwatch.context import WatchContext
from torch_nbdebug.record.nanwatch.core.ops import any_nonfinite, checkable, propagating_sum
from torch_nbdebug.record.nanwatch.core.events import Place, Shape, here, make_event
from torch_nbdebug.record.nanwatch.core.live import LiveRef
from torch_nbdebug.data.stats import TensorStats
from torch_nbdebug.record.stats import summarize

if TYPE_CHECKING:  # pragma: no cover
    from torch_nbdebug.record.nanwatch.checks.deferred import DeferredChecks

GRAD_GONE = ("the gradient was freed (zero_grad) before the deferred check was read: only whether it was "
             "finite is known")
LR_GROWTH = 100.0  # a learning rate this many times its first value in the watch "grew" (not a warmup step)


def _params(opt: torch.optim.Optimizer) -> list[tuple[int, int, torch.Tensor]]:
    return [(g, i, p) for g, group in enumerate(opt.param_groups) for i, p in enumerate(group["params"])
            if isinstance(p, torch.Tensor) and checkable(p) and p.numel() > 0]


def norm_groups(params: list[torch.Tensor]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """One foreach L2 norm per (device, dtype) group, left on the device: (indices, norms) per group.

    The L2 norm propagates NaN/Inf and is ~20x faster on CPU than the max-abs norm; a norm that
    overflowed on huge finite values is caught by the precise confirmation in :func:`flagged`.
    """
    groups = _by_device_and_dtype(params)
    with torch.no_grad():  # (no graph: the parameters need no detach)
        norms = [torch.stack(compat.foreach_norm([params[k] for k in indices], 2)) for indices in groups]
    return groups, norms


def _by_device_and_dtype(params: list[torch.Tensor]) -> list[list[int]]:
    """The indices of ``params`` grouped by (device, dtype), in first-seen order; the usual single
    group is found without building the groups."""
    first = params[0] if params else None
    if first is not None and all(p.dtype == first.dtype and p.device == first.device for p in params):
        return [list(range(len(params)))]
    groups: dict[tuple[Any, Any], list[int]] = {}
    for k, p in enumerate(params):
        groups.setdefault((p.device, p.dtype), []).append(k)
    return list(groups.values())


_SMALL = 1 << 16  # elements of a 1-D tensor that finite_total copies into its one sum


def finite_total(tensors: list[torch.Tensor]) -> Optional[torch.Tensor]:
    """A 0-d tensor, not read, that is finite only when every tensor of ``tensors`` is (NaN/Inf propagate
    through sums and norms; a total that overflowed on finite values is judged again by the caller, tensor by
    tensor): the 1-D tensors (biases, a norm layer's weights: most of a model's parameters, each a few
    hundred values; at most :data:`_SMALL` elements each, so a flat shard is never copied) concatenated and
    summed in one kernel, the others' L2 norms in one foreach kernel (it
    costs ~2 us a tensor on CPU, as much as reading a small tensor's values). None when the tensors are not
    of one device and dtype (the caller reads a norm per group, :func:`norm_groups`)."""
    if not tensors or len(_by_device_and_dtype(tensors)) != 1:
        return None
    flat = [t for t in tensors if t.dim() == 1 and t.numel() <= _SMALL]
    rest = [t for t in tensors if t.dim() != 1 or t.numel() > _SMALL] if flat else tensors
    with torch.no_grad():  # (no graph: the parameters need no detach)
        parts = [propagating_sum(torch.cat(flat))] if flat else []  # (half types summed in float32)
        if rest:
            parts.append(propagating_sum(torch.stack(compat.foreach_norm(rest, 2))))
    return parts[0] if len(parts) == 1 else parts[0] + parts[1]


def nonfinite_norms(tensors: list[torch.Tensor]) -> Optional[list[float]]:
    """None when every tensor of ``tensors`` is finite (the usual case: one batched check, one value read,
    :func:`finite_total`); else each tensor's L2 norm, in order (NaN/Inf where it is not finite)."""
    total = finite_total(tensors)
    if total is not None and math.isfinite(float(total)):
        return None
    groups, norms = norm_groups(tensors)
    return by_tensor(groups, [v for n in norms for v in n.tolist()])


def by_tensor(groups: list[list[int]], values: list[float]) -> list[float]:
    """The norms read for :func:`norm_groups` (concatenated in group order), back in tensor order."""
    if len(groups) == 1 and groups[0] == list(range(len(values))):  # the usual single group: in order
        return list(values)
    found = [0.0] * sum(len(indices) for indices in groups)
    flat = iter(values)
    for indices in groups:
        for k in indices:
            found[k] = next(flat)
    return found


class StepRecord(NamedTuple):
    """One optimizer step as its post hook saw it, judged when its norms are read (maybe later):
    the parameters, their gradients (weakly, with versions: exact statistics if still unchanged),
    each group's ``(lr, eps)`` and the user's line."""

    optimizer: str
    key: int
    step: int
    entries: list[tuple[int, int, torch.Tensor]]
    # (weak reference with version, has a norm) per entry, None where there is no gradient; None when judged at once
    grads: Optional[list[Optional[tuple[LiveRef, bool]]]]
    settings: list[tuple[Any, Any]]
    place: Optional[Place]  # None when judged at once: the line is then read only for a birth


class LearningRates:
    """The learning rate of each optimizer group at its first step in the watch, and the latest one."""

    def __init__(self) -> None:
        self._first: dict[tuple[int, int], float] = {}
        self._grown: Optional[tuple[float, int]] = None

    def stepped(self, key: int, lrs: list[Any], step: int) -> None:
        """Optimizer ``key`` made its step number ``step`` with each group's learning rate ``lrs``."""
        for g, lr in enumerate(lrs):
            if not isinstance(lr, (int, float)) or lr <= 0:
                continue
            first = self._first.setdefault((key, g), float(lr))
            if lr >= LR_GROWTH * first:
                self._grown = (float(lr), step)

    def growth(self) -> Optional[tuple[float, int]]:
        """(learning rate, step) of the last step whose learning rate had grown LR_GROWTH-fold."""
        return self._grown


class OptimizerWatch:
    """Pre/post step hooks; ``active`` is True while a step runs (its ops are not checked one by one).

    ``suspend``/``resume`` take the recorder's dispatch mode off the stack around the step."""

    def __init__(self, ctx: WatchContext, lrs: LearningRates, suspend: Callable[[], None],
                 resume: Callable[[], None], deferred: Optional["DeferredChecks"] = None) -> None:
        self.ctx, self.lrs, self.deferred = ctx, lrs, deferred
        self._suspend, self._resume = suspend, resume
        self.active = 0
        self.steps: dict[int, int] = {}
        self._known_bad: set[int] = set()
        self._names: Optional[dict[int, str]] = None
        self._thread = threading.get_ident()

    def pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # No parameter scan before the step (it would double the cost): a parameter that was already
        # non-finite shows up in the forward as an "input" event, and its gradient is then non-finite.
        if threading.get_ident() != self._thread:
            return  # the hooks are global: another thread's optimizer (its own watch) is not ours
        self.active += 1
        self._suspend()

    def post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        self.ctx.clock.stepped()
        try:
            self.steps[id(opt)] = self.steps.get(id(opt), 0) + 1
            if self.deferred is None:
                self._judge_now(opt)
                return
            record = self._record(opt, deferred=True)
            params = [p for _, _, p in record.entries]
            # The gradients' norms too: they may be gone (zero_grad) when the norms are read.
            grads = [g[0].alive() for g in record.grads or () if g is not None and g[1]]
            groups, norms = norm_groups(params + grads)  # type: ignore[operator]
            if self.deferred is not None and len({n.device for n in norms}) == 1:
                self.deferred.queue_step(torch.cat(norms), functools.partial(self._judge, record, groups))
            else:  # parameters on several devices: read now (one transfer per device)
                self._judge(record, groups, [v for vs in self.ctx.flush(norms) for v in vs])
        except NanBirthError:
            raise
        except Exception as exc:  # noqa: BLE001 - a debugging aid must not break the user's step
            self.ctx.internal_error(f"{type(opt).__name__}.step", exc)
        finally:
            self.active -= 1
            self._resume()

    def _judge_now(self, opt: torch.optim.Optimizer) -> None:
        """The immediate path: the step's parameters checked at once. The usual step reads one value
        (:func:`finite_total`); only a non-finite one reads each parameter's norm."""
        entries = _params(opt)
        params = [p for _, _, p in entries]
        total = finite_total(params)
        if total is not None:
            read = self.ctx.flush([total])
            if read and math.isfinite(read[0][0]):
                self.lrs.stepped(id(opt), [group.get("lr") for group in opt.param_groups], self.steps[id(opt)])
                return
        groups, norms = norm_groups(params)
        values = [v for vs in (self.ctx.flush(norms) if total is None else [n.tolist() for n in norms]) for v in vs]
        self._judge(self._record(opt, deferred=False, entries=entries), groups, values)

    def _record(self, opt: torch.optim.Optimizer, deferred: bool,
                entries: Optional[list[tuple[int, int, torch.Tensor]]] = None) -> StepRecord:
        entries = _params(opt) if entries is None else entries
        grads: Optional[list[Optional[tuple[LiveRef, bool]]]] = None
        if deferred:
            grads = [_live(p.grad) for _, _, p in entries]
        settings = [(group.get("lr"), group.get("eps")) for group in opt.param_groups]
        return StepRecord(type(opt).__name__, id(opt), self.steps[id(opt)], entries, grads, settings,
                          here(None, None) if deferred else None)

    def _judge(self, record: StepRecord, groups: list[list[int]], values: list[float]) -> None:
        """The step's norms are read: learning rates first (the order of events), then each
        non-finite parameter, confirmed, is a birth unless known already."""
        self.lrs.stepped(record.key, [lr for lr, _ in record.settings], record.step)
        norms = by_tensor(groups, values)
        if all(map(math.isfinite, norms[:len(record.entries)])):
            return  # the usual step: every parameter finite (the loop below looks only at the others)
        grad_norms = iter(norms[len(record.entries):])
        for k, (g, i, p) in enumerate(record.entries):
            grad, grad_norm = None, None
            if record.grads is not None:  # each gradient's norm follows the parameters', in order
                grad = record.grads[k]
                grad_norm = next(grad_norms) if grad is not None and grad[1] else None
            if math.isfinite(norms[k]) or id(p) in self._known_bad or not any_nonfinite(p):
                continue
            self._known_bad.add(id(p))
            if record.grads is None:
                grad = _live(p.grad)
            if grad is not None:  # optimizers skip parameters without a gradient: it was non-finite before
                self._birth(record, g, i, p, _grad_stats(p, grad, grad_norm))

    def _birth(self, record: StepRecord, g: int, i: int, p: torch.Tensor, grad_stats: TensorStats) -> None:
        ctx = self.ctx
        if not grad_stats.finite and ctx.log.has_events():
            return  # the gradient was already non-finite: reported where it was born
        name = self._name(p) or f"{record.optimizer}.param_groups[{g}]['params'][{i}]"
        module = name.rsplit(".", 1)[0] if "." in name and self._name(p) else None
        out = summarize(p)
        lr, eps = (_number(v) for v in record.settings[g])
        detail = f"lr={lr:.4g}" if lr is not None else ""
        detail += (", " if detail else "") + ("gradient finite" if grad_stats.finite else "gradient non-finite")
        kind: Kind = "nan" if out.nan else "inf"
        if ctx.options.ignore_inf and kind == "inf":
            return
        grown = self.lrs.growth()
        place = record.place or here(None, None)  # (judged at once: still in the step's post hook)
        event = make_event("optimizer", f"{record.optimizer}.step", place._replace(module=module),
                           (grad_stats,), out, kind=kind, iteration=record.step, param=name, param_kind="parameter",
                           detail=detail, lr=lr, lr_step=grown[1] if grown is not None else None, eps=eps,
                           grad_finite=grad_stats.finite)
        ctx.log.add(event)

    def _name(self, p: torch.Tensor) -> Optional[str]:
        if self._names is None or id(p) not in self._names:
            self._names = parameter_names(module_roots(self.ctx.namespace))
        return self._names.get(id(p))


def _live(grad: Any) -> Optional[tuple[LiveRef, bool]]:
    """A gradient as a :class:`StepRecord` keeps it: weakly, with its version, and whether it gets a
    norm (a sparse gradient does not: its statistics are exact or, once it is freed, unknown)."""
    if not isinstance(grad, torch.Tensor):
        return None
    return LiveRef(grad), checkable(grad) and grad.numel() > 0


def _grad_stats(p: torch.Tensor, grad: tuple[LiveRef, bool], norm: Optional[float]) -> TensorStats:
    """The gradient's exact statistics while it is alive and unchanged, else what its norm says (a
    gradient has its parameter's shape): the deferred path reads a step's norms with the next forward's
    checks, and ``zero_grad`` has freed the gradient by then."""
    t = grad[0].get() if norm is not None else grad[0].alive()
    if t is not None:
        return summarize(t)
    nan = norm is not None and norm != norm
    inf = norm is not None and not nan and not math.isfinite(norm)
    shape = Shape.of(p)
    return TensorStats(shape=shape.shape, dtype=shape.dtype, device=shape.device, numel=shape.numel,
                       nan=int(nan), inf=int(inf), note=GRAD_GONE)


def _number(value: Any) -> Optional[float]:
    """A group's lr/eps as a float (a tensor lr is read once: this runs only for a birth)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
