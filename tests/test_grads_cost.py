"""What record_gradients costs a training step beyond its statistics: host synchronisations (the GPU's
real cost, counted on the CPU by wrapping the methods that wait for the device), and the batched
per-step path keeping the precision of the per-parameter one (NaN, Inf and zeros included)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from host_syncs import counting_host_syncs, plain_syncs, setup, step
from torch_nbdebug.api.grads import record_gradients
from torch_nbdebug.data.grads import FIELDS
from torch_nbdebug.record.grads import recorder as rec_mod
from torch_nbdebug.record.grads import steps as grads_steps


@pytest.mark.parametrize("steps", [1, 3, 10])
def test_a_recorded_block_synchronises_at_most_once_per_step(steps: int) -> None:
    """The steps queue device work only; the block's end reads every kept step and the exact last
    step in two copies: two synchronisations in all, whatever the number of steps or parameters
    (at most one per step from two steps on)."""
    model, opt, idx = setup()
    baseline = plain_syncs(model, opt, idx, steps)
    with counting_host_syncs() as counted:
        with record_gradients(model, name="m") as rec:
            for _ in range(steps):
                step(model, opt, idx)
    assert len(rec.steps) == steps and rec.trace.exact[-1].all()  # and the last step was made exact
    extra = counted.count - baseline
    assert extra <= 2, counted.calls


def test_recorded_steps_themselves_never_synchronise() -> None:
    model, opt, idx = setup()
    baseline = plain_syncs(model, opt, idx, 4)
    with record_gradients(model, name="m", activations=True) as rec:
        step(model, opt, idx)
        with counting_host_syncs() as counted:
            for _ in range(4):
                step(model, opt, idx)
    assert counted.count == baseline
    assert len(rec.steps) == 5 and rec.layer("m.blocks.0.c_fc").param("weight").update_ratio > 0


def test_long_runs_copy_to_the_host_once_per_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rec_mod, "_FLUSH", 3)
    model, opt, idx = setup()
    baseline = plain_syncs(model, opt, idx, 9)
    with counting_host_syncs() as counted:
        with record_gradients(model, name="m") as rec:
            for _ in range(9):
                step(model, opt, idx)
    assert rec.steps == tuple(range(9))
    # flushes before steps 3 and 6, then the end's flush; the exact last step is computed when first read,
    # from a copy of its gradients (issue 27's decision), in that step's two copies
    assert counted.count - baseline == 2 + 1
    with counting_host_syncs() as read:
        stats = rec.trace.stats
    assert read.count == 2 and rec.trace.exact[-1].all()
    assert not np.isnan(stats[:, :, 12]).any()  # every step kept its update ratio across flushes


def test_a_nan_gradient_costs_one_more_copy_at_the_end_only() -> None:
    model = nn.Linear(4, 3)
    bad = torch.tensor([[math.nan, 0.0, 1.0, 2.0], [0.0, math.inf, 3.0, 1.0], [1.0, 2.0, -math.inf, 0.0]])
    model.weight.register_hook(lambda g: bad)
    with counting_host_syncs() as counted:
        with record_gradients(model) as rec:
            model(torch.ones(2, 4)).sum().backward()
    w = rec.layer(0).param("weight")
    assert (w.nan, w.inf, w.zeros) == (1, 2, 3) and w.exact
    assert counted.count <= 3, counted.calls


def test_batched_statistics_of_non_finite_and_sampled_gradients_match_the_tensors() -> None:
    """The per-step path (no exact recomputation) on whole and sampled parameters with NaN, ±Inf, zeros."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 200))  # 1000 weights: sampled with sample=100
    g0 = torch.randn(5, 6)
    g0[0, 0], g0[1, 1], g0[2, 2], g0[3, 3:5] = math.nan, math.inf, -math.inf, 0.0
    model[0].weight.register_hook(lambda g: g0)
    with record_gradients(model, sample=100, bins=8, exact_last=False) as rec:
        model(torch.randn(3, 6)).sum().backward()
    stats = {name: rec.trace.stats[0, :, i] for i, name in enumerate(FIELDS)}  # [param] per field
    w = rec.layer(0).param("weight")
    assert (w.nan, w.inf, w.zeros) == (1, 2, 2) and w.exact
    assert np.isnan([stats["norm"][0], stats["min"][0], stats["max"][0]]).all()  # NaN, as aminmax says
    finite = g0[torch.isfinite(g0)]
    assert w.mean_abs == pytest.approx(float(finite.abs().mean()), rel=1e-6)
    assert (w.hist.lo, w.hist.hi) == pytest.approx((float(finite.min()), float(finite.max())))
    assert sum(w.hist.counts) == finite.numel()
    big = rec.layer(1).param("weight")
    grad = model[1].weight.grad
    assert not big.exact and sum(big.hist.counts) == pytest.approx(1000)
    assert big.norm == pytest.approx(float(grad.norm()), rel=1e-5)
    assert (stats["min"][2], stats["max"][2]) == (float(grad.min()), float(grad.max()))  # exact although sampled
    assert big.mean == pytest.approx(float(grad.mean()), rel=1e-4, abs=1e-7)
    bias = model[1].bias.grad  # whole: every statistic exact
    assert stats["mean"][3] == pytest.approx(float(bias.mean()), rel=1e-6, abs=1e-9)
    assert stats["std"][3] == pytest.approx(float(bias.std()), rel=1e-5)
    assert stats["zeros"][3] == int((bias == 0).sum())


def test_live_progress_reads_kept_and_pending_steps_in_one_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rec_mod, "_FLUSH", 2)
    model, opt, idx = setup()
    recording = record_gradients(model, name="m")
    with recording:
        recorder = recording._recorder
        for _ in range(3):  # steps 0 and 1 are on the host after the flush before step 2
            step(model, opt, idx)
        with counting_host_syncs() as counted:
            kind, steps, norms, names = recorder.progress()
        assert counted.count == 1 and kind == "optimizer" and steps == (0, 1, 2)
        assert norms.shape == (3, len(names)) and np.isfinite(norms).all()
        live_last = norms[-1]
    final = np.array([recording.layer(name, 2).norm for name in names])
    assert live_last == pytest.approx(final, rel=1e-6)


def test_dead_units_are_exact_for_tiny_and_non_finite_gradients() -> None:
    model = nn.Linear(3, 5)
    g = torch.zeros(5, 3)
    g[1, 0], g[2, 2], g[3, 1] = 1e-38, math.nan, -math.inf  # tiny, NaN and Inf units are not dead
    model.weight.register_hook(lambda _: g)
    with record_gradients(model) as rec:
        model(torch.ones(1, 3)).sum().backward()
    w = rec.layer(0).param("weight")
    assert w.dead_units == 2 and w.zeros == 12 and w.exact


def test_a_flush_reduces_again_in_full_only_the_steps_holding_a_nan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the end the kept steps are reduced as finite (a third of the passes); a step holding a
    NaN or an Inf is then reduced again in full: the same numbers as a single reduction at the end,
    for one more host copy at that flush only."""
    bad = torch.tensor([[math.nan, 0.0, 1.0, 2.0], [0.0, math.inf, 3.0, 1.0], [1.0, 2.0, -math.inf, 0.0]])

    def run() -> tuple[object, int]:
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        steps = iter(range(6))
        model.weight.register_hook(lambda g: bad.clone() if next(steps) == 1 else g)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with counting_host_syncs() as counted:
            with record_gradients(model, bins=8) as rec:
                for _ in range(6):
                    opt.zero_grad()
                    model(torch.ones(2, 4)).sum().backward()
                    opt.step()
        return rec.trace, counted.count

    once, once_copies = run()
    monkeypatch.setattr(rec_mod, "_FLUSH", 3)  # steps 0-2, the NaN one among them, flushed before step 3
    flushed, flushed_copies = run()
    assert flushed_copies == once_copies + 2  # the flush, and its second copy for the step with the NaN
    np.testing.assert_array_equal(flushed.stats, once.stats)  # type: ignore[attr-defined]
    np.testing.assert_array_equal(flushed.hist, once.hist)  # type: ignore[attr-defined]
    w = flushed.layer(0, 1).param("weight")  # type: ignore[attr-defined]
    assert (w.nan, w.inf, w.zeros) == (1, 2, 3) and sum(w.hist.counts) == 9


def test_the_end_reduces_as_finite_and_a_nan_step_again_within_its_two_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """With sampled gradients the kept steps are reduced as finite at the end (a third of the passes) and
    only a step holding a NaN is reduced again in full; its numbers are those of a full reduction. When the
    exact last step is computed at the end, that step rides its second copy (none of its own); when it is
    computed at the first read (issue 27: the default when a copy of the gradients fits), the end has one
    copy only, and the NaN step takes one more there, as at any flush."""
    full = grads_steps._block_sums
    rows_in_full: list[int] = []

    def counted(x: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
        rows_in_full.append(x.shape[0])
        return full(x, fill)

    def run(nan_at: int, **options: object) -> tuple[object, int]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 8))  # 8192 weights: sampled
        steps = iter(range(3))  # backward passes only: the NaN stays in its step (an update would spread it)
        spike = torch.zeros(8, 128)
        spike[2, 5] = math.nan
        model[1].weight.register_hook(lambda g: g + spike if next(steps) == nan_at else g)  # whole: 1024
        with counting_host_syncs() as counted_copies:
            with record_gradients(model, bins=8, **options) as rec:  # type: ignore[arg-type]
                for _ in range(3):
                    model.zero_grad()
                    model(torch.randn(4, 64)).sum().backward()
            trace = rec.trace  # the first read: the exact last step
        return trace, counted_copies.count

    for limit, more in ((0, 0), (rec_mod.COPY_LIMIT, 1)):  # the last step made exact at the end, at the first read
        monkeypatch.setattr(rec_mod, "COPY_LIMIT", limit)
        monkeypatch.setattr(grads_steps, "_block_sums", full)
        _, clean_copies = run(nan_at=-1)
        rows_in_full.clear()
        monkeypatch.setattr(grads_steps, "_block_sums", counted)
        dirty, dirty_copies = run(nan_at=1)
        assert dirty_copies == clean_copies + more  # at the end: the NaN step rode the exact last step's second copy
        assert rows_in_full and set(rows_in_full) == {1}  # that step alone, reduced in full
    reference, _ = run(nan_at=1, exact_last=False)  # the end without a job: every step reduced in full
    np.testing.assert_array_equal(dirty.stats[:2], reference.stats[:2])  # type: ignore[attr-defined]
    np.testing.assert_array_equal(dirty.hist[:2], reference.hist[:2])  # type: ignore[attr-defined]
    w = dirty.layer(1, 1).param("weight")  # type: ignore[attr-defined]
    assert w.nan == 1 and w.exact and dirty.exact[-1].all()  # type: ignore[attr-defined]
