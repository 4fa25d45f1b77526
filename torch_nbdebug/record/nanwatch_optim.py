"""Optimizer births: a parameter that ``optimizer.step()`` turned non-finite, with its name and step.

Global optimizer step hooks (handle-based) bracket every step. After the step one max-abs norm
per parameter (``_foreach_norm``, NaN/Inf propagate through it) is read in one transfer; only
a flagged parameter is then looked at precisely.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Optional

import torch

from torch_nbdebug.errors import NanBirthError
from torch_nbdebug.record.modules import module_roots, parameter_names
from torch_nbdebug.record.nanwatch_ops import checkable
from torch_nbdebug.record.nanwatch_events import here, make_event
from torch_nbdebug.record.stats import summarize

if TYPE_CHECKING:  # pragma: no cover
    from torch_nbdebug.record.nanwatch import NanRecorder


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
            norms = torch._foreach_norm([params[k].detach() for k in indices], 2)
            values = torch.stack([n.float() for n in norms]).cpu().tolist()
            for k, v in zip(indices, values):
                flags[k] = not math.isfinite(v) and not bool(torch.isfinite(params[k]).all())
    return flags


class OptimizerWatch:
    """Pre/post step hooks; ``active`` is True while a step runs (its ops are not checked one by one)."""

    def __init__(self, recorder: "NanRecorder") -> None:
        self.recorder = recorder
        self.active = 0
        self.steps: dict[int, int] = {}
        self._known_bad: set[int] = set()
        self._names: Optional[dict[int, str]] = None

    def pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # No parameter scan before the step (it would double the cost): a parameter that was already
        # non-finite shows up in the forward as an "input" event, and its gradient is then non-finite.
        self.active += 1
        self.recorder.flush()
        self.recorder.suspend()

    def post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        try:
            self.steps[id(opt)] = self.steps.get(id(opt), 0) + 1
            entries = _params(opt)
            flags = bad_params([p for _, _, p in entries])
            for (g, i, p), bad in zip(entries, flags):
                if bad and id(p) not in self._known_bad:
                    self._known_bad.add(id(p))
                    self._birth(opt, g, i, p)
        except NanBirthError:
            raise
        except Exception as exc:  # noqa: BLE001 - a debugging aid must not break the user's step
            self.recorder.internal_error(f"{type(opt).__name__}.step", exc)
        finally:
            self.active -= 1
            self.recorder.resume()

    def _birth(self, opt: torch.optim.Optimizer, g: int, i: int, p: torch.Tensor) -> None:
        rec = self.recorder
        grad = p.grad
        if grad is None:
            return  # optimizers skip parameters without a gradient: it was non-finite before the step
        grad_stats = summarize(grad) if isinstance(grad, torch.Tensor) else None
        if grad_stats is not None and not grad_stats.finite and rec.has_events():
            return  # the gradient was already non-finite: reported where it was born
        name = self._name(p) or f"{type(opt).__name__}.param_groups[{g}]['params'][{i}]"
        module = name.rsplit(".", 1)[0] if "." in name and self._name(p) else None
        out = summarize(p)
        lr = opt.param_groups[g].get("lr")
        detail = f"lr={lr:.4g}" if isinstance(lr, (int, float)) else ""
        if grad_stats is not None:
            detail += (", " if detail else "") + ("gradient finite" if grad_stats.finite else "gradient non-finite")
        kind = "nan" if out.nan else "inf"
        if rec.ignore_inf and kind == "inf":
            return
        event = make_event("optimizer", f"{type(opt).__name__}.step", here(module, None),
                           (grad_stats,) if grad_stats is not None else (), out, kind=kind,
                           iteration=self.steps[id(opt)], param=name, detail=detail)
        rec.add_event(event, [])

    def _name(self, p: torch.Tensor) -> Optional[str]:
        if self._names is None or id(p) not in self._names:
            self._names = parameter_names(module_roots(self.recorder.namespace))
        return self._names.get(id(p))
