"""Optimizer births: a parameter that ``optimizer.step()`` turned non-finite, with its name and step.

Global optimizer step hooks (handle-based) bracket every step. After the step one max-abs norm
per parameter (``_foreach_norm``, NaN/Inf propagate through it) is read in one transfer; only
a flagged parameter is then looked at precisely.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Callable, Optional

import torch

from torch_nbdebug.errors import NanBirthError
from torch_nbdebug.record import compat
from torch_nbdebug.record.modules import module_roots, parameter_names
from torch_nbdebug.record.nanwatch_context import WatchContext
from torch_nbdebug.record.nanwatch_ops import checkable
from torch_nbdebug.record.nanwatch_events import here, make_event
from torch_nbdebug.record.stats import summarize

LR_GROWTH = 100.0  # a learning rate this many times its first value in the watch "grew" (not a warmup step)


def _params(opt: torch.optim.Optimizer) -> list[tuple[int, int, torch.Tensor]]:
    return [(g, i, p) for g, group in enumerate(opt.param_groups) for i, p in enumerate(group["params"])
            if isinstance(p, torch.Tensor) and checkable(p) and p.numel() > 0]


def bad_params(params: list[torch.Tensor]) -> list[bool]:
    """Which parameters hold a NaN/Inf: one foreach L2 norm per (device, dtype) group, one read each.

    The L2 norm propagates NaN/Inf and is ~20x faster on CPU than the max-abs norm; a norm that
    overflowed on huge finite values is caught by the precise confirmation.
    """
    groups: dict[tuple[Any, Any], list[int]] = {}
    for k, p in enumerate(params):
        groups.setdefault((p.device, p.dtype), []).append(k)
    flags = [False] * len(params)
    for indices in groups.values():
        with torch.no_grad():
            norms = compat.foreach_norm([params[k].detach() for k in indices], 2)
            values = torch.stack([n.float() for n in norms]).cpu().tolist()
            for k, v in zip(indices, values):
                flags[k] = not math.isfinite(v) and not bool(torch.isfinite(params[k]).all())
    return flags


class LearningRates:
    """The learning rate of each optimizer group at its first step in the watch, and the latest one."""

    def __init__(self) -> None:
        self._first: dict[tuple[int, int], float] = {}
        self._grown: Optional[tuple[float, int]] = None

    def stepped(self, opt: torch.optim.Optimizer, step: int) -> None:
        for g, group in enumerate(opt.param_groups):
            lr = group.get("lr")
            if not isinstance(lr, (int, float)) or lr <= 0:
                continue
            first = self._first.setdefault((id(opt), g), float(lr))
            if lr >= LR_GROWTH * first:
                self._grown = (float(lr), step)

    def growth(self) -> Optional[tuple[float, int]]:
        """(learning rate, step) of the last step whose learning rate had grown LR_GROWTH-fold."""
        return self._grown


class OptimizerWatch:
    """Pre/post step hooks; ``active`` is True while a step runs (its ops are not checked one by one).

    ``suspend``/``resume`` take the recorder's dispatch mode off the stack around the step."""

    def __init__(self, ctx: WatchContext, lrs: LearningRates, suspend: Callable[[], None],
                 resume: Callable[[], None]) -> None:
        self.ctx, self.lrs = ctx, lrs
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
        self.ctx.flush()
        self._suspend()

    def post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if threading.get_ident() != self._thread:
            return
        try:
            self.steps[id(opt)] = self.steps.get(id(opt), 0) + 1
            self.lrs.stepped(opt, self.steps[id(opt)])
            entries = _params(opt)
            flags = bad_params([p for _, _, p in entries])
            for (g, i, p), bad in zip(entries, flags):
                if bad and id(p) not in self._known_bad:
                    self._known_bad.add(id(p))
                    self._birth(opt, g, i, p)
        except NanBirthError:
            raise
        except Exception as exc:  # noqa: BLE001 - a debugging aid must not break the user's step
            self.ctx.internal_error(f"{type(opt).__name__}.step", exc)
        finally:
            self.active -= 1
            self._resume()

    def _birth(self, opt: torch.optim.Optimizer, g: int, i: int, p: torch.Tensor) -> None:
        ctx = self.ctx
        grad = p.grad
        if grad is None:
            return  # optimizers skip parameters without a gradient: it was non-finite before the step
        grad_stats = summarize(grad) if isinstance(grad, torch.Tensor) else None
        if grad_stats is not None and not grad_stats.finite and ctx.log.has_events():
            return  # the gradient was already non-finite: reported where it was born
        name = self._name(p) or f"{type(opt).__name__}.param_groups[{g}]['params'][{i}]"
        module = name.rsplit(".", 1)[0] if "." in name and self._name(p) else None
        out = summarize(p)
        group = opt.param_groups[g]
        lr, eps = _number(group.get("lr")), _number(group.get("eps"))
        detail = f"lr={lr:.4g}" if lr is not None else ""
        if grad_stats is not None:
            detail += (", " if detail else "") + ("gradient finite" if grad_stats.finite else "gradient non-finite")
        kind = "nan" if out.nan else "inf"
        if ctx.options.ignore_inf and kind == "inf":
            return
        grown = self.lrs.growth()
        event = make_event("optimizer", f"{type(opt).__name__}.step", here(module, None),
                           (grad_stats,) if grad_stats is not None else (), out, kind=kind,
                           iteration=self.steps[id(opt)], param=name, param_kind="parameter", detail=detail, lr=lr,
                           lr_step=grown[1] if grown is not None else None, eps=eps,
                           grad_finite=grad_stats.finite if grad_stats is not None else None)
        ctx.log.add(event)

    def _name(self, p: torch.Tensor) -> Optional[str]:
        if self._names is None or id(p) not in self._names:
            self._names = parameter_names(module_roots(self.ctx.namespace))
        return self._names.get(id(p))


def _number(value: Any) -> Optional[float]:
    """A group's lr/eps as a float (a tensor lr is read once: this runs only for a birth)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value.item())
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
