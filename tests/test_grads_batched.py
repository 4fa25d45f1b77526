"""The batched paths of record_gradients against direct per-parameter computations: samples of many
lengths laid out in padded blocks, the weights' sample reused across steps only when unchanged, and
the per-layer aggregates of every layer at once."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from torch import nn

from host_syncs import counting_host_syncs, setup, step
from torch_nbdebug.api.grads import record_gradients
from torch_nbdebug.data.grads import FIELD
from torch_nbdebug.process.grads import layer_arrays
from torch_nbdebug.record.grads import recorder as rec_mod


def _finite(t: torch.Tensor) -> torch.Tensor:
    return t[torch.isfinite(t)]


def test_parameters_of_many_lengths_and_padding_give_each_parameter_its_own_statistics() -> None:
    """Lengths 1..600 fall in blocks padded to 256 and 512 elements: the padding must count nowhere."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 1), nn.Linear(1, 300), nn.Linear(300, 2))  # 3, 1, 300, 300, 600, 2
    grads = {0: torch.randn(1, 3), 2: torch.randn(300, 1), 3: torch.randn(300), 5: torch.randn(2)}
    grads[2][0, 0], grads[2][1, 0], grads[2][2, 0], grads[2][3:9, 0] = math.nan, math.inf, -math.inf, 0.0
    grads[3][:5] = 0.0
    grads[5][:] = 0.0  # all zero: a histogram range is still made around the value
    params = list(model.parameters())
    for i, g in grads.items():
        params[i].register_hook(lambda _, g=g: g)
    with record_gradients(model, sample=512, bins=8, exact_last=False) as rec:
        model(torch.randn(4, 3)).sum().backward()
    stats = rec.trace.stats[0]
    for i, g in grads.items():
        name = rec.trace.params[i].name
        finite = _finite(g)
        assert rec.trace.exact[0, i], name
        assert stats[i, FIELD["nan"]] == int(torch.isnan(g).sum()), name
        assert stats[i, FIELD["inf"]] == int(torch.isinf(g).sum()), name
        assert stats[i, FIELD["zeros"]] == int((g == 0).sum()), name
        assert stats[i, FIELD["mean_abs"]] == pytest.approx(float(finite.abs().mean()), rel=1e-6, abs=1e-12), name
        hist = rec.layer(rec.trace.params[i].layer).param(rec.trace.params[i].short.split(".")[-1]).hist
        assert hist is not None and sum(hist.counts) == finite.numel(), name
        lo, hi = float(finite.min()), float(finite.max())
        if hi > lo:
            assert (hist.lo, hist.hi) == pytest.approx((lo, hi)), name
        else:  # a constant: the range is centred on it
            assert hist.lo < lo and hist.hi > hi and hist.counts[3:5] in ((0.0, finite.numel()), (finite.numel(), 0.0))
        expected = torch.histc(finite.double(), 8, hist.lo, hist.hi)
        assert list(hist.counts) == pytest.approx(expected.tolist()), name
    big = params[4].grad
    assert not rec.trace.exact[0, 4]
    assert (stats[4, FIELD["min"]], stats[4, FIELD["max"]]) == (float(big.min()), float(big.max()))
    assert sum(rec.layer(2).param("weight").hist.counts) == pytest.approx(600)


def _ratio(before: torch.Tensor, after: torch.Tensor) -> float:
    return float((after - before).norm() / before.norm())


@pytest.mark.parametrize("touch", [False, True, "data"])
def test_update_ratio_is_measured_from_the_weights_the_step_started_from(touch: object) -> None:
    """The weights sampled after a step serve as the next step's "before" only while unchanged: a
    change between steps (here a clamp the user applies) must not count in the next update ratio."""
    torch.manual_seed(0)
    model = nn.Linear(6, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(8, 6)
    expected = []
    with record_gradients(model) as rec:
        for _ in range(3):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            before = model.weight.detach().clone()
            opt.step()
            expected.append(_ratio(before, model.weight.detach()))
            if touch == "data":  # through .data: no version counter moves (weight clipping, EMA swaps)
                model.weight.data.mul_(0.5)
            elif touch:
                with torch.no_grad():
                    model.weight.mul_(0.5)
    ratios = [rec.layer(0, s).param("weight").update_ratio for s in range(3)]
    assert ratios == pytest.approx(expected, rel=1e-5)


def _reference_layers(trace: object) -> dict[str, np.ndarray]:
    """Per-layer aggregates one layer and one step at a time, straight from their definitions."""
    st = trace.stats  # type: ignore[attr-defined]
    n_s, n_l = st.shape[0], len(trace.layers)  # type: ignore[attr-defined]
    out = {k: np.full((n_s, n_l), np.nan) for k in ("norm", "numel", "max_abs", "mean_abs", "update_ratio")}
    for s in range(n_s):
        for li, layer in enumerate(trace.layers):  # type: ignore[attr-defined]
            ps = [p for p in layer.params if st[s, p, FIELD["has_grad"]] > 0]
            if not ps:
                continue
            numel = [trace.params[p].numel for p in ps]  # type: ignore[attr-defined]
            out["numel"][s, li] = sum(numel)
            out["norm"][s, li] = math.sqrt(sum(st[s, p, FIELD["norm"]] ** 2 for p in ps))
            out["max_abs"][s, li] = max(st[s, p, FIELD["max_abs"]] for p in ps)
            out["mean_abs"][s, li] = sum(st[s, p, FIELD["mean_abs"]] * n for p, n in zip(ps, numel)) / sum(numel)
            known = [p for p in ps if not math.isnan(st[s, p, FIELD["update_ratio"]])]
            if known:  # ‖Δw‖ = ratio·‖w‖ per parameter; an undefined one (∞·0: w was 0) is left out
                with np.errstate(invalid="ignore"):
                    moved2 = [(st[s, p, FIELD["update_ratio"]] * st[s, p, FIELD["param_norm"]]) ** 2 for p in known]
                moved = math.sqrt(sum(m for m in moved2 if not math.isnan(m)))
                size = math.sqrt(sum(st[s, p, FIELD["param_norm"]] ** 2 for p in ps))
                out["update_ratio"][s, li] = moved / max(size, 1e-30)
    return out


def test_layer_aggregates_of_all_layers_at_once_match_each_layer_alone() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record_gradients(model) as rec:
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(5, 4)).sum().backward()
            opt.step()
    st = rec.trace.stats.copy()
    st[1, 0, FIELD["has_grad"]] = 0           # a parameter without a gradient at one step
    st[2, 3, FIELD["update_ratio"]] = np.nan  # an unknown update ratio
    st[3, 4:, FIELD["has_grad"]] = 0          # a whole layer without gradients
    trace = dataclasses.replace(rec.trace, stats=st)
    got, expected = layer_arrays(trace), _reference_layers(trace)
    for key, values in expected.items():
        np.testing.assert_allclose(got[key], values, rtol=1e-12, equal_nan=True, err_msg=key)
    assert np.isnan(got["norm"][3, 2]) and not np.isnan(got["norm"][3, 0])  # the layer without gradients


def test_blocks_already_in_parameter_order_keep_every_parameter() -> None:
    """A sampled weight (block of 512) then its bias (block of 256): two blocks, no reordering needed."""
    torch.manual_seed(0)
    model = nn.Linear(300, 2)
    with record_gradients(model, sample=512, bins=8, exact_last=False) as rec:
        model(torch.randn(3, 300)).sum().backward()
    weight, bias = rec.layer(0).param("weight"), rec.layer(0).param("bias")
    assert sum(weight.hist.counts) == pytest.approx(600) and not weight.exact
    assert sum(bias.hist.counts) == 2 and bias.exact and bias.hist.lo < 3.0 < bias.hist.hi


def test_steps_reduced_a_few_at_a_time_give_the_same_trace_and_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU the kept steps are reduced in cache-sized chunks: same numbers, same single copy per flush."""
    def run() -> tuple[object, int]:
        model, opt, idx = setup()
        with counting_host_syncs() as counted:
            with record_gradients(model, name="m") as rec:
                for _ in range(5):
                    step(model, opt, idx)
        return rec.trace, counted.count

    whole, copies = run()
    monkeypatch.setattr(rec_mod, "_CPU_CHUNK", 1)  # every step alone
    chunked, chunked_copies = run()
    assert chunked_copies == copies
    np.testing.assert_allclose(chunked.stats, whole.stats, rtol=1e-6, equal_nan=True)  # type: ignore[attr-defined]
    np.testing.assert_array_equal(chunked.hist, whole.hist)  # type: ignore[attr-defined]


@pytest.mark.parametrize("mixed", [False, True])
def test_double_precision_parameters_are_recorded(mixed: bool) -> None:
    """A float64 model (scientific code, gradient checks) — alone or next to float32 layers — is recorded
    with the right norms; accumulating its norms in float32 used to raise inside the recorder."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3).double(), nn.Tanh(), nn.Linear(3, 2).double())
    if mixed:
        model[2].float()
    x = torch.randn(4, 5, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record_gradients(model) as rec:
        for _ in range(2):
            opt.zero_grad()
            out = model[2](model[1](model[0](x)).to(model[2].weight.dtype))
            out.pow(2).sum().backward()
            opt.step()
    last = rec.layer(1, 1).param("weight")  # layers with parameters: model.0 and model.2
    assert last.norm == pytest.approx(float(model[2].weight.grad.norm()), rel=1e-5)
    assert rec.layer(0, 1).param("weight").norm == pytest.approx(float(model[0].weight.grad.norm()), rel=1e-5)


def test_rows_written_again_after_a_flush_give_the_trace_of_one_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps write their samples into rows allocated ahead, and a flushed chunk is written again by
    the next steps: flushing every 2 steps (and reducing one step at a time) must give the numbers
    of a single flush at the end, update ratios included."""
    def run() -> object:
        model, opt, idx = setup()
        with record_gradients(model, name="m") as rec:
            for _ in range(7):
                step(model, opt, idx)
        return rec.trace

    once = run()
    monkeypatch.setattr(rec_mod, "_FLUSH", 2)
    monkeypatch.setattr(rec_mod, "_CPU_CHUNK", 1)
    often = run()
    assert often.steps == once.steps == tuple(range(7))  # type: ignore[attr-defined]
    np.testing.assert_allclose(often.stats, once.stats, rtol=1e-6, equal_nan=True)  # type: ignore[attr-defined]
    np.testing.assert_array_equal(often.hist, once.hist)  # type: ignore[attr-defined]
    assert not np.isnan(often.stats[:, :, FIELD["update_ratio"]]).any()  # type: ignore[attr-defined]
