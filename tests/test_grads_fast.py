"""The fast CPU paths of the exact statistics (issue 11): the same numbers as the torch calls they
replace, and the recorder's last step taken through them rather than through the slow calls."""
from __future__ import annotations

import math
import tracemalloc

import numpy as np
import pytest
import torch
from torch import nn

from torch_nbdebug.api.grads import grads, record_gradients
from torch_nbdebug.record.grads import cpu as grads_cpu
from torch_nbdebug.record.grads import stats as grads_stats
from torch_nbdebug.record.grads import steps as grads_steps

_GRADIENTS = {
    "normal": lambda: torch.randn(1000),
    "small matrix": lambda: torch.randn(300, 1000) * 1e-3,
    "zeros": lambda: torch.zeros(50),
    "constant": lambda: torch.full((7,), 3.0),
    "half": lambda: torch.randn(5).half(),
    "double": lambda: torch.randn(77, 33).double(),
    "huge values": lambda: torch.rand(1 << 19) * 1e30,
    "tiny values": lambda: torch.tensor([1e-38, 0.0, -1e-38]),
    "on bin edges": lambda: torch.randint(-3, 4, (1000,)).float(),
    "range overflowing float32": lambda: torch.tensor([-3e38, 0.0, 1.0, 3e38]),  # histc's own (odd) counts
    "bins overflowing float32": lambda: torch.tensor([0.0, 1.0, 3e38]),
}


@pytest.mark.parametrize("piece", [1 << 18, 1000, 64])  # one piece, many pieces, pieces smaller than a row
@pytest.mark.parametrize("bins", [64, 8, 7, 1])
def test_binned_histograms_count_exactly_as_histc(monkeypatch: pytest.MonkeyPatch, bins: int, piece: int) -> None:
    monkeypatch.setattr(grads_cpu, "PIECE", piece)
    torch.manual_seed(0)
    gradients = [make() for make in _GRADIENTS.values()]
    ranges = np.array([grads_stats._widen(float(g.float().min()), float(g.float().max())) for g in gradients])
    expected = torch.stack([torch.histc(g.float().reshape(-1), bins, *r) for g, r in zip(gradients, ranges)])
    assert torch.equal(grads_cpu.binned(gradients, bins, ranges), expected)


@pytest.mark.parametrize("shape", [(5, 3), (300, 1000), (4, 2, 3), (1, 1 << 19)])
def test_unit_sums_are_the_per_unit_l1_norms(monkeypatch: pytest.MonkeyPatch, shape: tuple[int, ...]) -> None:
    monkeypatch.setattr(grads_cpu, "PIECE", 1000)  # many slices of units, and units wider than a slice
    torch.manual_seed(0)
    g = torch.randn(*shape)
    g[0] = 0.0
    expected = torch.linalg.vector_norm(g.reshape(shape[0], -1), 1, dim=1)
    got = grads_cpu.unit_sums(g)
    assert got.dtype == torch.float32 and got[0] == 0
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)


def test_inexact_moments_flag_non_finite_and_nearly_constant_gradients() -> None:
    rows = np.zeros((4, len(grads_stats.WHOLE_COLUMNS)))
    col = {name: i for i, name in enumerate(grads_stats.WHOLE_COLUMNS)}
    rows[:, col["norm"]] = [math.sqrt(10.0), math.nan, math.sqrt(40.0), 1.0]  # 10 elements each, but the last: 1
    rows[:, col["sum"]] = [0.0, 1.0, 20.0, 1.0]  # mean 0; NaN norm; all 2.0 (constant); one element
    assert grads_stats._inexact_moments(rows, np.array([10.0, 10.0, 10.0, 1.0])).tolist() == [False, True, True, False]


def _forbid(monkeypatch: pytest.MonkeyPatch, calls: list[str]) -> None:
    """Count the slow calls the fast paths replace (they still run for what needs them)."""
    histc, vector_norm = torch.histc, torch.linalg.vector_norm

    def counted_histc(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append("histc")
        return histc(*args, **kwargs)  # type: ignore[arg-type]

    def counted_vector_norm(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        if kwargs.get("dim") is not None:
            calls.append("vector_norm per unit")
        return vector_norm(x, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "histc", counted_histc)
    monkeypatch.setattr(torch.linalg, "vector_norm", counted_vector_norm)


def test_the_exact_last_step_of_finite_cpu_gradients_skips_histc_and_per_unit_norms(
        monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))  # 8192 and 1024 weights: sampled
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[str] = []
    _forbid(monkeypatch, calls)
    with record_gradients(model, name="m", sample=512) as rec:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(4, 64)).square().sum().backward()
            opt.step()
    assert calls == [] and rec.trace.exact[-1].all()
    w = rec.layer(0).param("weight")
    grad = model[0].weight.grad
    assert sum(w.hist.counts) == grad.numel()
    assert w.hist.counts == pytest.approx(torch.histc(grad, 64, w.hist.lo, w.hist.hi).tolist())
    assert w.mean_abs == pytest.approx(float(grad.abs().mean()), rel=1e-6)
    assert w.dead_units == int((grad.abs().sum(1) == 0).sum())


def test_a_snapshot_with_a_nan_still_takes_histc_for_that_gradient_only(monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    model(torch.ones(2, 4)).sum().backward()
    model[0].weight.grad[0, 0] = math.nan
    calls: list[str] = []
    _forbid(monkeypatch, calls)
    report = grads(model, name="m")
    assert calls.count("histc") == 1  # the gradient with the NaN: its range excludes it
    w = report.layer(0).param("weight")
    assert w.nan == 1 and sum(w.hist.counts) == 11


# -- regressions found in review ---------------------------------------------------------------------

def _sgd_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int, inputs: int,
               after: object = None) -> None:
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(4, inputs, device="cpu")).square().sum().backward()
        opt.step()
        if callable(after):
            after()


def test_a_layer_frozen_while_recording_a_model_again_is_reported_frozen() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record_gradients(model, name="m"):  # remembers the forward order: the next one reuses its layers
        _sgd_steps(model, opt, 1, 4)
    with record_gradients(model, name="m") as rec:
        _sgd_steps(model, opt, 1, 4)
        model[0].requires_grad_(False)
        _sgd_steps(model, opt, 1, 4)
    assert [p.requires_grad for p in rec.trace.params] == [False, False, True, True]
    frozen = [f for f in rec.flags_at(-1) if f.kind == "frozen"]
    assert [f.param for f in frozen] == [0] and "requires_grad=False" in frozen[0].reason


def test_the_fast_paths_allocate_on_the_gradients_device_whatever_the_default_device() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 300), nn.ReLU(), nn.Linear(300, 20))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, 16)).sum().backward()
    expected = grads(model, name="m").layer(0).param("weight")
    with torch.device("meta"):
        snapshot = grads(model, name="m").layer(0).param("weight")
        with record_gradients(model, name="m", sample=512) as rec:
            _sgd_steps(model, opt, 2, 16)
    assert snapshot.hist.counts == expected.hist.counts and snapshot.dead_units == expected.dead_units
    assert rec.trace.exact[-1].all() and sum(rec.layer(0).param("weight").hist.counts) == 300 * 16


@pytest.mark.parametrize("piece", [1 << 18, 64])
def test_binned_leaves_rows_with_values_outside_the_range_or_nans_to_histc(monkeypatch: pytest.MonkeyPatch,
                                                                          piece: int) -> None:
    monkeypatch.setattr(grads_cpu, "PIECE", piece)
    torch.manual_seed(0)
    g = torch.randn(5000)
    with_nan = g.clone()
    with_nan[4999] = math.nan  # in the last piece
    lo, hi = float(g.min()), float(g.max())
    ranges = np.array([[lo, hi], [lo, hi], [lo + 1e-3, hi], [lo, hi - 1e-3]])
    got = grads_cpu.binned([g, with_nan, g, g], 64, ranges)
    assert torch.equal(got[0], torch.histc(g, 64, lo, hi)) and got[1:].isnan().all()


def test_gradients_rescaled_through_data_after_the_last_step_are_binned_as_histc_does() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))  # 8192 weights: sampled
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[tuple[float, float]] = []

    def rescale() -> None:  # .data writes bump no version: the step's min and max still stand
        seen.append((float(model[0].weight.grad.min()), float(model[0].weight.grad.max())))
        for p in model.parameters():
            p.grad.data.mul_(4.0)

    with record_gradients(model, name="m", sample=512) as rec:
        _sgd_steps(model, opt, 2, 64, rescale)
    w = rec.layer(0).param("weight")
    assert (w.hist.lo, w.hist.hi) == pytest.approx(seen[-1], rel=1e-6)
    assert list(w.hist.counts) == torch.histc(model[0].weight.grad, 64, w.hist.lo, w.hist.hi).tolist()
    assert sum(w.hist.counts) < model[0].weight.numel()  # those now outside the step's range are left out


@pytest.fixture
def flush_denormal() -> object:
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


@pytest.mark.usefixtures("flush_denormal")
@pytest.mark.parametrize("bins", [64, 7])
def test_binned_ranges_narrower_than_a_normal_float_count_as_histc_under_flush_denormal(bins: int) -> None:
    top = torch.tensor(3.6046005e-32)
    ulp = torch.full((4800,), float(top))  # two normal values one ulp (a subnormal) apart
    ulp[::2] = torch.nextafter(top, torch.tensor(1.0))
    vanishing = torch.zeros(4800)
    vanishing[:3] = torch.tensor([1e-39, 2e-39, 5e-40])  # flushed to zero: read as such by histc too
    gradients = [ulp, vanishing]
    ranges = np.array([grads_stats._widen(float(g.min()), float(g.max())) for g in gradients])
    expected = torch.stack([torch.histc(g, bins, *r) for g, r in zip(gradients, ranges)])
    assert torch.equal(grads_cpu.binned(gradients, bins, ranges), expected)


def test_histogram_offsets_do_not_wrap_past_int32() -> None:
    params = 33000
    bucket = grads_steps.Bucket(list(range(params)), torch.ones(params), 1, 0)
    offsets = bucket.bin_offsets(64, 1026)  # 64 steps x 33000 parameters x 1026 slots > 2**31
    assert offsets.dtype == torch.int64 and int(offsets.min()) == 0
    assert int(offsets.max()) == (64 * params - 1) * 1026
    assert bucket.bin_offsets(2, 66).dtype == torch.int32  # the fast index where it fits


def test_int64_histogram_offsets_count_as_int32_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    def record() -> tuple[np.ndarray, np.ndarray]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with record_gradients(model, name="m", sample=512, exact_last=False) as rec:
            _sgd_steps(model, opt, 3, 64)
        return rec.trace.hist, rec.trace.stats

    count, dtypes = grads_steps._count, []

    def counted(index: torch.Tensor, size: int) -> torch.Tensor:
        dtypes.append(index.dtype)
        return count(index, size)

    monkeypatch.setattr(grads_steps, "_count", counted)
    narrow = record()
    monkeypatch.setattr(grads_steps, "_INT32_SLOTS", 0)  # every offset int64
    wide = record()
    assert set(dtypes[:len(dtypes) // 2]) == {torch.int32} and set(dtypes[len(dtypes) // 2:]) == {torch.int64}
    assert np.array_equal(narrow[0], wide[0]) and np.array_equal(narrow[1], wide[1], equal_nan=True)


def _raws(steps: int, params: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    raws = []
    for _ in range(steps):
        raw = rng.random((params, len(grads_steps.RAW) + 1))
        raw[:, -1] = 1
        raw[::7, -1], raw[::7, :-1] = 0, math.nan  # absent parameters
        raws.append(raw)
    return raws


def test_raw_to_stats_by_chunks_of_steps_is_the_same_and_bounded_in_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    raws, numel = _raws(2000, 100), np.full(100, 1000.0)
    order = list(range(100))[::-1]
    stats = grads_stats.raw_to_stats(raws, numel, order)  # in one chunk
    monkeypatch.setattr(grads_stats, "_STATS_CHUNK", 700)  # chunks of 7 steps, the last one shorter
    tracemalloc.start()
    try:
        chunked = grads_stats.raw_to_stats(raws, numel, order)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1.25 * stats.nbytes  # the result and one chunk's temporaries, not all steps' at once
    assert np.array_equal(chunked, stats, equal_nan=True)
    has_grad = stats[:, :, grads_stats.FIELD["has_grad"]]
    assert stats.shape == (2000, 100, len(grads_stats.FIELDS)) and (has_grad[:, order[::7]] == 0).all()
    assert has_grad.sum() == 2000 * (100 - len(order[::7]))
    assert grads_stats.raw_to_stats([], numel, order).shape == (0, 100, len(grads_stats.FIELDS))
