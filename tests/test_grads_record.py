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
from torch_nbdebug.record import grads as rec_mod


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
