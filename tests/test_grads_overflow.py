"""Finite gradients whose float32 sums of squares overflow: gradients of 1e20 square to 1e40, past
float32's 3.4e38, though their norm (about 1e21) is a float32. Their norms are reported finite and
right, never as NaN/Inf values; a gradient that really holds an Inf still is; a norm that is itself
past float32's range is reported as such."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from torch_nbdebug.api.grads import grads, record_gradients
from torch_nbdebug.data.grads import FIELD
from torch_nbdebug.record.grads import recorder as rec_mod


def _deep(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)], nn.Linear(16, 2)).to(dtype)


def _train(model: nn.Module, scale: float, steps: int, lr: float = 1e-30,
           **options: object) -> tuple[object, list[list[float]]]:
    """Record ``steps`` SGD steps whose loss is scaled by ``scale``; also returns each step's exact norms
    (float64, of every parameter in order) taken by hand."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    dtype = next(model.parameters()).dtype
    expected = []
    with record_gradients(model, **options) as rec:
        for _ in range(steps):
            opt.zero_grad()
            out = model(torch.randn(8, 16, dtype=dtype))  # a loss of float32 at least: of float64 beyond 3.4e38
            (out.to(torch.promote_types(dtype, torch.float32)).sum() * scale).backward()
            expected.append([torch.linalg.vector_norm(p.grad.double()).item() for p in model.parameters()])
            opt.step()
    return rec, expected


def _norms(rec: object, step: int) -> list[float]:
    return [p.norm for li in range(len(rec.layers)) for p in rec.layer(li, step).params]  # type: ignore[attr-defined]


@pytest.mark.parametrize("exact_last", [True, False])
def test_finite_gradients_of_1e20_have_finite_exact_norms_and_no_nan_inf_flag(
        exact_last: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rec_mod, "_FLUSH", 2)  # flushes while recording too, not only at the end
    model = _deep()
    rec, expected = _train(model, 1e20, 5, exact_last=exact_last)
    assert max(max(e) for e in expected) > 2e19  # beyond sqrt(3.4e38): the float32 sum of squares overflows
    for step in range(5):
        assert _norms(rec, step) == pytest.approx(expected[step], rel=1e-6)
        params = [p for li in range(len(rec.layers)) for p in rec.layer(li, step).params]
        assert all(p.nan == 0 and p.inf == 0 and p.mean is not None and np.isfinite(p.std) for p in params)
        flags = rec.flags_at(step)
        assert flags and all(f.kind == "exploding" for f in flags), flags
        assert not any("NaN" in f.reason or "beyond" in f.reason for f in flags)
    assert "non-finite" not in rec.text() and " inf " not in rec.text()
    assert not [n for n in rec.trace.notes if "overflowed" in n]  # every parameter taken whole: exact
    snapshot = grads(model)
    assert _norms(snapshot, 0) == pytest.approx(expected[-1], rel=1e-6)
    assert not [f for f in snapshot.flags_at() if f.kind == "non-finite"]


def test_sampled_gradients_of_1e20_have_finite_norms_exact_at_the_last_step() -> None:
    """A parameter larger than the sample: at earlier steps its gradient is gone by the time the overflow
    is seen, so its norm is estimated from its sample (and a note says so); the last step is exact."""
    model = _deep()
    rec, expected = _train(model, 1e20, 3, sample=64)
    big = [i for i, p in enumerate(model.parameters()) if p.numel() > 64]
    for step in range(3):
        norms = _norms(rec, step)
        assert all(np.isfinite(norms)) and not [f for f in rec.flags_at(step) if f.kind == "non-finite"]
        for i in big:  # the estimate lies within what the largest |g| allows, and near the truth
            assert norms[i] == pytest.approx(expected[step][i], rel=0.5)
    assert [norms[i] for i in big] == pytest.approx([expected[-1][i] for i in big], rel=1e-6)
    notes = [n for n in rec.trace.notes if "overflowed" in n]
    assert len(notes) == 1 and "at 2 step(s)" in notes[0] and "estimated from their sample" in notes[0]


@pytest.mark.parametrize("dtype, scale", [(torch.float16, 3e3), (torch.bfloat16, 1e20)])
def test_half_precision_gradients_have_finite_exact_norms(dtype: torch.dtype, scale: float) -> None:
    """float16 gradients of about 1e3 (past 65504 squared) and bfloat16 ones of 1e20 (float32's exponent)."""
    model = _deep(dtype)
    rec, expected = _train(model, scale, 3, exact_last=False)
    assert max(max(e) for e in expected) > (300 if dtype == torch.float16 else 2e19)
    for step in range(3):
        assert _norms(rec, step) == pytest.approx(expected[step], rel=1e-6)
        assert not [f for f in rec.flags_at(step) if f.kind == "non-finite"]
    assert _norms(grads(model), 0) == pytest.approx(expected[-1], rel=1e-6)


def test_a_real_inf_gradient_is_still_flagged_non_finite() -> None:
    model = _deep()
    one = torch.zeros(16, 16, dtype=torch.bool)
    one[0, 0] = True
    hook = model[3].weight.register_hook(lambda g: g.masked_fill(one, float("inf")))
    for exact_last in (True, False):
        with record_gradients(model, exact_last=exact_last) as rec:
            model.zero_grad()
            (model(torch.randn(8, 16)).sum() * 1e20).backward()
        flags = [f for f in rec.flags_at() if f.kind == "non-finite"]
        assert [f.layer for f in flags] == [3]
        assert "has 0 NaN and 1 Inf values out of 256" in flags[0].reason
        assert rec.layer(3).param("weight").inf == 1
    hook.remove()
    assert [f.layer for f in grads(model).flags_at() if f.kind == "non-finite"] == [3]


def test_a_norm_beyond_float32_is_reported_as_such_not_as_nan_or_inf_values() -> None:
    """Values of 1e38, finite in float32, 16 of them: their norm 4e38 is past float32's 3.4e38; it is
    kept (in float64) and said to be out of float32's range."""
    model = nn.Linear(4, 4, bias=False)
    truth = 4e38
    for exact_last in (True, False):
        with record_gradients(model, exact_last=exact_last) as rec:
            model.weight.grad = torch.full((4, 4), 1e38)
            model(torch.zeros(1, 4)).sum().backward()  # a backward adds 0 to it: one recorded step
        w = rec.layer(0).param("weight")
        assert w.norm == pytest.approx(truth, rel=1e-6) and w.nan == 0 and w.inf == 0
        (flag,) = rec.flags_at()
        assert flag.kind == "exploding" and flag.reason == (
            "weight gradient norm 4e+38, beyond float32's 3.4e+38: every value is finite, the largest |g| is 1e+38")
    snapshot = grads(model)
    assert snapshot.layer(0).param("weight").norm == pytest.approx(truth, rel=1e-6)
    assert [f.kind for f in snapshot.flags_at()] == ["exploding"]


def test_parameter_norms_of_a_snapshot_do_not_overflow() -> None:
    model = nn.Linear(16, 16)
    with torch.no_grad():
        model.weight.fill_(1e20)
    model(torch.ones(1, 16)).sum().backward()
    stats = grads(model).trace.stats[0]
    assert stats[0, FIELD["param_norm"]] == pytest.approx(16e20, rel=1e-6)


def test_a_norm_beyond_float64_is_said_to_overflow_not_to_hold_inf_values() -> None:
    """float64 values of 1e160, 16 of them: the float64 sum of squares (1.6e321) overflows, the norm
    4e160 would not. What the snapshot cannot measure it says it cannot, never as Inf values."""
    model = nn.Linear(4, 4, bias=False).double()
    model.weight.grad = torch.full((4, 4), 1e160, dtype=torch.float64)
    snapshot = grads(model)
    w = snapshot.layer(0).param("weight")
    assert w.nan == 0 and w.inf == 0 and w.max_abs == 1e160
    (flag,) = snapshot.flags_at()
    assert flag.kind == "exploding" and flag.reason == (
        "weight gradient norm overflows float64: every value is finite, the largest |g| is 1e+160")


# -- the per-step series as every reader takes it, and the widget's numbers ---------------------------------
def _layer_norms(model: nn.Module, expected: list[float]) -> list[float]:
    """Per-layer norms from per-parameter ones (float64, in parameter order)."""
    it = iter(expected)
    return [float(np.sqrt(sum(next(it) ** 2 for _ in m.parameters()))) for m in model if list(m.parameters())]


@pytest.mark.parametrize("sample", [4096, 64])
def test_the_live_series_of_gradients_of_1e20_is_finite_before_and_after_a_flush(
        sample: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """%grads' live view reads the steps not flushed yet from their captured rows: their float32 norms
    overflowed (inf) though every gradient was finite. Exact for parameters taken whole, an estimate from
    the sample for larger ones, as the flushed steps give them."""
    monkeypatch.setattr(rec_mod, "_FLUSH", 2)
    model = _deep()
    opt = torch.optim.SGD(model.parameters(), lr=1e-30)
    recording = record_gradients(model, sample=sample)
    expected = []
    with recording:
        for _ in range(3):  # steps 0 and 1 flushed before step 2, which is still pending
            opt.zero_grad()
            (model(torch.randn(8, 16)).sum() * 1e20).backward()
            expected.append(_layer_norms(model, [torch.linalg.vector_norm(p.grad.double()).item()
                                                 for p in model.parameters()]))
            opt.step()
        kind, steps, norms, names = recording._recorder.progress()
    assert steps == (0, 1, 2) and max(expected[-1]) > 2e19
    assert np.isfinite(norms).all(), norms
    final = [[recording.layer(name, step).norm for name in names] for step in steps]
    rel = 1e-6 if sample == 4096 else 0.5
    assert norms.tolist() == [pytest.approx(e, rel=rel) for e in expected]
    assert norms[-1] == pytest.approx(final[-1], rel=rel)  # as the trace gives it once flushed


def test_the_per_step_series_of_gradients_of_1e20_is_finite_in_every_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_nbdebug.data.grads import GradTrace
    from torch_nbdebug.process.grads import layer_arrays
    from torch_nbdebug.render import grads as render

    monkeypatch.setattr(rec_mod, "_FLUSH", 2)
    model = _deep()
    rec, expected = _train(model, 1e20, 4)
    layers = [_layer_norms(model, e) for e in expected]
    assert layer_arrays(rec.trace)["norm"].tolist() == [pytest.approx(e, rel=1e-6) for e in layers]
    saved = rec.trace.to_dict()
    norms = [[row[FIELD["norm"]] for row in step] for step in saved["stats"]]
    assert norms == [pytest.approx(e, rel=1e-6) for e in expected]
    assert GradTrace.from_dict(saved).stats[:, :, FIELD["norm"]].tolist() == norms
    for step in range(4):
        text = render.text(rec.trace, rec.flags_at(step), step)
        assert "non-finite" not in text and " inf " not in text and "—" not in text


def _float64_beyond_float32() -> tuple[nn.Module, float]:
    """A float64 gradient of 16 values of 1e38: its norm 4e38 is past float32's 3.4e38."""
    model = nn.Linear(4, 4, bias=False).double()
    model.weight.grad = torch.full((4, 4), 1e38, dtype=torch.float64)
    return model, 4e38


def _decoded(view: object, key: str) -> np.ndarray:
    """A widget array as grads.js reads it: float64 bytes for the names meta["wide"] lists, else float32."""
    wide = key in view.meta["wide"]  # type: ignore[attr-defined]
    return np.frombuffer(getattr(view, key), dtype="<f8" if wide else "<f4")


def test_the_widget_carries_a_norm_beyond_float32_as_it_is() -> None:
    from torch_nbdebug.render.grads import widget

    model, truth = _float64_beyond_float32()
    snapshot = grads(model)
    view = widget(snapshot.trace, snapshot.flags_at())
    assert view.meta["wide"] == ["stats", "flow"]
    stats = _decoded(view, "stats").reshape(snapshot.trace.stats.shape)
    assert stats[0, 0, FIELD["norm"]] == pytest.approx(truth, rel=1e-9)
    assert _decoded(view, "flow")[0] == pytest.approx(truth, rel=1e-9)  # the layer's norm
    assert np.isfinite(_decoded(view, "hist_range")).all()
    [(kind, _, _, reason)] = view.meta["flags"]
    assert kind == "exploding" and "4e+38" in reason
    for shown in (snapshot.text(), snapshot.html()):
        assert "4e+38" in shown and "non-finite" not in shown and "NaN/Inf" not in shown


def test_the_widget_keeps_float32_bytes_when_every_number_fits() -> None:
    from torch_nbdebug.render.grads import widget

    model = _deep()
    rec, _ = _train(model, 1.0, 2)
    view = widget(rec.trace, rec.flags_at())
    assert view.meta["wide"] == []
    assert len(view.stats) == rec.trace.stats.size * 4  # half the bytes of float64 in a saved notebook
    assert _decoded(view, "stats").tolist() == pytest.approx(rec.trace.stats.ravel().tolist(), rel=1e-6, nan_ok=True)


def test_the_shared_helper_decodes_wide_and_narrow_bytes_as_sent() -> None:
    import json
    import shutil
    import subprocess

    from torch_nbdebug.render.grads import numbers
    from torch_nbdebug.render.widget import esm_path

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    values = np.array([4e38, 1e-40, np.nan, np.inf, -1.5])
    wide, narrow = numbers(values), numbers(values[1:])
    assert wide[1] and not narrow[1]
    script = ("import { floats } from './dom.js';\n"
              "const read = (hex, w) => { const b = Buffer.from(hex, 'hex');"
              " return Array.from(floats(new DataView(b.buffer, b.byteOffset, b.length), w), String); };\n"
              f"console.log(JSON.stringify([read('{wide[0].hex()}', true), read('{narrow[0].hex()}', false)]));")
    run = subprocess.run([node, "--input-type=module", "-e", script], cwd=esm_path("dom.js").parent,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    got_wide, got_narrow = json.loads(run.stdout)
    assert got_wide == ["4e+38", "1e-40", "NaN", "Infinity", "-1.5"]
    assert got_narrow[1:] == ["NaN", "Infinity", "-1.5"] and float(got_narrow[0]) == pytest.approx(1e-40, rel=1e-2)


@pytest.mark.parametrize("exact_last", [True, False])
@pytest.mark.parametrize("sample", [4096, 64])
def test_float64_gradients_beyond_float32_are_recorded_at_every_step_as_they_are(
        exact_last: bool, sample: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """float64 gradients of about 1e100: the per-step samples were float32, so their values read as Inf
    ("has 0 NaN and 256 Inf values", "non-finite") and their norms as inf. Kept in float64 now: the
    norms, the largest |g| and the parameters' norms are the float64 ones at every step, and a norm
    beyond float32 is called exploding with its figure."""
    monkeypatch.setattr(rec_mod, "_FLUSH", 2)
    model = _deep(torch.float64)
    rec, expected = _train(model, 1e100, 3, lr=1e-130, exact_last=exact_last, sample=sample)
    assert min(min(e) for e in expected) > 1e90
    params = list(model.parameters())
    for step in range(3):
        assert _norms(rec, step) == pytest.approx(expected[step], rel=1e-9)  # float64 norms at the step
        flags = rec.flags_at(step)
        assert flags and all(f.kind == "exploding" for f in flags), flags
        assert all("e+" in f.reason and "NaN" not in f.reason for f in flags)
        got = [p for li in range(len(rec.layers)) for p in rec.layer(li, step).params]
        assert all(p.nan == 0 and p.inf == 0 and 1e90 < p.max_abs < 1e120 for p in got)
    last = [p for li in range(len(rec.layers)) for p in rec.layer(li, 2).params]
    assert [p.param_norm for p in last] == pytest.approx([float(p.detach().norm()) for p in params], rel=1e-6)
    assert "non-finite" not in rec.text() and "non-finite" not in rec.html()
    assert "e+100" in rec.text() and not [n for n in rec.trace.notes if "overflowed" in n]  # nothing estimated
