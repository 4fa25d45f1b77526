"""Record watched values and per-layer gradient figures at every (or every N-th) optimizer step.

Seen through torch's global optimizer step hooks (handle-based, removed in :meth:`MonitorRecorder.remove`).
The first optimizer that steps is the clock: its steps are counted, and at each recorded one

- before the step: every parameter's gradient norm in one batched kernel (``_foreach_norm``), summed
  into layers with one ``index_add_``, and a fixed strided sample of each parameter (at most
  ``_SAMPLE`` elements, the whole parameter when smaller), gathered by one ``cat`` of views;
- after the step: the same sample again, and per layer ‖Δw‖/‖w‖ from the two (``_foreach_norm``
  on the splits, each parameter weighted by its size over its sample size), then the watched
  expressions, evaluated in the user's namespace. A tensor value stays on its device.

The sample keeps the update ratio cheap on big models (a full copy of GPT-2's parameters each
step would cost more than the 5% this tool may take); its stride is coprime with the last
dimension, so every column of a weight matrix is sampled.

Nothing is copied to the host per step: rows are kept on the device and read in one transfer per
device when the live view asks (it is rate-limited: a few times per second at most), every ``_FLUSH`` steps, or at
the end. Values are copied (4 bytes each), so no tensor of the user's is kept alive.
"""
from __future__ import annotations

import math
import sys
import time
import types
import weakref
from collections import ChainMap
from typing import Any, Callable, Mapping, MutableMapping, Optional, Union, cast

import numpy as np
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from torch_nbdebug.data.monitor import MonitorHistory, Status
from torch_nbdebug.record import compat
from torch_nbdebug.record.interrupts import deferred_interrupts, no_grad_held
from torch_nbdebug.record.lifecycle import HookScope
from torch_nbdebug.record.modules import module_roots, parameter_names
from torch_nbdebug.record.source import UserNamespace, frame_locals, skipped_note

_FLUSH = 256          # rows kept on the device between host copies when no view asks sooner
_NO_GRAD = -1.0       # layer norm stored when no parameter of the layer had a gradient
_SAMPLE = 1024        # elements per parameter sampled for the update ratio


class Scope:
    """Where the watched expressions are evaluated: a namespace (the shell's) or a caller's frame,
    read afresh at every step so a variable rebound by the loop is seen. :meth:`release` drops it."""

    def __init__(self, namespace: Optional[Mapping[str, Any]] = None, frame: Optional[types.FrameType] = None) -> None:
        self._namespace, self._frame = namespace, frame

    def pair(self) -> tuple[dict[str, Any], Mapping[str, Any]]:
        """(globals, locals) for ``eval``."""
        if self._frame is not None:
            local = frame_locals(self._frame)
            return self._frame.f_globals, (local if local is not None else self._frame.f_globals)
        ns = self._namespace if self._namespace is not None else {}
        return (ns if isinstance(ns, dict) else {}), ns

    def names(self) -> UserNamespace:
        """The namespace as the naming helpers read it (modules → parameter names)."""
        if self._frame is not None:
            return UserNamespace(frame=self._frame)
        return UserNamespace(self._namespace or {})

    def release(self) -> None:
        self._namespace = self._frame = None


class _Layers:
    """The clock optimizer's parameters grouped into layers (the module owning each parameter)."""

    def __init__(self, opt: Any, scope: Scope, caller: Optional[types.FrameType]) -> None:
        self.params: list[torch.Tensor] = [p for g in opt.param_groups for p in g["params"]]
        names: dict[int, str] = {}
        skipped: dict[str, None] = {}
        views = [UserNamespace(frame=caller)] if caller is not None else []
        for view in views + [scope.names()]:  # where step() is called (train(model, ...)), then the scope
            try:
                for key, name in parameter_names(module_roots(view)).items():
                    names.setdefault(key, name)
                skipped.update(dict.fromkeys(view.skipped))
            finally:
                view.release()
        self.skipped = tuple(skipped)  # what could not be inspected while naming the layers
        slots = [(gi, k) for gi, g in enumerate(opt.param_groups) for k in range(len(g["params"]))]
        layer_names: list[str] = []
        index: list[int] = []
        for p, (gi, k) in zip(self.params, slots):
            named = names.get(id(p))  # a parameter of no module in sight is a layer of its own
            layer = named.rsplit(".", 1)[0] if named else f"{type(opt).__name__}.param_groups[{gi}][{k}]"
            if layer not in layer_names:
                layer_names.append(layer)
            index.append(layer_names.index(layer))
        self.names = tuple(layer_names)
        self.index = index
        self.strides = [_stride(p) for p in self.params]
        self._consts: dict[tuple[tuple[int, ...], str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._scales: dict[tuple[tuple[int, ...], str], torch.Tensor] = {}

    def count(self, opt: Any) -> int:
        return sum(len(g["params"]) for g in opt.param_groups)

    def consts(self, present: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(layer of each present parameter, which layers have one) on ``device``, built once."""
        key = (present, str(device))
        if key not in self._consts:
            seg = torch.tensor([self.index[i] for i in present], device=device)
            has = torch.zeros(len(self.names), device=device).index_add_(0, seg, torch.ones(len(present), device=device)) > 0
            self._consts[key] = (seg, has)
        return self._consts[key]

    def sample(self, present: tuple[int, ...]) -> list[torch.Tensor]:
        """The sampled elements of each present parameter, as views (no copy until they are joined)."""
        return [self.params[i].detach().reshape(-1)[::self.strides[i]] for i in present]

    def scale(self, present: tuple[int, ...], sizes: list[int], device: torch.device) -> torch.Tensor:
        """Per parameter: its number of elements over its sample size (squared norms scale by it)."""
        key = (present, str(device))
        if key not in self._scales:
            self._scales[key] = torch.tensor([self.params[i].numel() / n for i, n in zip(present, sizes)],
                                             device=device)
        return self._scales[key]


def _stride(p: torch.Tensor) -> int:
    """Every how many elements to sample ``p``: 1 when small, else about numel / _SAMPLE, made
    coprime with the last dimension so the sample is not stuck in a few columns."""
    n = p.numel()
    if n <= _SAMPLE:
        return 1
    step, last = n // _SAMPLE, p.shape[-1] if p.dim() else 1
    while math.gcd(step, last) != 1:
        step += 1
    return step


class MonitorRecorder:
    """Context manager recording one row per recorded optimizer step of the clock optimizer.

    ``codes`` are compiled expressions (evaluated in ``scope``) or callables taking no argument.
    """

    def __init__(self, expressions: tuple[str, ...], codes: tuple[Union[types.CodeType, Callable[[], Any]], ...],
                 scope: Scope, *,
                 every: int = 1, layers: bool = True, ratio: bool = True,
                 on_step: Optional[Callable[[], None]] = None) -> None:
        self.expressions, self._codes, self._scope = expressions, codes, scope
        self.every, self.layers_on, self.ratio_on = every, layers, ratio
        self.on_step = on_step  # called after each recorded step (the live view's rate-limited tick)
        self._hooks = HookScope()
        self._clock: Optional[weakref.ref[Any]] = None
        self._others: dict[str, None] = {}
        self._layers: Optional[_Layers] = None
        self._step = -1  # the clock's step now: numbered by the steps completed before it, from 0 (as %%grads)
        self._row: Optional[dict[str, Any]] = None     # the step between its pre and post hooks
        self._pending: list[dict[str, Any]] = []
        self._host = {"steps": _Rows(1, 0, np.int64), "times": _Rows(1, math.nan, np.float64),
                      "values": _Rows(len(expressions), math.nan, np.float64),
                      "norm": _Rows(0, _NO_GRAD, np.float32), "ratio": _Rows(0, math.nan, np.float32)}
        self.errors: dict[str, str] = {}
        self.notes: list[str] = []
        self._t0 = 0.0

    # -- install / remove -------------------------------------------------------------------
    def __enter__(self) -> "MonitorRecorder":
        self._t0 = time.monotonic()
        self._hooks.open(self._install)
        return self

    def _install(self, scope: HookScope) -> None:
        scope.hook(register_optimizer_step_pre_hook(self._pre_hook))
        scope.hook(register_optimizer_step_post_hook(self._post_hook))

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def remove(self) -> None:
        """Take off both hooks (a Stop meanwhile is raised once both are off); safe to call again."""
        try:
            self._hooks.close()
        finally:
            self._row = None  # the parameter copy of an interrupted step

    def _fail(self, exc: BaseException) -> None:
        """A recorder bug must never break the user's training: stop recording and say why."""
        self.notes.append(f"recording stopped at step {self._step}: {type(exc).__name__}: {exc}")
        self.remove()

    # -- hooks -------------------------------------------------------------------------------
    def _is_clock(self, opt: Any) -> bool:
        if self._clock is None:
            self._clock = weakref.ref(opt)  # no callback: see record/interrupts.py
        if self._clock() is opt:
            return True
        self._others.setdefault(type(opt).__name__)
        return False

    def _pre_hook(self, opt: Any, args: Any, kwargs: Any) -> None:
        if not self._is_clock(opt):
            return
        self._step += 1
        if self._step % self.every:
            return
        try:
            with no_grad_held():
                self._row = self._before_step(opt)
        except Exception as exc:  # noqa: BLE001 - see _fail
            self._fail(exc)

    def _post_hook(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self._clock is None or self._clock() is not opt or self._row is None:
            return
        row, self._row = self._row, None
        try:
            with no_grad_held():
                self._after_step(row)
        except Exception as exc:  # noqa: BLE001 - see _fail
            return self._fail(exc)
        row["values"] = self._evaluate()  # the user's code: its Stop propagates, its errors are noted
        self._pending.append(row)
        self._maybe_flush()

    # -- one step ----------------------------------------------------------------------------
    def _before_step(self, opt: Any) -> dict[str, Any]:
        row: dict[str, Any] = {"step": self._step, "time": time.monotonic() - self._t0}
        if not self.layers_on:
            return row
        if self._layers is None or self._layers.count(opt) != len(self._layers.params):
            caller = _step_caller()
            self._layers = _Layers(opt, self._scope, caller)
            del caller
            if self._layers.skipped and not any(n.startswith("skipped") for n in self.notes):
                self.notes.append(skipped_note(self._layers.skipped))
        layers = self._layers
        present = tuple(i for i, p in enumerate(layers.params) if p.grad is not None)
        if not present:
            return row
        grads = [g for i in present if (g := layers.params[i].grad) is not None]  # all of them: see present
        weights = [layers.params[i] for i in present]
        dev = grads[0].device
        seg, has = layers.consts(present, dev)
        row["norm"] = _per_layer(_norms(grads, dev), seg, has)
        if self.ratio_on and all(p.device == dev for p in weights):
            parts = layers.sample(present)
            row["before"], row["sizes"] = torch.cat(parts), [t.numel() for t in parts]
            row["present"], row["seg"], row["has"] = present, seg, has
        return row

    def _after_step(self, row: dict[str, Any]) -> None:
        before = row.pop("before", None)
        if before is None or self._layers is None:
            return
        present, sizes = row.pop("present"), row.pop("sizes")
        after = torch.cat(self._layers.sample(present))
        scale = self._layers.scale(present, sizes, before.device)
        seg, has = row.pop("seg"), row.pop("has")
        # one batched norm for the moves and the sizes, one segment sum for both
        both = _norms(list(torch.split(after.sub_(before), sizes)) + list(torch.split(before, sizes)), before.device)
        both = both.square().view(2, -1) * scale
        sums = torch.zeros(2, has.shape[0], device=both.device).index_add_(1, seg, both).sqrt()
        row["ratio"] = torch.where(has, sums[0] / sums[1], torch.full_like(sums[0], math.nan))

    def _evaluate(self) -> list[Any]:
        """Each watched expression now: a float, a copied one-element tensor, or NaN (error noted).

        Names are looked up where ``optimizer.step()`` was called first (the locals of a ``train()``
        function hold its ``loss``), then in the scope (the cell's namespace, the ``with`` block's)."""
        glob, local = self._scope.pair()
        frame = _step_caller()
        if frame is not None:
            inner = [m for m in (frame_locals(frame), frame.f_globals) if m is not None and m is not glob]
            # (ChainMap is typed for mutable maps; it is only read here)
            local = ChainMap(*inner, cast("MutableMapping[str, Any]", local)) if inner else local
        del frame
        out: list[Any] = []
        for expression, code in zip(self.expressions, self._codes):
            try:
                value = _number(eval(code, glob, local) if isinstance(code, types.CodeType) else code())
            except Exception as exc:  # noqa: BLE001 - the user's expression: note it, keep recording
                self.errors.setdefault(expression, f"step {self._step}: {type(exc).__name__}: {exc}")
                value = math.nan
            out.append(value)
        del glob, local
        return out

    # -- host copies -------------------------------------------------------------------------
    def _maybe_flush(self) -> None:
        if len(self._pending) >= _FLUSH:
            self._flush()
        if self.on_step is not None:
            self.on_step()  # rate-limited by the view; it reads history() when an update is due

    def _flush(self) -> None:
        """One device-to-host copy per device for all pending rows."""
        rows, self._pending = self._pending, []
        if not rows:
            return
        host = self._host
        host["steps"].extend(np.array([[r["step"]] for r in rows], np.int64))
        host["times"].extend(np.array([[r["time"]] for r in rows], np.float64))
        host["values"].extend(_host_values([r["values"] for r in rows], len(self.expressions)))
        width = len(self._layers.names) if self._layers is not None else 0
        host["norm"].extend(_host_rows([r.get("norm") for r in rows], width, _NO_GRAD))
        host["ratio"].extend(_host_rows([r.get("ratio") for r in rows], width, math.nan))

    def history(self, status: Status) -> MonitorHistory:
        """Everything recorded so far (flushes what is pending). The arrays are read-only views of
        rows that are never written again, so a snapshot while running costs no copy."""
        self._flush()
        host = self._host
        layers = self._layers.names if self._layers is not None and self.layers_on else ()
        notes = list(self.notes)
        if self._others:
            notes.append(f"only the first optimizer that stepped is monitored; {', '.join(self._others)} "
                         f"also stepped (use a separate %%monitor for it)")
        return MonitorHistory(
            self.expressions, host["steps"].view(1)[:, 0], host["times"].view(1)[:, 0],
            host["values"].view(len(self.expressions)), layers,
            host["norm"].view(len(layers)), host["ratio"].view(len(layers)),
            dict(self.errors), status, self.every, tuple(notes))

    def finish(self, status: Status) -> MonitorHistory:
        self.remove()
        try:
            return self.history(status)
        finally:
            self._scope.release()


# -- helpers ---------------------------------------------------------------------------------
def _step_caller() -> Optional[types.FrameType]:
    """The frame that called ``optimizer.step()``: the first one out of torch (the optimizer's and an
    lr scheduler's wrappers, a GradScaler) and out of this package."""
    frame: Optional[types.FrameType] = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__")
        if not (isinstance(name, str) and (name in ("torch", "torch_nbdebug") or name.startswith(("torch.", "torch_nbdebug.")))):
            return frame
        frame = frame.f_back
    return None


def _number(value: Any) -> Any:
    """A watched value as a float, or a float32 copy of a one-element tensor (left on its device)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"it is a tensor of shape {tuple(value.shape)}, not one number: watch e.g. its "
                            f".mean() or .norm()")
        if value.is_complex() or compat.is_fake(value) or value.device.type == "meta":
            raise TypeError(f"a {value.dtype} tensor on {value.device.type} has no real value to plot")
        return value.detach().reshape(()).to(torch.float32, copy=True)
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise TypeError(f"it is a {type(value).__name__}, not a number")
    return float(value)


def _norms(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    norms = compat.foreach_norm(tensors, dtype=torch.float32)
    try:
        return torch.stack(norms)
    except RuntimeError:  # parameters on several devices: gather the norms on the first one
        return torch.stack([n.to(device) for n in norms])


def _per_layer(norms: torch.Tensor, seg: torch.Tensor, has: torch.Tensor) -> torch.Tensor:
    squares = torch.zeros(has.shape[0], device=norms.device).index_add_(0, seg, norms.square())
    return torch.where(has, squares.sqrt(), torch.full_like(squares, _NO_GRAD))


def _host_values(rows: list[list[Any]], width: int) -> np.ndarray:
    out = np.full((len(rows), width), np.nan)
    by_device: dict[torch.device, list[tuple[int, int, torch.Tensor]]] = {}
    for r, row in enumerate(rows):
        for c, value in enumerate(row):
            if isinstance(value, torch.Tensor):
                by_device.setdefault(value.device, []).append((r, c, value))
            else:
                out[r, c] = value
    for items in by_device.values():
        copied = torch.stack([t for _, _, t in items]).cpu().numpy()
        for (r, c, _), value in zip(items, copied):
            out[r, c] = value
    return out


def _host_rows(rows: list[Optional[torch.Tensor]], width: int, fill: float) -> np.ndarray:
    out = np.full((len(rows), width), fill, np.float32)
    live = [(k, r) for k, r in enumerate(rows) if r is not None]
    if live:
        dev = live[0][1].device
        padded = [torch.cat([r.to(dev), torch.full((width - len(r),), fill, device=dev)]) if len(r) < width
                  else r.to(dev) for _, r in live]
        out[[k for k, _ in live]] = torch.stack(padded).cpu().numpy()
    return out


class _Rows:
    """Rows appended in blocks to a buffer that doubles when full (amortised O(1) per row); a
    new layer widens it. Rows once written never change, so views of them stay valid."""

    def __init__(self, width: int, fill: float, dtype: Any) -> None:
        self.fill, self.n = fill, 0
        self.data = np.full((64, width), fill, dtype)

    def extend(self, block: np.ndarray) -> None:
        k, width = block.shape
        rows, cols = self.data.shape
        if self.n + k > rows or width > cols:
            grown = np.full((max(rows, 2 * (self.n + k)), max(width, cols)), self.fill, self.data.dtype)
            grown[:self.n, :cols] = self.data[:self.n]
            self.data = grown
        self.data[self.n:self.n + k, :width] = block
        self.n += k

    def view(self, width: int) -> np.ndarray:
        """The rows so far, ``width`` columns (padded with the fill value when the buffer is narrower)."""
        rows = self.data[:self.n, :width]
        if rows.shape[1] < width:
            return np.pad(rows, ((0, 0), (0, width - rows.shape[1])), constant_values=self.fill)
        return rows
