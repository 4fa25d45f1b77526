"""record_gradients over training loops: steps, update ratios, forward order, cleanup, no leaks."""
from __future__ import annotations

import gc
import math
import weakref

import numpy as np
import pytest
import torch
from torch import nn

from torch_nbdebug.api.grads import grads, record_gradients
from torch_nbdebug.data.grads import FIELD
from torch_nbdebug.errors import InputError
from torch_nbdebug.record.grads import recorder as rec_mod
from torch_nbdebug.record.grads import steps as grads_steps
from torch_nbdebug.record.grads.steps import sample_indices

from grads_chunks import live_chunks


class Reordered(nn.Module):
    """Registered head-first, run tail-first: forward order differs from registration order."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(6, 2)
        self.body = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def _hooks_left(model: nn.Module) -> int:
    count = 0
    for m in model.modules():
        count += len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks)
    for p in model.parameters():
        count += len(p._post_accumulate_grad_hooks or {})
    return count


def test_sgd_update_ratio_matches_a_hand_computation() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(5, 3), torch.randn(5, 2)
    expected = []
    with record_gradients(model, name="lin") as rec:
        for _ in range(4):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            w, g = model.weight.detach().clone(), model.weight.grad.clone()
            expected.append((float((0.1 * g).norm() / w.norm()), float(g.norm()), float(w.norm())))
            opt.step()
    trace = rec.trace
    assert trace.steps == (0, 1, 2, 3) and trace.step_kind == "optimizer"
    for step, (ratio, gnorm, wnorm) in enumerate(expected):
        w = rec.layer("lin", step).param("weight")
        assert w.update_ratio == pytest.approx(ratio, rel=1e-5)
        assert w.norm == pytest.approx(gnorm, rel=1e-6)
        assert w.param_norm == pytest.approx(wnorm, rel=1e-6)
    assert _hooks_left(model) == 0


def test_steps_are_backward_passes_without_an_optimizer_and_steps_with_one() -> None:
    model = nn.Linear(2, 2)
    x = torch.ones(3, 2)
    with record_gradients(model) as rec:
        for _ in range(3):
            model.zero_grad()
            model(x).sum().backward()
    assert rec.steps == (0, 1, 2) and rec.trace.step_kind == "backward"
    # Gradient accumulation: 2 backwards per optimizer step, 3 steps → 3 rows of accumulated grads.
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with record_gradients(model) as rec:
        for _ in range(3):
            opt.zero_grad()
            model(x).sum().backward()
            model(x).sum().backward()
            opt.step()
    assert rec.steps == (0, 1, 2) and rec.trace.step_kind == "optimizer"
    bias = rec.layer(0, 2).param("bias")
    assert bias.norm == pytest.approx(math.sqrt(2) * 6.0)  # d(sum)/db = 3 rows, accumulated twice


def test_an_optimizer_over_other_parameters_is_not_a_step() -> None:
    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with record_gradients(model) as rec:
        for _ in range(2):
            (model(torch.ones(1, 2)).sum() + other(torch.ones(1, 2)).sum()).backward()
            opt.step()
    assert rec.trace.step_kind == "backward" and len(rec.steps) == 2


def test_layers_follow_forward_order_and_snapshots_remember_it() -> None:
    model = Reordered()
    model(torch.randn(2, 4)).sum().backward()
    assert grads(model).layer_names == ("model.head", "model.body")  # no forward seen: registration order
    with record_gradients(model) as rec:
        model(torch.randn(2, 4)).sum().backward()
    assert rec.layer_names == ("model.body", "model.head") and rec.trace.order == "forward"
    assert rec.layer("model.head").params[0].info.shape == (2, 6)
    assert grads(model).layer_names == ("model.body", "model.head")


class Late(nn.Module):
    """A layer that first runs at the third call."""

    def __init__(self) -> None:
        super().__init__()
        self.late, self.body, self.calls = nn.Linear(4, 4), nn.Linear(4, 2), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.body(self.late(x) if self.calls >= 3 else x)


def _pre_hooks(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) for m in model.modules())


def test_the_forward_order_hooks_go_once_every_layer_ran() -> None:
    """They only learn the order: once every layer has run they are off (each costs a module call its fast
    path), and a layer first run later still finds its place."""
    model = Late()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record_gradients(model) as rec:
        hooked = []
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            hooked.append(_pre_hooks(model))
    assert hooked == [2, 2, 0, 0]  # off at the step after the late layer's first run
    assert rec.layer_names == ("model.body", "model.late") and rec.trace.order == "forward"
    late = [p.name for p in rec.trace.params].index("model.late.weight")
    assert rec.trace.stats[:, late, FIELD["has_grad"]].tolist() == [0, 0, 1, 1]  # no gradient before it ran


def test_hooks_removed_and_user_exception_unchanged() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    was_training = model.training
    with pytest.raises(KeyError, match="boom"):
        with record_gradients(model, activations=True):
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
            raise KeyError("boom")
    assert _hooks_left(model) == 0
    assert model.training == was_training
    assert torch.is_grad_enabled()


def test_keeps_no_tensors_alive() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record_gradients(model, activations=True, sample=16) as rec:
        for _ in range(2):
            opt.zero_grad()
            out = model(torch.randn(4, 8))
            out.sum().backward()
            opt.step()
    refs = [weakref.ref(model), weakref.ref(model[0].weight), weakref.ref(model[0].weight.grad), weakref.ref(out)]
    widget = rec.widget()  # building the views must not hold tensors either
    del model, opt, out
    gc.collect()
    assert [r() for r in refs] == [None] * 4
    assert rec.layer(0).params[0].norm is not None and widget.layer == 0


def test_activation_statistics_find_dead_relu_inputs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].bias[:5] = -100.0  # 5 of 8 hidden units never fire
    x = torch.randn(32, 4)
    with record_gradients(model, activations=True) as rec:
        model(x).sum().backward()
        with torch.no_grad():
            model(torch.zeros(1, 4))  # an evaluation pass must not overwrite the training statistics
    act = rec.layer(1).activation
    assert act["in_dead_features"] == 5 and act["in_features"] == 8
    hidden = torch.relu(model[0](x))
    assert act["in_zero_frac"] == pytest.approx(float((hidden == 0).float().mean()))
    out = model(x).detach()
    assert act["out_mean"] == pytest.approx(float(out.mean()), rel=1e-5)
    assert act["out_std"] == pytest.approx(float(out.std()), rel=1e-5)
    reasons = [f.reason for f in rec.flags_at() if f.kind == "dead" and f.layer == 1]
    assert reasons and "5 of 8 input features are zero" in reasons[0]


def test_last_step_is_made_exact_when_its_gradients_remain() -> None:
    model = nn.Linear(100, 100)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record_gradients(model, sample=32) as rec:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(2, 100)).sum().backward()
            opt.step()
    assert rec.trace.exact[:, 0].tolist() == [False, False, True]
    w = rec.layer(0).param("weight")
    assert w.zeros == int((model.weight.grad == 0).sum()) and sum(w.hist.counts) == 10000
    assert w.update_ratio is not None  # kept from the sampled step
    with record_gradients(model, sample=32) as rec:
        opt.zero_grad()
        model(torch.randn(2, 100)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients zeroed in place: the last step cannot be redone
    assert rec.trace.exact[:, 0].tolist() == [False]


def test_many_steps_flush_and_thin_histograms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rec_mod, "_FLUSH", 4)
    monkeypatch.setattr(rec_mod, "_MAX_HISTS", 8)
    model = nn.Linear(2, 2)
    with record_gradients(model, exact_last=False) as rec:
        for _ in range(30):
            model.zero_grad()
            model(torch.ones(1, 2)).sum().backward()
    trace = rec.trace
    assert trace.steps == tuple(range(30))
    assert len(trace.hist_rows) <= 8 and all(trace.steps[r] % 4 == 0 for r in trace.hist_rows)
    assert np.all(trace.stats[:, :, FIELD["has_grad"]] == 1)
    assert rec.layer(0, step=5).params[0].hist is None and rec.layer(0, step=8).params[0].hist is not None


def test_results_before_the_block_ends_say_so() -> None:
    model = nn.Linear(2, 2)
    recording = record_gradients(model)
    with recording:
        with pytest.raises(InputError, match="still running"):
            recording.text()
    with pytest.raises(InputError, match="already used"):
        with recording:
            pass


def test_nothing_recorded_still_displays() -> None:
    model = nn.Linear(2, 2)
    with record_gradients(model) as rec:
        model(torch.ones(1, 2))
    assert rec.steps == ()
    assert "nothing recorded" in rec.text()
    bundle = rec._repr_mimebundle_()
    assert "text/html" in bundle and "application/vnd.jupyter.widget-view+json" in bundle


def test_a_recorder_failure_never_breaks_training(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("stats exploded")

    monkeypatch.setattr(rec_mod, "sampled_rows", broken)
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model.weight.detach().clone()
    with record_gradients(model) as rec:
        for _ in range(2):
            opt.zero_grad()
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
    assert not torch.equal(before, model.weight.detach())  # training went on
    assert rec.steps == () and "recording stopped at step 0: RuntimeError: stats exploded" in rec.trace.notes[0]
    assert _hooks_left(model) == 0


def test_sparse_gradients_are_skipped_with_a_note() -> None:
    model = nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Linear(3, 1))
    with record_gradients(model) as rec:
        model(torch.tensor([1, 2])).sum().backward()
    assert rec.layer("model.1").params[0].has_grad and not rec.layer("model.0").params[0].has_grad
    assert any("sparse, complex or integer gradients not analysed: model.0.weight" in n for n in rec.trace.notes)


@pytest.mark.cuda
def test_cuda_steps_never_synchronise_with_the_host() -> None:
    """After the first step (device constants built once), recorded steps queue work only."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64, device="cuda")

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    with record_gradients(model, sample=128, activations=True) as rec:
        step()
        step()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert rec.steps == (0, 1, 2, 3, 4) and rec.trace.step_kind == "optimizer"
    w = rec.layer(0, 2).param("weight")
    assert w.norm > 0 and w.update_ratio is not None and not w.exact


def test_statistics_are_those_the_optimizer_applies_after_clipping() -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with record_gradients(model) as rec:
        for _ in range(2):
            opt.zero_grad()
            model(torch.ones(3, 4)).sum().backward()
            nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            opt.step()
    layer = rec.layer(0, 0)
    assert layer.norm == pytest.approx(0.5, rel=1e-4)  # the first step too, though its backward was seen unclipped
    assert rec.layer(0, 1).norm == pytest.approx(0.5, rel=1e-4)
    assert rec.params[0].name == "model.weight" and rec.to_json().startswith("{")


def test_half_precision_gradients_do_not_overflow_their_norm() -> None:
    model = nn.Linear(64, 64).half()
    with record_gradients(model, exact_last=False) as rec:
        model(torch.full((16, 64), 100.0, dtype=torch.float16)).float().sum().backward()
    w = rec.layer(0).param("weight")  # each value 1600, 4096 of them: norm 102400 > fp16 max 65504
    assert w.norm == pytest.approx(102400.0, rel=1e-3) and w.nan == 0 and w.inf == 0
    assert not [f for f in rec.flags_at() if f.kind == "non-finite"]
    assert grads(model).layer(0).param("weight").norm == pytest.approx(102400.0, rel=1e-3)


def test_the_exact_last_step_equals_a_snapshot_of_the_same_gradients() -> None:
    """The last step's whole parameters come from its sample, the sampled ones from a pass over every
    element that reuses the norm, sum, min and max measured at the step: every statistic is still the
    snapshot's, for gradients with NaN and Inf (taken over their finite values) and nearly constant ones
    (float64 variance) too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 30), nn.Linear(30, 20), nn.Linear(20, 3))  # weights of 1200 and 600: sampled
    fixed = {0: torch.randn(30, 40), 3: torch.randn(20), 5: 1.0 + 1e-5 * torch.randn(3), 4: torch.randn(3, 20)}
    fixed[0][0, :3] = torch.tensor([math.nan, math.inf, -math.inf])  # sampled, with non-finite values
    fixed[3][:4] = torch.tensor([math.nan, math.inf, 0.0, 0.0])  # whole, with non-finite values and zeros
    fixed[4][1] = 0.0  # a dead unit of a whole matrix
    params = list(model.parameters())
    for i, g in fixed.items():
        params[i].register_hook(lambda _, g=g: g.clone())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with record_gradients(model, sample=256, bins=16) as rec:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(4, 40)).sum().backward()
            opt.step()
    snap = grads(model, bins=16)
    assert rec.trace.exact[-1].all() and not rec.trace.exact[0, 0]
    fields = ("norm", "mean", "std", "max_abs", "mean_abs", "zeros", "nan", "inf", "dead_units")
    for li in range(3):
        for a, b in zip(rec.layer(li).params, snap.layer(li).params):
            for field in fields:
                got, want = getattr(a, field), getattr(b, field)  # None: unknown (a vector's dead units)
                assert (got is None and want is None) or got == pytest.approx(want, rel=1e-5, abs=1e-9), \
                    (a.name, field, got, want)
            assert (a.hist.lo, a.hist.hi) == pytest.approx((b.hist.lo, b.hist.hi)), a.name
            assert np.abs(np.array(a.hist.counts) - np.array(b.hist.counts)).sum() <= 2, a.name  # edge rounding
            assert sum(a.hist.counts) == sum(b.hist.counts), a.name
    assert rec.layer(2).param("bias").std == pytest.approx(float(fixed[5].double().std()), rel=1e-4)
    assert rec.layer(2).param("weight").dead_units == 1
    assert rec.layer(1).param("bias").mean == pytest.approx(float(fixed[3][2:].mean()), rel=1e-5)


def test_recordings_of_one_model_sample_the_same_elements() -> None:
    """The sampled elements are drawn once per size and reused: two recordings of the same gradient
    give the same estimates, and a parameter of another size its own sample."""
    model = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 90))
    fixed = [torch.randn(100, 100), torch.randn(90, 100)]
    for layer, g in zip(model, fixed):
        layer.weight.register_hook(lambda _, g=g: g.clone())
    traces = []
    for _ in range(2):
        model.zero_grad()
        with record_gradients(model, sample=64, bins=8, exact_last=False) as rec:
            model(torch.randn(2, 100)).sum().backward()
        traces.append(rec.trace)
    np.testing.assert_array_equal(traces[0].stats, traces[1].stats)
    np.testing.assert_array_equal(traces[0].hist, traces[1].hist)
    sampled = [rec.layer(i).param("weight").mean_abs for i in range(2)]
    expected = [float(g.reshape(-1)[torch.tensor(sample_indices(g.numel(), 64))].abs().mean())
                for g in fixed]
    assert sampled == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("default", [torch.float16, torch.bfloat16, torch.float64])
def test_statistics_do_not_depend_on_the_default_dtype(default: torch.dtype) -> None:
    """A session that set another default dtype (``torch.set_default_dtype(torch.bfloat16)`` before
    building a model) records a float32 model exactly as a float32 session does: the samples are kept
    in float32, not cast to the default dtype (Inf in float16, 3 digits in bfloat16)."""
    def run(dtype: torch.dtype) -> object:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 3000))
        model[2].weight.register_hook(lambda g: g * 1e5)  # beyond float16, finite in float32
        opt = torch.optim.SGD(model.parameters(), lr=1e-10)
        x = torch.randn(8, 32)
        torch.set_default_dtype(dtype)
        try:
            with record_gradients(model, name="m", sample=256, bins=8) as rec:
                for _ in range(3):
                    opt.zero_grad()
                    model(x).pow(2).sum().backward()
                    opt.step()
        finally:
            torch.set_default_dtype(torch.float32)
        return rec.trace

    want, got = run(torch.float32), run(default)
    np.testing.assert_array_equal(got.stats, want.stats)  # type: ignore[attr-defined]
    np.testing.assert_array_equal(got.hist, want.hist)  # type: ignore[attr-defined]
    assert got.stats[0, 2, FIELD["inf"]] == 0  # type: ignore[attr-defined]  # step 0: from the sample


def test_histogram_counts_do_not_depend_on_the_default_dtype() -> None:
    """Counted in float32 whatever the default dtype: a float16 count stops growing at 2048 (one bin
    here, to hold every element)."""
    def run(dtype: torch.dtype) -> np.ndarray:
        torch.manual_seed(0)
        model = nn.Linear(64, 64, bias=False)  # 4096 elements: taken whole by the sample
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        torch.set_default_dtype(dtype)
        try:
            with record_gradients(model, name="m", bins=1, exact_last=False) as rec:
                for _ in range(2):
                    opt.zero_grad()
                    model(torch.randn(4, 64, dtype=torch.float32)).sum().backward()
                    opt.step()
        finally:
            torch.set_default_dtype(torch.float32)
        return rec.trace.hist

    hist = run(torch.float16)
    assert hist.sum(axis=2)[:, 0].tolist() == [4096.0, 4096.0]
    np.testing.assert_array_equal(hist, run(torch.float32))


def _held_bytes(made: "list[weakref.ref[grads_steps.Chunk]]") -> int:
    chunks = [c for c in (r() for r in made) if c is not None]
    return sum(c.x.nbytes + (c.w.nbytes if c.w is not None else 0) for c in chunks)


class TopTwo(nn.Module):
    """A mixture of experts routing each step to two of eight experts: a new parameter set every step."""

    def __init__(self, d: int = 64, n: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(d, n)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(n))

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        pick = torch.randperm(len(self.experts), generator=torch.Generator().manual_seed(step))[:2].tolist()
        return self.router(x).sum() + sum(self.experts[i](x).sum() for i in pick)


def _record_top_two(made: "list[weakref.ref[grads_steps.Chunk]]", steps: int) -> tuple[object, int, set[int]]:
    """A recording of ``steps`` steps of :class:`TopTwo`, the most bytes its chunks held at once and
    the sizes of their rows."""
    torch.manual_seed(0)
    model = TopTwo()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    peak, sizes = 0, set()
    with record_gradients(model, name="m", bins=8) as rec:
        for i in range(steps):
            opt.zero_grad(set_to_none=True)
            model(torch.randn(4, 64, generator=torch.Generator().manual_seed(i)), i).backward()
            opt.step()
            peak = max(peak, _held_bytes(made))
            sizes |= {c.layout.size for c in (r() for r in made) if c is not None}
    return rec.trace, peak, sizes


def test_a_parameter_set_changing_every_step_keeps_chunk_memory_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mixture-of-experts routing (or LayerDrop) changes the parameters with a gradient at every step.
    The sample rows allocated ahead for the steps stay within ``_MAX_KEPT`` (a chunk of a window's rows
    for nearly every step took 3 times the bound here, and 4 GiB on a GPU), near what the steps write,
    and a bound reached flushes early with the numbers unchanged."""
    made = live_chunks(monkeypatch)
    size = 512 + 2 * 4096 + 3 * 256  # elements of one step's sample: router, two experts, biases padded
    trace, peak, sizes = _record_top_two(made, 80)
    assert sizes == {size}
    assert peak <= rec_mod._MAX_KEPT * 4
    first = -(-rec_mod._CPU_CHUNK // size)  # rows of the first chunk, allocated before the set changes
    assert peak <= 4 * 3 * size * (2 * rec_mod._FLUSH + first)  # at most twice the rows a window writes

    monkeypatch.setattr(rec_mod, "_MAX_KEPT", 3 * size * 10)  # ten steps' rows: flushes forced by the bound
    made.clear()
    bounded, peak, _ = _record_top_two(made, 80)
    assert peak <= rec_mod._MAX_KEPT * 4
    assert bounded.steps == trace.steps == tuple(range(80))  # type: ignore[attr-defined]
    np.testing.assert_allclose(bounded.stats, trace.stats, rtol=1e-6, equal_nan=True)  # type: ignore[attr-defined]
    np.testing.assert_array_equal(bounded.hist, trace.hist)  # type: ignore[attr-defined]


def test_a_steady_parameter_set_reuses_one_chunk_within_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk as large as ``_MAX_KEPT`` allows: the flush comes before a step that would need a
    second one (it came a step later, holding twice the bound), and later steps write into it again."""
    model = nn.Linear(32, 32)  # one sample: 1024 + 32 padded to 256 = 1280 elements
    size = 1280
    monkeypatch.setattr(rec_mod, "_CPU_CHUNK", 4 * size)  # chunks of 4 rows...
    monkeypatch.setattr(rec_mod, "_MAX_KEPT", 3 * 4 * size + size)  # ...that fill the bound, weights included
    made = live_chunks(monkeypatch)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    peak = 0
    with record_gradients(model, name="m") as rec:
        for _ in range(13):
            opt.zero_grad()
            model(torch.randn(2, 32)).sum().backward()
            opt.step()
            peak = max(peak, _held_bytes(made))
            assert made[0]().layout.size == size  # type: ignore[union-attr]
    assert peak <= rec_mod._MAX_KEPT * 4 and len(made) == 1
    assert rec.trace.steps == tuple(range(13))
    assert not np.isnan(rec.trace.stats[:, 0, FIELD["update_ratio"]]).any()


@pytest.mark.parametrize("limit", [0, rec_mod.COPY_LIMIT], ids=["exact-at-the-end", "exact-when-first-read"])
def test_a_copy_failing_at_the_end_leaves_grad_mode_on_and_no_gradient_held(
        limit: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device error surfaces at the first host copy, the one at the block's end: while the job making
    the last step exact has started (no copy of the gradients allowed: the job runs at the end), or with
    the last step left to its first read (issue 27: a copy of its gradients taken, then the kept steps'
    flush fails). The error reaches the user, and with its traceback kept (as a notebook keeps it)
    gradients are still on and the recorder holds none of the user's gradients (tests/test_grads_later.py:
    nor their copy)."""
    def device_error(tensors: list[torch.Tensor]) -> list[np.ndarray]:
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(rec_mod, "COPY_LIMIT", limit)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.setattr(rec_mod, "to_host", device_error)
    with pytest.raises(RuntimeError, match="device-side assert") as failed:
        with record_gradients(model, name="m", sample=16):  # the 48-element weight is sampled
            for _ in range(2):
                opt.zero_grad()
                model(torch.randn(4, 8)).sum().backward()
                opt.step()
    assert failed.value.__traceback__ is not None  # kept, as IPython keeps sys.last_traceback
    assert torch.is_grad_enabled()
    grad = weakref.ref(model[0].weight.grad)
    model.zero_grad(set_to_none=True)
    assert grad() is None
