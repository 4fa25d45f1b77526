"""What a recording does less of (issue 11), with the same numbers: weight samples reduced right after
each step into two rows, quiet layers flagged without a call each, unpadded blocks binned without their fill."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from torch_nbdebug.api.grads import record_gradients
from torch_nbdebug.data.grads import FIELD
from torch_nbdebug.process import grads as process
from torch_nbdebug.record.grads import steps as grads_steps

from grads_chunks import live_chunks


def _train(model: nn.Module, steps: int, **kwargs: object) -> object:
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, 32)
    with record_gradients(model, name="m", **kwargs) as rec:
        for _ in range(steps):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    return rec


def test_the_weights_samples_of_every_step_take_two_rows_of_a_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step's weights, before and after, are reduced when the step ends: a chunk holds two rows of
    them whatever its number of steps (it held two per step: memory a CPU faults in page by page)."""
    made = live_chunks(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 200), nn.Linear(200, 4))  # 6400 weights: sampled
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 32)
    expected, chunks = [], []
    with record_gradients(model, name="m", sample=1000) as rec:
        for _ in range(5):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            before = model[0].bias.detach().clone()  # 200 elements: taken whole, its ratio exact
            opt.step()
            expected.append(float((model[0].bias.detach() - before).norm() / before.norm()))
            chunks = [c for c in (r() for r in made) if c is not None]
    assert chunks and all(c.capacity >= 5 for c in chunks)
    assert all(c.w is not None and c.w.shape == (2, c.layout.size) for c in chunks)
    ratios = [rec.layer(0, s).param("bias").update_ratio for s in range(5)]
    assert ratios == pytest.approx(expected, rel=1e-5)
    assert np.isfinite(rec.trace.stats[:, :, FIELD["update_ratio"]]).all()


def _all_layers(*args: object) -> np.ndarray:
    trace = args[0]
    return np.ones(len(trace.layers), bool)  # type: ignore[attr-defined]


def test_a_quiet_trace_is_flagged_without_a_call_per_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = _train(nn.Sequential(*(nn.Linear(32, 32) for _ in range(6))), 4)
    calls = []
    findings = process._layer_findings
    monkeypatch.setattr(process, "_layer_findings", lambda *a: calls.append(a[2]) or findings(*a))
    assert process.trace_flags(rec.trace) == () and calls == []  # type: ignore[attr-defined]


@pytest.mark.parametrize("activations", [False, True])
def test_skipping_quiet_layers_finds_every_flag_a_call_per_layer_finds(monkeypatch: pytest.MonkeyPatch,
                                                                       activations: bool) -> None:
    """Traces with frozen, non-finite, dead, exploding, vanishing and growing layers: the same flags,
    in the same order, as when every layer of every step is looked at."""
    base = _train(nn.Sequential(nn.Linear(32, 32), nn.ReLU(), *(nn.Linear(32, 32) for _ in range(5))), 6,
                  activations=activations).trace  # type: ignore[attr-defined]
    rng = np.random.default_rng(0)
    cases = []
    for trial in range(60):
        stats = base.stats.copy()
        n_s, n_p = stats.shape[:2]
        scale = rng.uniform(-12, 7, (n_s, n_p)) if trial % 2 else rng.uniform(-1, 3, (n_s, 1))
        stats[:, :, FIELD["norm"]] *= 10.0 ** scale
        for field, value in (("has_grad", 0), ("nan", 3), ("inf", 1), ("norm", 0.0), ("norm", np.nan),
                             ("dead_units", 1e9), ("norm", np.inf)):
            stats[:, :, FIELD[field]][rng.random((n_s, n_p)) < 0.03] = value
        cases.append(dataclasses.replace(base, stats=stats))
    limits = [process.Thresholds(), process.Thresholds(exploding_norm=1.0, vanishing_rms=1e-3, exploding_growth=2.0)]
    skipped = [process.trace_flags(t, lim) for t in cases for lim in limits]
    monkeypatch.setattr(process, "_loud_layers", _all_layers)
    every = [process.trace_flags(t, lim) for t in cases for lim in limits]
    assert skipped == every and sum(map(len, every)) > 1000
    assert {f.kind for flags in every for f in flags} == {"non-finite", "exploding", "vanishing", "dead", "frozen"}


def test_a_trace_without_layers_has_no_flags() -> None:
    """A trace with no layers (built by hand, or loaded with ``GradTrace.from_dict``) is flagged as empty."""
    from torch_nbdebug.data.grads import GradTrace

    trace = GradTrace(model="m", params=(), layers=(), steps=(0,), stats=np.zeros((1, 0, len(FIELD))),
                      exact=np.zeros((1, 0), bool), hist_rows=(), hist=np.zeros((0, 0, 8)),
                      hist_range=np.zeros((0, 0, 2)), step_kind="optimizer")
    assert process.step_flags(trace, 0) == ()


def test_a_block_without_padding_is_binned_as_a_padded_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows as long as their block need no fill at -inf before the bins: the same counts with it."""
    def model() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(32, 8, bias=False), nn.Linear(8, 32, bias=False))  # 256 weights each

    plain = _train(model(), 3, bins=16).trace  # type: ignore[attr-defined]
    original = grads_steps.Bucket.__init__

    def padded(self: grads_steps.Bucket, *args: object) -> None:
        original(self, *args[:4])  # type: ignore[arg-type]
        assert args[4] is False  # every row fills its block here
        self.padded = True

    monkeypatch.setattr(grads_steps.Bucket, "__init__", padded)
    filled = _train(model(), 3, bins=16).trace  # type: ignore[attr-defined]
    np.testing.assert_array_equal(plain.hist, filled.hist)
    np.testing.assert_array_equal(plain.hist_range, filled.hist_range)
    np.testing.assert_array_equal(plain.stats, filled.stats)
