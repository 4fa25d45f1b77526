"""Record per-parameter gradient statistics of one model: a snapshot, or every step of a loop.

Speed matters more than anything here (a recorder that slows training by 50% is not used), so a
recorded step launches a fixed handful of batched ops and never synchronises with the host:

- exact per parameter: L2 norm (``_foreach_norm``), min/max (``aminmax``: one vectorised pass on
  CPU, unlike the inf-norm), sum (mean/std follow from norm and sum), and the parameter's norm;
- from a fixed random sample of at most ``sample`` elements per parameter, gathered into one flat
  tensor: the histogram (one ``index_add_`` for all parameters), mean |g|, zero/NaN/Inf fractions and
  the update ratio ‖Δw‖/‖w‖ (the sample of w is taken before and after ``optimizer.step()``).
  Parameters with at most ``sample`` elements are sampled whole, so their values are exact.

Results stay on the device and are copied to the host every ``_FLUSH`` steps in one transfer. The
last step is recomputed exactly at exit when its gradients are still there (``exact_last``).
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Optional

import numpy as np
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from torch_nbdebug.data.grads import ACT_FIELDS, FIELD, FIELDS, GradTrace, LayerInfo, ParamInfo
from torch_nbdebug.record import compat
from torch_nbdebug.record.grads_stats import RAW, Sampler, activation_row, exact_rows, raw_to_stats, sampled_rows, usable
from torch_nbdebug.record.interrupts import WeakIdMap, deferred_interrupts

# Forward order learnt by a recording, reused by later snapshots of the same model (weak: never
# keeps the model alive, and runs no callback when it dies: see record/interrupts.py).
_FORWARD_ORDER: "WeakIdMap[nn.Module, tuple[str, ...]]" = WeakIdMap()
_FLUSH = 64          # steps kept on the device between host copies
_MAX_HISTS = 256     # histogram rows kept; beyond, every other one is dropped (bounded memory)


def layers_of(model: nn.Module, name: str, order: Optional[tuple[str, ...]] = None
              ) -> tuple[list[tuple[str, nn.Module]], list[nn.Parameter], tuple[LayerInfo, ...], tuple[ParamInfo, ...], str]:
    """Modules owning parameters directly, in ``order`` (sub-names) then registration order.

    A parameter shared by two modules (tied embeddings) belongs to the first module that lists it.
    """
    model = compat.original_module(model)  # a torch.compile'd model: the user's names, not _orig_mod.*
    order = order if order is not None else _FORWARD_ORDER.get(model)
    modules = [(sub, m) for sub, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
    if order:
        rank = {sub: i for i, sub in enumerate(order)}
        modules.sort(key=lambda sm: rank.get(sm[0], len(rank)))  # stable: unseen keep registration order
    seen: set[int] = set()
    live: list[tuple[str, nn.Module]] = []
    params: list[nn.Parameter] = []
    layers: list[LayerInfo] = []
    infos: list[ParamInfo] = []
    for sub, module in modules:
        path = f"{name}.{sub}" if sub else name
        owned = [(pn, p) for pn, p in module.named_parameters(recurse=False) if id(p) not in seen]
        if not owned:
            continue
        indices = []
        for pn, p in owned:
            seen.add(id(p))
            indices.append(len(params))
            params.append(p)
            infos.append(ParamInfo(f"{path}.{pn}", len(layers), tuple(p.shape), str(p.dtype).replace("torch.", ""),
                                   p.numel(), p.requires_grad))
        layers.append(LayerInfo(path, type(module).__name__, tuple(indices)))
        live.append((sub, module))
    return live, params, tuple(layers), tuple(infos), "forward" if order else "registration"


def remember_order(model: nn.Module, order: tuple[str, ...]) -> None:
    try:
        _FORWARD_ORDER[model] = order
    except TypeError:  # a module that cannot be weakly referenced: just don't remember
        pass


class GradRecorder:
    """Context manager recording one row of statistics per step of a training loop.

    A step is each ``optimizer.step()`` of an optimizer holding the model's parameters (statistics
    taken just before it, update ratio from just after); while no such optimizer has stepped, each
    backward pass is a step (its end is found by a callback queued on the autograd engine from a
    post-accumulate-grad hook). Every hook is handle-based and removed in :meth:`remove`.
    """

    def __init__(self, model: nn.Module, name: str, *, sample: int = 4096, bins: int = 64,
                 activations: bool = False, exact_last: bool = True) -> None:
        self.model, self.name, self.bins = compat.original_module(model), name, bins
        self.sample, self.activations, self.exact_last = sample, activations, exact_last
        self._handles: list[Any] = []
        self._pending: list[dict[str, Any]] = []
        self._host: list[dict[str, Any]] = []
        self._act: dict[int, torch.Tensor] = {}
        self._order: list[str] = []
        self._order_set: set[str] = set()
        self.failure: Optional[str] = None
        self._covers: "WeakIdMap[Any, bool]" = WeakIdMap()
        self._opt_seen = self._bwd_queued = False
        self._steps = 0
        self._hist_every = 1
        self._before: Optional[torch.Tensor] = None
        self._last: Optional[list[tuple[Any, int]]] = None
        self.trace: Optional[GradTrace] = None

    # -- install / remove ---------------------------------------------------------------
    def __enter__(self) -> "GradRecorder":
        self._live, self._params, self._layers, self._infos, self._order_kind = layers_of(self.model, self.name)
        self._sampler = Sampler(self._params, self.sample)
        self._ids = {id(p) for p in self._params}
        try:
            with deferred_interrupts():  # a Stop while installing is raised once all is installed...
                self._install()
        except BaseException:
            self.remove()  # ...and then every handle is removed
            raise
        return self

    def _install(self) -> None:
        add = self._handles.append
        for sub, module in self._live:
            add(module.register_forward_pre_hook(lambda m, a, sub=sub: self._seen(sub)))
        for li, (_, module) in enumerate(self._live):
            if self.activations:
                add(module.register_forward_hook(lambda m, a, o, li=li: self._activation(li, m, a, o)))
        for p in self._params:
            if p.requires_grad:
                add(p.register_post_accumulate_grad_hook(self._accumulated))
        add(register_optimizer_step_pre_hook(self._pre_step))
        add(register_optimizer_step_post_hook(self._post_step))

    def __exit__(self, *exc: Any) -> None:
        self.remove()
        self.trace = self.finish()

    def remove(self) -> None:
        try:
            with deferred_interrupts():  # a Stop here is raised once every handle is removed
                for handle in self._handles:
                    handle.remove()
        finally:
            for handle in self._handles:  # again if a Stop came before the block took effect (idempotent)
                handle.remove()
            self._handles = []

    # -- hooks ----------------------------------------------------------------------------
    def _seen(self, sub: str) -> None:
        if sub not in self._order_set:
            self._order_set.add(sub)
            self._order.append(sub)

    def _fail(self, exc: BaseException) -> None:
        """A recorder bug must never break the user's training: stop recording and say why."""
        self.failure = f"recording stopped at step {self._steps}: {type(exc).__name__}: {exc}"
        self.remove()

    def _activation(self, li: int, module: nn.Module, inputs: Any, output: Any) -> None:
        if torch.is_grad_enabled():  # a training forward, not an evaluation pass
            try:
                row = activation_row(module, inputs, output)
            except Exception as exc:  # noqa: BLE001 - see _fail
                return self._fail(exc)
            if row is not None:
                self._act[li] = row

    def _accumulated(self, param: torch.Tensor) -> None:
        if not self._bwd_queued:
            self._bwd_queued = True
            compat.queue_backward_callback(self._backward_end)

    def _backward_end(self) -> None:
        self._bwd_queued = False
        if not self._opt_seen and self.failure is None:
            try:
                self._record("backward")
            except Exception as exc:  # noqa: BLE001 - see _fail
                self._fail(exc)

    def _optimizer_covers(self, opt: Any) -> bool:
        if opt not in self._covers:
            self._covers[opt] = any(id(p) in self._ids for g in opt.param_groups for p in g["params"])
        return self._covers[opt]

    def _pre_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        try:
            self._before_step(opt)
        except Exception as exc:  # noqa: BLE001 - see _fail
            self._fail(exc)

    def _post_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        try:
            self._after_step(opt)
        except Exception as exc:  # noqa: BLE001 - see _fail
            self._fail(exc)

    def _before_step(self, opt: Any) -> None:
        if self.failure is not None or not self._optimizer_covers(opt):
            return
        row = None
        if not self._opt_seen:  # from now on steps are optimizer steps: drop the backward-only rows
            reuse = self._pending[-1] if self._pending and self._last_still_there() else None
            self._opt_seen, self._pending, self._host, self._steps = True, [], [], 0
            if reuse is not None:  # the last backward's row already holds these very gradients
                row = dict(reuse, step=0, kind="optimizer")
                self._pending.append(row)
                self._steps = 1
        row = row or self._record("optimizer")
        if row is not None:
            self._before = self._sampler.gather([self._params[i] for i in row["present"]], row["present"], row["dev"])

    def _after_step(self, opt: Any) -> None:
        if self._before is None or not self._pending or not self._optimizer_covers(opt):
            return
        row = self._pending[-1]
        with torch.no_grad():
            after = self._sampler.gather([self._params[i] for i in row["present"]], row["present"], row["dev"])
            seg, n = self._sampler.seg(row["present"], row["dev"]), len(row["present"])
            per = lambda v: torch.zeros(n, device=row["dev"]).index_add_(0, seg, v)  # noqa: E731
            ratio = per((after - self._before).square()).sqrt() / per(self._before.square()).sqrt()
            row["raw"][row["index"], RAW.index("update_ratio")] = ratio
        self._before = None

    # -- rows -------------------------------------------------------------------------------
    def _record(self, kind: str) -> Optional[dict[str, Any]]:
        present = tuple(i for i, p in enumerate(self._params) if usable(p.grad))
        if not present:
            return None
        with torch.no_grad():
            want_hist = self._steps % self._hist_every == 0
            out = sampled_rows(self._params, present, self._sampler, self.bins if want_hist else None)
            dev = out["raw"].device
            index = self._sampler.consts(present, dev)["index"]
            full = torch.full((len(self._params), len(RAW) + 1), math.nan, device=dev)
            full[:, -1] = 0
            full[index] = torch.cat([out["raw"], torch.ones(len(present), 1, device=dev)], 1)
            row: dict[str, Any] = {"step": self._steps, "kind": kind, "present": present, "dev": dev,
                                   "index": index, "raw": full}
            if want_hist:
                row["hist"] = torch.zeros(len(self._params), self.bins, device=dev).index_copy_(0, index, out["hist"])
                row["range"] = torch.full((len(self._params), 2), math.nan, device=dev).index_copy_(0, index, out["range"])
            if self.activations:
                nan = torch.full((len(ACT_FIELDS),), math.nan, device=dev)
                row["act"] = torch.stack([self._act.get(li, nan).to(dev) for li in range(len(self._live))])
        self._last = [(weakref.ref(self._params[i].grad), compat.tensor_version(self._params[i].grad)) for i in present]
        self._pending.append(row)
        self._steps += 1
        if len(self._pending) >= _FLUSH:
            self._flush()
        return row

    def _flush(self) -> None:
        """One device-to-host copy for many steps (not one per parameter or per step)."""
        rows, self._pending = self._pending, []
        if not rows:
            return
        raws = torch.stack([r["raw"] for r in rows]).cpu().numpy()
        with_hist = [r for r in rows if "hist" in r]
        hists = torch.stack([r["hist"] for r in with_hist]).cpu().numpy() if with_hist else None
        ranges = torch.stack([r["range"] for r in with_hist]).cpu().numpy() if with_hist else None
        acts = torch.stack([r["act"] for r in rows]).cpu().numpy() if self.activations else None
        j = 0
        for i, r in enumerate(rows):
            host = {"step": r["step"], "kind": r["kind"], "raw": raws[i], "act": None if acts is None else acts[i]}
            if "hist" in r:
                host["hist"], host["range"] = hists[j], ranges[j]
                j += 1
            self._host.append(host)
        self._thin()

    def _thin(self) -> None:
        """Keep at most _MAX_HISTS histograms: drop every other one and halve the rate when over."""
        while sum("hist" in h for h in self._host) > _MAX_HISTS:
            self._hist_every *= 2
            for h in self._host:
                if "hist" in h and h["step"] % self._hist_every:
                    del h["hist"], h["range"]

    # -- result ----------------------------------------------------------------------------
    def finish(self) -> GradTrace:
        self._flush()
        if self._order:
            remember_order(self.model, tuple(self._order))
        live, params, layers, infos, order = layers_of(self.model, self.name, tuple(self._order) or None)
        old = {id(p): i for i, p in enumerate(self._params)}
        perm = [old[id(p)] for p in params]
        lperm = [[s for s, _ in self._live].index(sub) for sub, _ in live]
        exact = np.tile(self._sampler.exact[perm], (len(self._host), 1))
        stats = np.stack([self._host_stats(h["raw"])[perm] for h in self._host]) if self._host else \
            np.zeros((0, len(params), len(FIELDS)))
        kept = [i for i, h in enumerate(self._host) if "hist" in h]
        hist = np.stack([self._host[i]["hist"][perm] for i in kept]) if kept else np.zeros((0, len(params), self.bins))
        rng = np.stack([self._host[i]["range"][perm] for i in kept]) if kept else np.zeros((0, len(params), 2))
        notes = [self.failure] if self.failure else []
        skipped = [info.name for info, p in zip(self._infos, self._params) if p.grad is not None and not usable(p.grad)]
        if skipped:
            notes.append(f"sparse, complex or integer gradients not analysed: {', '.join(skipped[:5])}")
        if self._host and self.exact_last and self._last_still_there():
            s_last, h_last, r_last = exact_rows(params, self.bins)
            for key in ("update_ratio", "param_norm"):  # both belong to the moment of the step, not now
                s_last[:, FIELD[key]] = stats[-1, :, FIELD[key]]
            stats[-1], exact[-1] = s_last, True
            if kept and kept[-1] == len(self._host) - 1:
                hist[-1], rng[-1] = h_last, r_last
            else:
                kept.append(len(self._host) - 1)
                hist, rng = np.concatenate([hist, h_last[None]]), np.concatenate([rng, r_last[None]])
        if not exact.all():
            notes.append(f"histograms, mean |g|, zero/NaN/Inf counts and update ratios of parameters over "
                         f"{self.sample} elements are estimated from a fixed random sample of {self.sample}")
        if self._hist_every > 1:
            notes.append(f"histograms kept for every {self._hist_every}th step (at most {_MAX_HISTS})")
        acts = np.stack([h["act"][lperm] for h in self._host]) if self.activations and self._host else None
        kind = "optimizer" if self._opt_seen else "backward"
        trace = GradTrace(self.name, infos, layers, tuple(h["step"] for h in self._host), stats, exact, tuple(kept),
                          hist, rng, step_kind=kind, order=order, sample=self.sample, activations=acts,
                          notes=tuple(notes))
        self._release()
        return trace

    def _host_stats(self, raw: np.ndarray) -> np.ndarray:
        present = [int(i) for i in np.flatnonzero(raw[:, -1] == 1)]
        return raw_to_stats(raw[present, :-1], self._infos, present, len(self._params))

    def _last_still_there(self) -> bool:
        """True when the last step's gradients are still the params' .grad, unmodified since."""
        if self._last is None:
            return False
        grads = [p.grad for p in self._params if usable(p.grad)]
        return len(grads) == len(self._last) and all(
            ref() is g and compat.tensor_version(g) == version for (ref, version), g in zip(self._last, grads))

    def _release(self) -> None:
        """Drop every reference to the user's tensors (the trace holds numbers only)."""
        self._params, self._live, self._act, self._last, self._before = [], [], {}, None, None
        self._sampler = None  # type: ignore[assignment]
        self._covers = WeakIdMap()


__all__ = ["GradRecorder", "layers_of", "exact_rows", "remember_order"]
