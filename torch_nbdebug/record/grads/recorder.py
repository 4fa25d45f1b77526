"""Record per-parameter gradient statistics of one model: a snapshot, or every step of a loop.

Speed matters more than anything here (a recorder that slows training by 50% is not used), so a
recorded step launches a fixed handful of batched ops, whatever the number of parameters, and never
synchronises with the host (see :mod:`torch_nbdebug.record.grads.steps`):

- exact per parameter: L2 norms of gradients and parameters (one ``_foreach_norm`` each); sum and
  min/max, from the gathered sample for the parameters taken whole, directly for the others;
- from a fixed random sample of at most ``sample`` elements per parameter, gathered into one flat
  tensor: the histogram, mean |g|, zero/NaN/Inf fractions and the update ratio ‖Δw‖/‖w‖ (the sample
  of w is taken before and after ``optimizer.step()``). Parameters with at most ``sample`` elements
  are sampled whole, so their values are exact.

The samples stay on the device, in rows allocated ahead (:class:`~torch_nbdebug.record.grads.steps.Chunk`);
every ``_FLUSH`` steps (or before those rows would take over ``_MAX_KEPT`` elements, or at the end)
they are reduced for all kept steps at once and copied to the host in one transfer (taken as
finite: a step that held a NaN or an Inf after all is reduced again in full, for one more transfer
before the end, with the exact last step's second one at the end; an end without that second
transfer reduces every step in full). The last step is made exact at exit when its gradients are
still there (``exact_last``): its parameters taken whole already are, so only the sampled ones are
measured over every element (their norm, sum, min and max kept from the step), the first copy joined
with that last transfer: a recording of a few steps costs two host synchronisations in all.
"""
from __future__ import annotations

import math
import weakref
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from torch_nbdebug.data.grads import ACT_FIELDS, GradTrace
from torch_nbdebug.record import compat
from torch_nbdebug.record.grads.last import COPY_LIMIT, LastCopy, LazyTrace, Rows, copy_fits, settle
from torch_nbdebug.record.grads.layers import FORWARD_ORDER, Layers, layers_of, param_info, remember_order
from torch_nbdebug.record.grads.stats import (
    LastJob, Redo, activation_row, exact_rows, fix_overflow, raw_to_stats, redo_dirty, run_job, sampled_exact_job,
    scaled_norm, to_host, usable, whole_columns, wide_sums,
)
from torch_nbdebug.record.grads.steps import (RAW, Chunks, Layout, Sampler, present_grads, reduce_rows, sampled_rows,
                                              update_squares)
from torch_nbdebug.record.interrupts import WeakIdMap, deferred_interrupts, no_grad_held
from torch_nbdebug.record.lifecycle import HookScope, Removable

_FLUSH = 64          # steps kept on the device between host copies
_MAX_HISTS = 256     # histogram rows kept; beyond, every other one is dropped (bounded memory)
_MAX_KEPT = 1 << 24  # sample elements held on the device between host copies, empty rows included (64 MB)
# Sample elements reduced (and rows allocated) together on a CPU: 4 MB of float32, in a shared cache. Fewer,
# larger groups: each op of a reduction costs as much to set up as to run on a 1 MB group (a 128-step run of
# the 2-layer GPT reduced its samples in 43 ms with 1 MB groups, 31 ms with 4 MB ones and 33 ms with 64 MB).
_CPU_CHUNK = 1 << 20


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
        # bytes of the last step's gradients that finish_later may copy to make that step exact when first read
        self.copy_limit = COPY_LIMIT
        self._scope = HookScope()
        self._grad_handles: list[Removable] = []  # find a backward's end: only until an optimizer steps
        self._order_handles: list[Removable] = []  # learn the forward order: only until every layer ran
        self._traced = False  # whether torch.compile traced those hooks
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
        self._chunks = Chunks(self._chunk_rows)  # where the steps' samples are written
        self._last: Optional[list[tuple[Any, int]]] = None
        self._estimated: set[int] = set()  # steps whose overflowed norm or sum of a sampled gradient is estimated
        self._last_checked: Optional[bool] = None  # at the end: whether the last step can be made exact
        self.trace: Optional[GradTrace] = None

    # -- install / remove ---------------------------------------------------------------
    def __enter__(self) -> "GradRecorder":
        self._enter_order = FORWARD_ORDER.get(self.model)
        self._live, self._params, self._layers, self._infos, self._order_kind = \
            layers_of(self.model, self.name, self._enter_order)
        self._sampler = Sampler(self._params, self.sample)
        self._ids = {id(p) for p in self._params}
        self._scope.open(self._install)
        return self

    def _install(self, scope: HookScope) -> None:
        self._order_handles = [scope.hook(module.register_forward_pre_hook(lambda m, a, sub=sub: self._seen(sub)))
                               for sub, module in self._live]
        for li, (_, module) in enumerate(self._live):
            if self.activations:
                scope.hook(module.register_forward_hook(lambda m, a, o, li=li: self._activation(li, m, a, o)))
        for p in self._params:
            if p.requires_grad:
                self._grad_handles.append(scope.hook(p.register_post_accumulate_grad_hook(self._accumulated)))
        scope.hook(register_optimizer_step_pre_hook(self._pre_step))
        scope.hook(register_optimizer_step_post_hook(self._post_step))

    def __exit__(self, *exc: Any) -> None:
        self.remove()
        self.trace = self.finish()

    def remove(self) -> None:
        """Take off every hook (a Stop meanwhile is raised once all are off); safe to call again."""
        self._scope.close()

    # -- hooks ----------------------------------------------------------------------------
    def _seen(self, sub: str) -> None:
        if torch.compiler.is_compiling():
            self._traced = True
        if sub not in self._order_set:
            self._order_set.add(sub)
            self._order.append(sub)

    def _order_known(self) -> None:
        """Every layer has run: the forward order is complete, its hooks can go (a hook on a module takes
        its call off PyTorch's fast path, a few microseconds each). Not when torch.compile traced them: its
        code guards on the hooks, and would compile again."""
        if not self._traced:
            handles, self._order_handles = self._order_handles, []
            for handle in handles:
                handle.remove()

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
            with deferred_interrupts():  # as in _pre_step
                try:
                    self._record("backward")
                except Exception as exc:  # noqa: BLE001 - see _fail
                    self._fail(exc)

    def _optimizer_covers(self, opt: Any) -> bool:
        if opt not in self._covers:
            self._covers[opt] = any(id(p) in self._ids for g in opt.param_groups for p in g["params"])
        return self._covers[opt]

    def _pre_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        # A Stop inside is raised when the hook is done: never between a grad-mode switch and its restore.
        with deferred_interrupts():
            try:
                self._before_step(opt)
            except Exception as exc:  # noqa: BLE001 - see _fail
                self._fail(exc)

    def _post_step(self, opt: Any, args: Any, kwargs: Any) -> None:
        # A Stop inside is raised when the hook is done: never between a grad-mode switch and its restore.
        with deferred_interrupts():
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
            self._estimated = set()
            for handle in self._grad_handles:  # from now on backward passes are not steps: no call per parameter
                handle.remove()
            if reuse is not None:  # the last backward's row already holds these very gradients
                row = dict(reuse, step=0, kind="optimizer")
                self._pending.append(row)
                self._steps = 1
            else:  # the dropped rows' chunks are free
                self._chunks.recycle()
        row = row or self._record("optimizer")
        if row is not None:
            with no_grad_held():
                # Gathered again each step: writes through ``p.data`` (clipping, EMA swaps) change the
                # weights without bumping any version, so the last step's "after" cannot stand in.
                self._before = self._gather_params(row, after=False)

    def _after_step(self, opt: Any) -> None:
        if self._before is None or not self._pending or not self._optimizer_covers(opt):
            return
        row = self._pending[-1]
        with no_grad_held():  # a few batched ops, whatever the number of parameters
            self._gather_params(row, after=True)
            row["squares"] = update_squares(row["layout"], row["chunk"].weights())
        self._before = None

    def _gather_params(self, row: dict[str, Any], after: bool) -> torch.Tensor:
        out = row["chunk"].weights()[int(after)]
        return self._sampler.gather([self._params[i] for i in row["present"]], row["layout"], out)

    @staticmethod
    def _chunk_rows(layout: Layout) -> int:
        """Rows of a new chunk: the steps reduced together (on a CPU a cache-sized group of steps, on a
        device all the steps between host copies), within ``_MAX_KEPT`` with the weights' rows."""
        rows = -(-_CPU_CHUNK // layout.size) if layout.device.type == "cpu" else _FLUSH
        return max(1, min(rows, _MAX_KEPT // (3 * layout.size)))

    # -- rows -------------------------------------------------------------------------------
    def _record(self, kind: str) -> Optional[dict[str, Any]]:
        if self._order_handles and len(self._order) == len(self._live):
            self._order_known()
        present = tuple(i for i, p in enumerate(self._params) if usable(p.grad))
        if not present:
            return None
        grads = present_grads(self._params, present)
        layout = self._sampler.layout(present, grads[0].device)
        if self._pending and (len(self._pending) >= _FLUSH or self._chunks.over(layout, _MAX_KEPT)):
            self._flush()  # before this row, so its update ratio still joins it after the step
        with no_grad_held():
            row = sampled_rows(self._params, grads, layout, self._sampler, *self._chunks.row_for(layout))
            row.update(step=self._steps, kind=kind, present=present, want_hist=self._steps % self._hist_every == 0)
            if self.activations:
                dev = row["layout"].device
                nan = torch.full((len(ACT_FIELDS),), math.nan, dtype=torch.float32, device=dev)
                row["act"] = torch.stack([self._act.get(li, nan).to(dev) for li in range(len(self._live))])
        self._last = [(weakref.ref(g), compat.tensor_version(g)) for g in grads]
        self._pending.append(row)
        self._steps += 1
        return row

    def _flush(self, final: bool = False, whole: Optional[list[int]] = None) -> Optional[np.ndarray]:
        """Reduce the kept steps and copy them to the host: one transfer for many steps (not one per
        parameter or per step). Before the end (not ``final``) the samples are taken as finite, the rows
        that were not reduced again in full: a second transfer, only when some gradient held a NaN or an
        Inf. ``whole`` (the end when the last step is made exact later): returns the :data:`WHOLE_COLUMNS`
        of those parameters at the last step, from its sample."""
        groups, arrays, _ = self._reduce((), finite=not final)
        if not final:
            redo_dirty(groups, arrays, self.bins)
        columns = None if whole is None else self._whole_columns(groups, arrays, whole)
        self._estimated |= fix_overflow(groups, arrays)
        self._keep(groups, arrays)
        return columns

    def _whole_columns(self, groups: list[list[dict[str, Any]]], arrays: list[dict[str, np.ndarray]],
                       whole: list[int]) -> np.ndarray:
        """The whole parameters' columns at the last step from its sample, exact when finite (the others
        the exact last step's job measures again); before :func:`fix_overflow` mends them."""
        raw = arrays[-1]["raw"][-1]  # the last row: the job's step
        return whole_columns(raw[self._sampler.exact[list(groups[-1][-1]["present"])]], self._sampler.numel[whole])

    def _reduce(self, extra: Sequence[torch.Tensor], finite: bool
                ) -> tuple[list[list[dict[str, Any]]], list[dict[str, np.ndarray]], list[np.ndarray]]:
        """The kept steps in groups, their reductions' host copies (one per group) and those of
        ``extra``: one transfer. ``finite``: see :func:`reduce_rows` (then see :class:`Redo`)."""
        rows, self._pending = self._pending, []
        groups: list[list[dict[str, Any]]] = []
        for r in rows:  # consecutive steps with the same parameters (and chunk) together
            layout = r["layout"]
            # On a CPU, a few steps at a time: each pass over the samples then stays in the cache.
            fits = layout.device.type != "cpu" or len(groups[-1]) * layout.size < _CPU_CHUNK if groups else False
            if groups and groups[-1][0]["layout"] is layout and groups[-1][0]["chunk"] is r["chunk"] and fits:
                groups[-1].append(r)
            else:
                groups.append([r])
        with no_grad_held():
            reduced = [reduce_rows(g, self.bins, finite=finite) for g in groups]
            for g, out in zip(groups, reduced):
                if self.activations:
                    out["act"] = torch.stack([r["act"] for r in g])
        wanted = [t for out in reduced for t in out.values()]
        host = iter(to_host(wanted + list(extra)))
        arrays = [{key: next(host) for key in out} for out in reduced]
        return groups, arrays, list(host)

    def _keep(self, groups: list[list[dict[str, Any]]], arrays: list[dict[str, np.ndarray]]) -> None:
        """Keep the reduced groups on the host; their rows on the device are free again."""
        self._chunks.recycle()
        for group, arrays_of_group in zip(groups, arrays):
            self._keep_on_host(group, arrays_of_group)
        if groups:
            self._thin()

    def _end(self, last: Optional[tuple[LastJob, list[int], list[int]]]) -> Optional[tuple[Any, ...]]:
        """The final flush, and the exact last step's job run with it: the job's result (None without one).
        With sampled parameters the job always asks for a second copy: the kept steps are then reduced
        as finite (a third of the passes) and the rows holding a NaN or an Inf reduced again in full
        for that second copy (no copy of their own)."""
        if last is None:
            self._flush(final=True)
            return None
        job, big, whole = last
        groups, arrays, first = self._reduce(next(job), finite=bool(big))
        redo = Redo(groups, arrays, self.bins)
        result, copies = run_job(job, first + [self._whole_columns(groups, arrays, whole)], ride=redo.tensors)
        redo.put(copies)
        self._estimated |= fix_overflow(groups, arrays)
        self._keep(groups, arrays)
        return result

    def _keep_on_host(self, group: list[dict[str, Any]], arrays: dict[str, np.ndarray]) -> None:
        """Scatter a reduced group's rows back to every parameter (NaN and has_grad 0 where absent)."""
        n_p = len(self._params)
        present = list(group[0]["present"])
        j = 0
        for i, r in enumerate(group):
            raw = np.full((n_p, len(RAW) + 1), np.nan)
            raw[:, -1] = 0
            raw[present, :-1], raw[present, -1] = arrays["raw"][i], 1
            host: dict[str, Any] = {"step": r["step"], "kind": r["kind"], "raw": raw, "last": r.get("last", False),
                                    "act": arrays["act"][i] if "act" in arrays else None}
            if r["want_hist"] and "hist" in arrays:
                host["hist"], host["range"] = np.zeros((n_p, self.bins)), np.full((n_p, 2), np.nan)
                host["hist"][present], host["range"][present] = arrays["hist"][j], arrays["range"][j]
                j += 1
            self._host.append(host)

    def _thin(self) -> None:
        """Keep at most _MAX_HISTS histograms: drop every other one and halve the rate when over."""
        while sum("hist" in h for h in self._host) > _MAX_HISTS:
            self._hist_every *= 2
            for h in self._host:
                if "hist" in h and h["step"] % self._hist_every and not h["last"]:  # the exact last one stays
                    del h["hist"], h["range"]

    # -- result ----------------------------------------------------------------------------
    def finish(self) -> GradTrace:
        """The trace, the last step made exact now (``exact_last``)."""
        trace = self._finish(later=False)
        assert isinstance(trace, GradTrace)
        return trace

    def finish_later(self) -> "GradTrace | LazyTrace":
        """:meth:`finish`, the last step made exact when the trace is first read (:class:`LazyTrace`) when a
        copy of its gradients fits :func:`copy_fits` (``copy_limit`` bytes); else, or when that copy fails
        (out of memory), made exact now."""
        return self._finish(later=True)

    def _finish(self, later: bool) -> "GradTrace | LazyTrace":
        if self._order:
            remember_order(self.model, tuple(self._order))
        last, copy = None, None
        try:
            copy = self._last_copy() if later else None
            if copy is not None:
                return self._lazy_trace(copy)
            last = self._exact_last_job()
            return self._trace(last)
        finally:  # also when a copy fails part-way: no suspended job, no reference to the user's tensors
            if last is not None:
                last[0].close()
            copy = None  # nor to the copy of them (a traceback kept in a notebook keeps this frame)
            self._release()

    def _trace(self, last: Optional[tuple[LastJob, list[int], list[int]]]) -> GradTrace:
        layers = self._final_layers()
        done = self._end(last)  # the kept steps and the exact last step's numbers: two copies for finite ones
        rows = self._rows(layers)
        if last is not None and done is not None:
            _, big, whole = last
            rows.make_exact(done, big, whole, self._matrices(whole))
        return rows.trace()

    def _lazy_trace(self, copy: LastCopy) -> LazyTrace:
        """The kept steps flushed (one copy to the host, with the whole ones' columns of the last step that
        its job needs), the last step left to be made exact from ``copy`` when the trace is first read."""
        try:
            layers = self._final_layers()
            copy.columns = self._flush(final=not copy.big, whole=copy.whole)
            return LazyTrace(self._rows(layers), copy)
        except BaseException:
            copy.drop()  # the traceback a notebook keeps keeps this frame: not the copy with it
            raise

    def _rows(self, layers: Layers) -> Rows:
        """The host rows of every step as the trace's arrays, in the order of ``layers`` (:meth:`_final_layers`)."""
        live, params, layer_infos, infos, order = layers
        old = {id(p): i for i, p in enumerate(self._params)}
        perm = [old[id(p)] for p in params]
        lperm = [[s for s, _ in self._live].index(sub) for sub, _ in live]
        exact = np.tile(self._sampler.exact[perm], (len(self._host), 1))
        stats = raw_to_stats([h["raw"] for h in self._host], self._sampler.numel, perm)
        kept = [i for i, h in enumerate(self._host) if "hist" in h]
        hist = np.stack([self._host[i]["hist"][perm] for i in kept]) if kept else np.zeros((0, len(params), self.bins))
        rng = np.stack([self._host[i]["range"][perm] for i in kept]) if kept else np.zeros((0, len(params), 2))
        notes = [self.failure] if self.failure else []
        skipped = [info.name for info, p in zip(self._infos, self._params) if p.grad is not None and not usable(p.grad)]
        if skipped:
            notes.append(f"sparse, complex or integer gradients not analysed: {', '.join(skipped[:5])}")
        acts = np.stack([h["act"][lperm] for h in self._host]) if self.activations and self._host else None
        return Rows(self.name, infos, layer_infos, tuple(h["step"] for h in self._host), stats, exact, tuple(kept),
                    hist, rng, np.argsort(perm), kind="optimizer" if self._opt_seen else "backward", order=order,
                    sample=self.sample, activations=acts, notes=notes, estimated=set(self._estimated),
                    hist_every=self._hist_every, max_hists=_MAX_HISTS)

    def _matrices(self, whole: list[int]) -> list[int]:
        """Those of the parameters ``whole`` whose gradient has units (at least two dimensions)."""
        return [i for i, g in zip(whole, present_grads(self._params, whole)) if g.dim() >= 2]

    def _final_layers(self) -> Layers:
        """:func:`layers_of` in the forward order this recording saw. When that order is the one the
        layers of ``__enter__`` were sorted by (a model recorded again), the same walk gives the same
        layers: only the parameters' infos are read again (frozen, reshaped or cast while recording)."""
        order = tuple(self._order) or FORWARD_ORDER.get(self.model)
        if order != self._enter_order:
            return layers_of(self.model, self.name, order)
        infos = tuple(param_info(info.name, info.layer, p) for info, p in zip(self._infos, self._params))
        return self._live, self._params, self._layers, infos, self._order_kind

    def _last_parts(self) -> Optional[tuple[list[int], list[int], torch.Tensor]]:
        """When the last step's gradients are still there (``exact_last``): the recorder's indices of its
        sampled parameters and of those taken whole, and the sampled ones' norm, sum, min and max
        ``[len(big), 4]``, exact at the step (its row, marked as the last, keeps its histogram). The whole
        ones are exact in its sample already but for their dead units (and, rarely, see sampled_exact_job);
        the sampled ones are measured over every element, but for those four numbers."""
        if not self._last_exists():
            return None
        row = self._pending[-1]  # a row is flushed only when a newer one comes: the last one is pending
        row["last"] = row["want_hist"] = True
        layout: Layout = row["layout"]
        big = [row["present"][j] for j in layout.big]
        whole = [i for i in row["present"] if self._sampler.exact[i]]
        known = torch.cat([row["norm"].index_select(0, layout.big_index)[:, None], row["big"]], 1) if big else \
            row["norm"].new_zeros(0, 4)
        return big, whole, known

    def _exact_last_job(self) -> Optional[tuple[LastJob, list[int], list[int]]]:
        """The job making the last step exact on its gradients (see :meth:`_last_parts`)."""
        parts = self._last_parts()
        if parts is None:
            return None
        big, whole, known = parts
        job = sampled_exact_job(present_grads(self._params, big), known, present_grads(self._params, whole), self.bins)
        return job, big, whole

    def _last_copy(self) -> Optional[LastCopy]:
        """A copy of the gradients :meth:`_exact_last_job` would read, when it fits :func:`copy_fits` and
        can be made (None: make the last step exact now). An older recording's copy is settled first."""
        grads = present_grads(self._params, self._pending[-1]["present"]) if self._last_exists() else []
        if not grads or not copy_fits(grads, self.copy_limit):
            return None
        settle()
        parts = self._last_parts()
        assert parts is not None
        big, whole, known = parts
        try:
            with no_grad_held():
                copies = [g.clone() for g in present_grads(self._params, big + whole)]
        except Exception:  # noqa: BLE001 - out of memory, say: computed now instead
            return None
        return LastCopy(copies, known, big, whole, self._matrices(whole), self.bins)

    def _last_exists(self) -> bool:
        """Whether the last step can be made exact (``exact_last``, its gradients still there), checked once."""
        if self._last_checked is None:
            self._last_checked = bool(self._pending and self.exact_last and self._last_still_there())
        return self._last_checked

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
        self._chunks.release()
        if getattr(self, "_sampler", None) is not None:
            self._sampler.release()
        self._sampler = None  # type: ignore[assignment]
        self._covers = WeakIdMap()

    # -- live progress (read-only) -----------------------------------------------------------
    def progress(self, since: int = 0) -> tuple[str, tuple[int, ...], np.ndarray, tuple[str, ...]]:
        """For a live view while recording: the step kind, then for the rows from ``since`` on their
        steps and per-layer gradient norms ``[S, L]`` (NaN where a layer had no gradient), and the layer
        names. The norms of the rows still on the device are copied now, in one transfer: call it only
        when a view update is due, never per step. A change of kind (backward -> optimizer) restarts the rows."""
        kind = "optimizer" if self._opt_seen else "backward"
        names = tuple(layer.name for layer in self._layers)
        done, pending = self._host[since:], self._pending[max(0, since - len(self._host)):]
        if not (done or pending) or not self._params:
            return kind, (), np.zeros((0, len(names))), names
        raw = np.zeros((len(done) + len(pending), len(self._params), 2))  # norm, has_grad
        for i, r in enumerate(done):
            raw[i] = r["raw"][:, [0, -1]]
        copies = to_host([r["norm"] for r in pending])
        _wide_pending_norms(pending, copies)
        for i, (r, norms) in enumerate(zip(pending, copies), len(done)):
            raw[i, list(r["present"])] = np.stack([norms, np.ones(len(norms))], 1)
        squares = np.where(raw[:, :, 1] == 1, raw[:, :, 0], 0.0) ** 2  # [S, P]; absent params count 0
        norms = np.full((len(raw), len(names)), np.nan)
        for li, layer in enumerate(self._layers):
            present = raw[:, list(layer.params), 1].max(axis=1) == 1
            norms[present, li] = np.sqrt(squares[present][:, list(layer.params)].sum(axis=1))
        return kind, tuple(int(r["step"]) for r in done + pending), norms, names


def _wide_pending_norms(pending: list[dict[str, Any]], norms: list[np.ndarray]) -> None:
    """The gradient norms of rows not flushed yet (their host copies ``norms``) that came back Inf (an
    overflowed sum of squares is never NaN) from float32 sums of squares taken again in float64 from the
    rows' kept samples, where every element is finite (the sample's, and the exact min and max of a sampled parameter): gradients of 1e20 square
    past float32's range though their norm does not. Exact for a parameter taken whole, an estimate from
    its sample for the others (as :func:`fix_overflow` gives them at the flush). Only when such a norm
    came back: one more host copy then."""
    found = [(i, int(j)) for i, n in enumerate(norms) for j in np.flatnonzero(np.isinf(n))]
    if not found:  # the common case: one test per row
        return
    with no_grad_held():
        rows = [pending[i] for i, _ in found]
        ends = [r["big"][r["layout"].big.index(j), 1:] if j in r["layout"].big else r["norm"].new_zeros(2)
                for r, (_, j) in zip(rows, found)]
        sums = wide_sums([r["layout"].sample_of(r["x"], j) for r, (_, j) in zip(rows, found)])
        (lo_hi,) = to_host([torch.stack(ends)])
    for (i, j), r, (squares, _, _, top), (lo, hi) in zip(found, rows, sums, lo_hi):
        if np.isfinite(squares) and np.isfinite(lo) and np.isfinite(hi):  # else an element is not finite
            layout = r["layout"]
            norms[i][j] = scaled_norm(squares, layout.lengths[j], layout.sizes[j], max(top, -lo, hi))


__all__ = ["GradRecorder", "layers_of", "exact_rows", "remember_order"]
