"""Gradient snapshot: exact statistics of hand-built layers, flag rules on constructed cases, naming."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from torch_nbdebug.api import grads as api
from torch_nbdebug.api.grads import grads, record_gradients
from torch_nbdebug.data.grads import GradTrace
from torch_nbdebug.errors import InputError


def _known_linear() -> nn.Linear:
    """Linear(3→2) whose weight gradient is c^T x = [[1, 0, 3], [-2, 0, -6]] and bias gradient c."""
    layer = nn.Linear(3, 2)
    x = torch.tensor([[1.0, 0.0, 3.0]])
    c = torch.tensor([[1.0, -2.0]])
    (layer(x) * c).sum().backward()
    return layer


def _kinds(report: api.GradReport, layer: int) -> list[str]:
    return [f.kind for f in report.flags_at() if f.layer == layer]


def test_snapshot_exact_statistics_of_a_known_layer() -> None:
    layer = _known_linear()
    report = grads(layer, name="lin", bins=4)
    w = report.layer("lin").param("weight")
    g = np.array([1.0, 0.0, 3.0, -2.0, 0.0, -6.0])
    assert w.norm == pytest.approx(math.sqrt(50.0))
    assert w.mean == pytest.approx(g.mean())
    assert w.std == pytest.approx(g.std(ddof=1))
    assert w.max_abs == 6.0 and w.zeros == 2 and w.nan == 0 and w.inf == 0
    assert w.mean_abs == pytest.approx(2.0)
    assert w.param_norm == pytest.approx(float(layer.weight.detach().norm()))
    assert w.dead_units == 0 and w.exact
    # Range [-6, 3] in 4 bins of 2.25: {-6}, {-2}, {0, 0}, {1, 3}; the top edge is inclusive.
    assert (w.hist.lo, w.hist.hi) == (-6.0, 3.0)
    assert w.hist.counts == (1.0, 1.0, 2.0, 2.0)
    assert np.array_equal(np.histogram(g, bins=4, range=(-6, 3))[0], w.hist.counts)
    b = report.layer("lin").param("bias")
    assert b.norm == pytest.approx(math.sqrt(5.0)) and b.hist.counts == (1.0, 0.0, 0.0, 1.0)


def test_recorded_step_matches_snapshot_for_small_parameters() -> None:
    """The batched per-step path (no host sync) gives the same numbers as the exact snapshot."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    x = torch.randn(9, 5)
    with record_gradients(model, bins=16, exact_last=False) as rec:
        model(x).pow(2).sum().backward()
    snap = grads(model, bins=16)
    assert rec.steps == (0,) and rec.trace.step_kind == "backward"
    for li in range(2):
        for a, b in zip(rec.layer(li).params, snap.layer(li).params):
            assert a.exact
            for field in ("norm", "mean", "std", "max_abs", "mean_abs", "zeros", "nan", "inf", "param_norm"):
                assert getattr(a, field) == pytest.approx(getattr(b, field), rel=1e-5, abs=1e-6), field
            assert a.hist.lo == pytest.approx(b.hist.lo) and a.hist.hi == pytest.approx(b.hist.hi)
            assert np.abs(np.array(a.hist.counts) - np.array(b.hist.counts)).sum() <= 2  # edge rounding
            assert sum(a.hist.counts) == a.info.numel


def test_sampled_statistics_of_a_large_parameter_are_estimates_scaled_to_the_whole() -> None:
    model = nn.Linear(200, 100)
    with record_gradients(model, sample=256, exact_last=False) as rec:
        model(torch.randn(4, 200)).sum().backward()
    w = rec.layer(0).param("weight")
    assert not w.exact and w.hist is not None
    assert sum(w.hist.counts) == pytest.approx(20000)  # 256 sampled values, scaled by 20000/256
    assert w.norm == pytest.approx(float(model.weight.grad.norm()), rel=1e-5)  # norms are always exact
    assert w.max_abs == pytest.approx(float(model.weight.grad.abs().max()))
    assert any("estimated from a fixed random sample" in n for n in rec.trace.notes)


def test_flags_a_dead_relu_layer() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].bias.fill_(-100.0)  # every pre-activation negative: the ReLU never fires
    model(torch.randn(16, 4)).sum().backward()
    report = grads(model)
    dead = [f for f in report.flags_at() if f.kind == "dead"]
    assert {f.layer for f in dead} == {0, 1}
    assert "all 32 gradient values of weight are zero" in next(f.reason for f in dead if f.layer == 0)
    assert report.start_layer == 0


def test_flags_dead_units_in_part_of_a_layer() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].bias[:6] = -100.0  # 6 of 8 units dead
    model(torch.randn(16, 4)).sum().backward()
    reason = next(f.reason for f in grads(model).flags_at() if f.kind == "dead" and f.layer == 0)
    assert reason.startswith("6 of 8 units of weight")


class _GradScale(torch.autograd.Function):
    """Identity forward; multiplies the gradient flowing back (so only the layers before it see it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class GradScale(nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GradScale.apply(x, self.factor)


def test_flags_an_exploding_layer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), GradScale(1e6), nn.Linear(4, 1))
    model(torch.randn(8, 4)).sum().backward()
    report = grads(model)
    assert _kinds(report, 0) == ["exploding"]
    assert "exploding" not in _kinds(report, 1)
    assert "≥ 1000" in next(f.reason for f in report.flags_at() if f.layer == 0)


def test_flags_a_vanishing_layer() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), GradScale(1e-12), nn.Linear(4, 1))
    model(torch.randn(8, 4)).sum().backward()
    assert _kinds(grads(model), 0) == ["vanishing"]


def test_flags_frozen_layers_with_no_gradient() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.frozen = nn.Linear(3, 3)
            self.used = nn.Linear(3, 1)
            self.unused = nn.Linear(3, 1)
            self.frozen.requires_grad_(False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(self.frozen(x))

    net = Net()
    net(torch.randn(2, 3)).sum().backward()
    report = grads(net)
    reasons = {f.layer: f.reason for f in report.flags_at() if f.kind == "frozen"}
    assert set(reasons) == {0, 2}
    assert "requires_grad=False" in reasons[0]
    assert "did not take part in the loss" in reasons[2]
    assert report.layer("net.frozen").params[0].has_grad is False
    assert report.layer("frozen").params[0].norm is None


def test_flags_non_finite_gradients_with_counts() -> None:
    layer = _known_linear()
    layer.weight.grad[0, 1] = float("nan")
    layer.weight.grad[1, 1] = float("inf")
    report = grads(layer, name="lin")
    w = report.layer(0).param("weight")
    assert (w.nan, w.inf) == (1, 1)
    assert w.max_abs == 6.0  # over the finite values
    flag = next(f for f in report.flags_at() if f.kind == "non-finite")
    assert flag.reason == "weight gradient has 1 NaN and 1 Inf values out of 6"
    assert sum(w.hist.counts) == 4  # NaN and Inf are not binned


def test_non_finite_seen_even_when_the_sample_misses_it() -> None:
    model = nn.Linear(300, 300)
    with record_gradients(model, sample=64, exact_last=False) as rec:
        model(torch.randn(2, 300)).sum().backward()
        model.weight.grad.view(-1)[12345] = float("nan")
        model.weight.grad.view(-1)[12346] = -float("inf")
        model(torch.randn(2, 300)).sum().backward()  # accumulates: NaN stays NaN
    w = rec.layer(0, step=-1).param("weight")
    assert w.nan >= 1
    assert [f.kind for f in rec.flags_at(-1)] == ["non-finite"]


def test_name_comes_from_the_caller_and_layers_accept_short_names() -> None:
    net = _known_linear()
    report = grads(net)
    assert report.layer_names == ("net",)
    seq = nn.Sequential(nn.Linear(2, 2))
    seq(torch.ones(1, 2)).sum().backward()
    assert grads(seq).layer_names == ("seq.0",)
    assert grads(seq, layer="0").start_layer == 0
    with pytest.raises(InputError, match="no layer 'nope'"):
        grads(seq, layer="nope")


def test_html_escapes_module_names_and_ships_static_images() -> None:
    model = nn.ModuleDict({"<b>x</b>": nn.Linear(2, 2)})
    model["<b>x</b>"](torch.ones(1, 2)).sum().backward()
    report = grads(model, name="m")
    page = report.html()
    assert "<b>x</b>" not in page and "m.&lt;b&gt;x&lt;/b&gt;" in page
    assert 'class="tnd-figure tnd-flow"' in page and 'class="tnd-figure tnd-hist"' in page
    assert "m.<b>x</b>" in report.text()


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(InputError, match="needs an nn.Module"):
        grads(3.0)  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"run loss.backward\(\) first"):
        grads(nn.Linear(2, 2))
    with pytest.raises(InputError, match="no parameters"):
        grads(nn.ReLU())
    with pytest.raises(InputError, match="sample must be"):
        record_gradients(nn.Linear(2, 2), sample=0)


def test_nanwatch_birth_opens_the_stepper_at_that_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from torch_nbdebug.api import nanwatch

    net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2), nn.Linear(2, 1))
    net(torch.ones(1, 2)).sum().backward()
    report = types.SimpleNamespace(first=types.SimpleNamespace(module="net.2"))
    monkeypatch.setattr(nanwatch, "last_report", lambda: report, raising=False)
    assert grads(net).start_layer == 1
    report.first.module = "other.2"  # a birth in another model: no jump
    assert grads(net).start_layer == 0
    assert grads(net, layer="net.3").start_layer == 2  # an explicit layer wins


def test_the_opening_layer_is_the_birth_known_when_the_report_was_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flags are judged when first read (the view's first look), but the layer of the last nanwatch
    birth is looked up when the report is made: a later watch does not move where the stepper opens."""
    import types

    from torch_nbdebug.api import nanwatch

    net = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 2), nn.Linear(2, 1))
    net(torch.ones(1, 2)).sum().backward()
    report = types.SimpleNamespace(first=types.SimpleNamespace(module="net.2"))
    monkeypatch.setattr(nanwatch, "last_report", lambda: report, raising=False)
    made = grads(net)
    report.first.module = "net.3"  # a later watch's birth
    assert made.start_layer == 1 and grads(net).start_layer == 2
    with record_gradients(net) as rec:
        net(torch.ones(1, 2)).sum().backward()
    report.first.module = "net.0"
    assert rec.start_layer == 2
    from torch_nbdebug.process.grads import trace_flags

    assert rec.flags == trace_flags(rec.trace, rec._limits)  # judged on first read, as at the block's end before


def test_trace_round_trips_through_json() -> None:
    layer = _known_linear()
    layer.weight.grad[0, 0] = float("nan")
    trace = grads(layer, name="lin").trace
    back = GradTrace.from_json(trace.to_json())
    assert back.layer_names == trace.layer_names and back.params == trace.params
    np.testing.assert_array_equal(back.stats, trace.stats)
    np.testing.assert_array_equal(back.hist, trace.hist)


def test_backward_and_optimizer_births_link_through_their_module_or_parameter(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from torch_nbdebug.api import nanwatch

    net = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
    net(torch.ones(1, 2)).sum().backward()
    first = types.SimpleNamespace(module=None, forward_module="net.1", param=None)
    monkeypatch.setattr(nanwatch, "last_report", lambda: types.SimpleNamespace(first=first))
    assert grads(net).start_layer == 1
    first.forward_module, first.param = None, "net.1.bias"  # an optimizer birth names the parameter
    assert grads(net).start_layer == 1
    monkeypatch.setattr(nanwatch, "last_report", lambda: None)
    assert grads(net).start_layer == 0


def test_a_real_nanwatch_report_opens_the_stepper_where_the_inf_was_born(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_nbdebug.api import nanwatch as nanwatch_api
    from torch_nbdebug.api.nanwatch import nanwatch

    # Restore nanwatch's "last report" afterwards, so later tests do not open at this birth.
    monkeypatch.setattr(nanwatch_api, "_last", nanwatch_api.last_report())

    net = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 3), nn.Linear(3, 1), nn.Linear(1, 1))
    with torch.no_grad():
        net[0].weight.fill_(1.0)  # deterministic: net.0 outputs 2s, whatever the RNG state
        net[0].bias.zero_()
        net[1].weight.fill_(3e38)  # net.1's matmul overflows to inf (3e38 * 6)
    with nanwatch():
        net(torch.ones(4, 2)).sum().backward()
    report = grads(net)
    assert report.start_layer == 1
    assert report.widget().layer == 1


def test_unused_embedding_rows_are_not_dead_units() -> None:
    model = nn.Sequential(nn.Embedding(100, 4), nn.Linear(4, 1))
    model(torch.tensor([1, 2, 3])).sum().backward()
    report = grads(model)
    assert report.layer(0).param("weight").dead_units == 97
    assert not report.flags_at()


def test_zeros_of_a_large_gradient_are_counted_exactly_in_snapshots_and_exact_last_steps() -> None:
    """From 2**20 elements the non-zeros are counted by count_nonzero, not a float32 "0-norm": still
    exact, a NaN counted as non-zero, dead units unchanged."""
    model = nn.Linear(1024, 1024, bias=False)
    g = torch.randn(1024, 1024)
    g[:3] = 0.0
    g[5, :10] = 0.0
    g[6, 7] = math.nan
    model.weight.register_hook(lambda _: g.clone())
    with record_gradients(model) as rec:
        model(torch.ones(1, 1024)).sum().backward()
    for w in (grads(model).layer(0).param("weight"), rec.layer(0).param("weight")):
        assert (w.zeros, w.nan, w.inf, w.dead_units) == (3 * 1024 + 10, 1, 0, 3) and w.exact
        assert sum(w.hist.counts) == 1024 * 1024 - 1
