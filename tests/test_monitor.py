"""%%monitor's layers: rules and alerts on hand-built histories, the recorder and the Python twin."""
from __future__ import annotations

import gc
import math
import weakref
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from torch_nbdebug.api.monitor import Monitor, monitor
from torch_nbdebug.data.monitor import Alert, MonitorHistory, Rules
from torch_nbdebug.errors import InputError
from torch_nbdebug.process.monitor import alerts, running_median, smooth, thin
from torch_nbdebug.record.modules import global_hook_counts


def history(values: Any, norms: Any = None, names: tuple[str, ...] = ("loss",), **kw: Any) -> MonitorHistory:
    values = np.asarray(values, dtype=np.float64).reshape(len(values), -1)
    n = len(values)
    layers = tuple(f"model.l{i}" for i in range(np.asarray(norms).shape[1])) if norms is not None else ()
    norms = np.asarray(norms, np.float32) if norms is not None else np.zeros((n, 0), np.float32)
    return MonitorHistory(names, np.arange(1, n + 1), np.arange(n) * 0.1, values, layers, norms,
                          np.full(norms.shape, np.nan, np.float32), **kw)


# -- rules and alerts (pure) ------------------------------------------------------------------
@pytest.mark.parametrize("bad", [dict(spike_factor=1.0), dict(spike_factor=-3), dict(spike_factor=float("nan")),
                                 dict(spike_window=1), dict(spike_window=2.5), dict(plateau_window=True),
                                 dict(plateau_tol=0), dict(plateau_tol=2), dict(vanishing=0),
                                 dict(vanishing=10.0, exploding=1.0), dict(exploding="big")])
def test_bad_rules_say_which_rule(bad: dict[str, Any]) -> None:
    with pytest.raises(InputError, match=next(iter(bad)).split("_")[0]):
        Rules(**bad)


def test_nonfinite_value_alert_points_to_nanwatch() -> None:
    found = alerts(history([1.0, 0.9, 0.8, float("nan"), float("nan")]))
    assert [(a.kind, a.step, a.series) for a in found] == [("non-finite", 4, "loss")]
    assert "%%nanwatch" in found[0].message() and "step 4" in found[0].message()


def test_spike_fires_at_ten_times_the_running_median_not_below() -> None:
    base = [1.0 + 0.01 * (k % 3) for k in range(30)]
    assert not [a for a in alerts(history(base[:25] + [8.0] + base[25:])) if a.kind == "spike"]
    found = [a for a in alerts(history(base[:25] + [12.0] + base[25:])) if a.kind == "spike"]
    assert [(a.step, a.value) for a in found] == [(26, 12.0)]
    assert found[0].reference == pytest.approx(1.01, abs=0.01)
    assert not [a for a in alerts(history(base[:25] + [12.0] + base[25:]), Rules(spike_factor=20)) if a.kind == "spike"]


def test_a_nan_does_not_hide_a_later_spike() -> None:
    values = [1.0] * 25 + [float("nan")] + [1.0] * 5 + [50.0]
    found = {a.kind: a.step for a in alerts(history(values))}
    assert found == {"non-finite": 26, "spike": 32}


def test_plateau_only_when_the_loss_stops_improving() -> None:
    rules = Rules(plateau_window=10)
    falling = [1.0 / (k + 1) for k in range(40)]
    assert not [a for a in alerts(history(falling), rules) if a.kind == "plateau"]
    flat = falling[:20] + [falling[19]] * 20
    found = [a for a in alerts(history(flat), rules) if a.kind == "plateau"]
    assert [(a.step, a.series) for a in found] == [(31, "loss")]
    # only the first expression is the loss: a constant learning rate is no plateau
    two = history(np.stack([falling, [0.1] * 40], 1), names=("loss", "lr"))
    assert not [a for a in alerts(two, rules) if a.kind == "plateau"]


def test_layer_alerts_vanishing_exploding_and_nonfinite_but_not_frozen() -> None:
    norms = np.ones((6, 4), np.float32)
    norms[3, 0] = 1e-9      # vanishing at step 4
    norms[4, 1] = 5e3       # exploding at step 5
    norms[2, 2] = np.nan    # non-finite at step 3
    norms[1, 3] = np.inf    # float32 overflow of the norm: exploding at step 2 (the elements may be finite)
    norms[4:, 3] = -1       # no gradient (frozen): never flagged
    found = [(a.kind, a.step, a.series, a.of) for a in alerts(history([1.0] * 6, norms))]
    assert found == [("exploding", 2, "model.l3", "layer"), ("non-finite", 3, "model.l2", "layer"),
                     ("vanishing", 4, "model.l0", "layer"), ("exploding", 5, "model.l1", "layer")]
    assert "gradient norm of model.l2" in Alert("non-finite", 3, "model.l2", math.nan, math.nan, "layer").message()
    assert "beyond float32" in Alert("exploding", 2, "model.l3", math.inf, 1e3, "layer").message()


def test_an_expression_that_failed_is_not_called_non_finite() -> None:
    h = history([float("nan")] * 3, errors={"loss": "step 1: NameError: name 'loss' is not defined"})
    assert alerts(h) == ()


def test_running_median_ignores_nonfinite_and_uses_every_earlier_point_before_a_full_window() -> None:
    med = running_median(np.array([1, 2, np.nan, 4, 5, 6.0]), 3)
    assert np.isnan(med[0]) and med[1] == 1.0 and med[2] == 1.5
    assert med[3] == 1.5 and med[4] == 3.0 and med[5] == 4.5
    early = running_median(np.arange(1.0, 13.0), 20)  # a short run: from 5 earlier points on
    assert np.isnan(early[:5]).all() and early[5] == 3.0 and early[11] == 6.0


def test_a_spike_in_a_short_run_is_found() -> None:
    """A x1000 loss spike at step 8 of 12 raised nothing: the median waited for 20 earlier points."""
    base = [1.0, 0.9, 0.85, 0.8, 0.78, 0.75, 0.74, 0.73, 730.0, 0.72, 0.71, 0.7]
    found = [a for a in alerts(history(base)) if a.kind == "spike"]
    assert len(found) == 1 and found[0].value == 730.0
    assert not [a for a in alerts(history(base[:4] + [30.0])) if a.kind == "spike"]  # 4 points: too few


def test_smooth_is_a_debiased_moving_average_and_thin_keeps_the_ends() -> None:
    assert np.allclose(smooth(np.array([2.0, 2.0, 2.0]), 0.9), 2.0)  # debiased: no pull towards 0
    out = smooth(np.array([1.0, np.nan, 3.0]), 0.5)
    assert out[0] == 1.0 and np.isnan(out[1]) and out[2] == pytest.approx((0.25 + 1.5) / 0.75)
    assert list(thin(5, 10)) == [0, 1, 2, 3, 4]
    idx = thin(1000, 50)
    assert len(idx) <= 50 and idx[0] == 0 and idx[-1] == 999


def test_history_series_by_name_and_json() -> None:
    h = history([[1.0, 0.1], [float("inf"), 0.1]], names=("loss", "lr"))
    assert list(h["lr"]) == [0.1, 0.1] and h.last("loss") == math.inf
    with pytest.raises(KeyError, match="'loss', 'lr'"):
        h["acc"]
    assert h.to_dict() == {"step": [1, 2], "time": [0.0, 0.1], "loss": [1.0, None], "lr": [0.1, 0.1]}
    with pytest.raises(ValueError):
        h.values[0, 0] = 3.0  # frozen data


# -- recorder through the Python twin ----------------------------------------------------------
def setup(seed: int = 0, lr: float = 0.05) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    return net, torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9), torch.randn(16, 4), torch.randn(16, 2)


def test_twin_records_the_expressions_at_every_optimizer_step() -> None:
    net, opt, x, y = setup()
    seen = []
    with monitor("loss", "opt.param_groups[0]['lr']") as mon:
        for step in range(12):
            loss = nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.param_groups[0]["lr"] = 0.05 * 0.9 ** step
            opt.step()
            seen.append(loss.item())
    h = mon.history
    assert list(h.steps) == list(range(0, 12)) and h.status == "finished"
    assert np.allclose(h["loss"], seen)
    assert np.allclose(h["opt.param_groups[0]['lr']"], [0.05 * 0.9 ** s for s in range(12)])
    assert h.layers == ("net.0", "net.2")


def test_every_n_steps() -> None:
    net, opt, x, y = setup()
    with monitor("loss", every=4) as mon:
        for _ in range(10):
            loss = nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert list(mon.history.steps) == [0, 4, 8] and mon.history.every == 4


def test_layer_norms_and_update_ratios_are_exact() -> None:
    net, opt, x, y = setup()
    expected_norm, expected_ratio = [], []
    with monitor("loss") as mon:
        for _ in range(3):
            loss = nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            layers = [net[0], net[2]]
            expected_norm.append([math.sqrt(sum(p.grad.norm().item() ** 2 for p in m.parameters())) for m in layers])
            before = [[p.detach().clone() for p in m.parameters()] for m in layers]
            opt.step()
            expected_ratio.append([
                math.sqrt(sum((p - b).norm().item() ** 2 for p, b in zip(m.parameters(), bs)))
                / math.sqrt(sum(b.norm().item() ** 2 for b in bs)) for m, bs in zip(layers, before)])
    assert np.allclose(mon.history.grad_norm, expected_norm, rtol=1e-5)
    assert np.allclose(mon.history.update_ratio, expected_ratio, rtol=1e-4)


def test_layers_without_a_gradient_are_marked_not_zero() -> None:
    net, opt, x, y = setup()
    net[0].requires_grad_(False)
    with monitor("loss", namespace={"net": net, "opt": opt}) as mon:
        loss = nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert mon.history.grad_norm[0, 0] == -1 and mon.history.grad_norm[0, 1] > 0
    assert not [a for a in mon.alerts if a.series == "net.0"]


def test_values_stay_on_the_device_until_read() -> None:
    """No host copy per step: rows wait in the recorder until the history (or the view) reads them."""
    net, opt, x, y = setup()
    with monitor("loss") as mon:
        for _ in range(5):
            loss = nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        pending = len(mon._recorder._pending)  # type: ignore[union-attr]
        assert isinstance(mon._recorder._pending[0]["values"][0], torch.Tensor)  # type: ignore[union-attr]
        assert len(mon.history) == 5  # read while running: one flush
    assert pending == 5


def test_no_user_tensor_is_kept_alive() -> None:
    net, opt, x, y = setup()
    big = torch.randn(1000, 1000)
    ref = weakref.ref(big)
    with monitor("big[0, 0]", "loss") as mon:
        loss = nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        del big
    del loss
    gc.collect()
    assert ref() is None
    assert len(mon.history) == 1


def test_expressions_see_the_callers_function_locals() -> None:
    def train() -> Monitor:
        net, opt, x, y = setup()
        with monitor("loss * 2", lambda: 7) as mon:
            for _ in range(3):
                loss = nn.functional.mse_loss(net(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
        return mon

    h = train().history
    assert np.isfinite(h["loss * 2"]).all() and list(h["<lambda>"]) == [7, 7, 7]


def test_an_expression_that_fails_is_noted_and_training_goes_on() -> None:
    net, opt, x, y = setup()
    with monitor("loss", "no_such_name", "x") as mon:
        for _ in range(2):
            loss = nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    h = mon.history
    assert np.isnan(h["no_such_name"]).all() and np.isfinite(h["loss"]).all()
    assert "NameError" in h.errors["no_such_name"] and "step 0" in h.errors["no_such_name"]
    assert "shape (16, 4)" in h.errors["x"] and "not one number" in h.errors["x"]
    assert "could not evaluate 'no_such_name'" in mon.text()


def test_user_exception_propagates_unchanged_and_the_history_is_kept() -> None:
    net, opt, x, y = setup()
    boom = RuntimeError("boom")
    with pytest.raises(RuntimeError) as info:
        with monitor("loss") as mon:
            for step in range(5):
                loss = nn.functional.mse_loss(net(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if step == 2:
                    raise boom
    assert info.value is boom
    assert mon.history.status == "failed" and len(mon.history) == 3
    assert "raised at step 2" in mon.text()


def test_stop_propagates_and_keeps_what_was_recorded() -> None:
    net, opt, x, y = setup()
    with pytest.raises(KeyboardInterrupt):
        with monitor("loss") as mon:
            for step in range(5):
                loss = nn.functional.mse_loss(net(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                if step == 1:
                    raise KeyboardInterrupt
    assert mon.history.status == "stopped" and len(mon.history) == 2
    assert "stopped at step 1" in mon.text()
    assert global_hook_counts()["_global_optimizer_pre_hooks"] == 0


def test_stop_inside_an_expression_stops_the_loop() -> None:
    net, opt, x, y = setup()

    def stop() -> float:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        with monitor(stop) as mon:
            loss = nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
    assert mon.history.status == "stopped"


def test_only_the_first_optimizer_is_the_clock() -> None:
    net, opt, x, y = setup()
    other = torch.optim.SGD([nn.Parameter(torch.ones(3))], lr=0.1)
    with monitor("loss") as mon:
        for _ in range(3):
            loss = nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            other.step()
    assert len(mon.history) == 3
    assert any("SGD also stepped" in n for n in mon.history.notes)


@pytest.mark.parametrize("args, kwargs, match", [
    ((), {}, "at least one"),
    (("loss +",), {}, "not a Python expression"),
    ((3,), {}, "expressions"),
    (("loss", "loss"), {}, "once"),
    (("loss",), {"every": 0}, "every"),
    (("loss",), {"rules": {"spike_factor": 3}}, "rules"),
    (("loss",), {"tensorboard": ""}, "directory"),
])
def test_bad_arguments_are_input_errors(args: tuple[Any, ...], kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InputError, match=match):
        monitor(*args, **kwargs)


def test_reuse_and_early_use_say_what_to_do() -> None:
    mon = monitor("1")
    with pytest.raises(InputError, match="with monitor"):
        mon.history
    assert "not started" in repr(mon)
    with mon:
        pass
    with pytest.raises(InputError, match="already used"):
        with mon:
            pass


def test_live_without_a_front_end_prints_nothing(capsys: Any) -> None:
    net, opt, x, y = setup()
    with monitor("loss", live=True) as mon:
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
    assert capsys.readouterr().out == "" and len(mon.history) == 1


class FakeLive:
    """Stands in for render.live.LiveDisplay: records what the monitor asks of it."""

    def __init__(self, mon: Monitor) -> None:
        self.mon, self.events, self.progress = mon, [], []

    def start(self) -> None:
        self.events.append("start")

    def tick(self) -> None:
        self.events.append("tick")
        self.progress.append(self.mon.progress())


def test_the_live_view_is_ticked_at_each_recorded_step_with_the_steps_so_far() -> None:
    net, opt, x, y = setup()
    mon = monitor("loss", every=2)
    mon.live = live = FakeLive(mon)
    with mon:
        for _ in range(5):
            loss = nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert live.events == ["start", "tick", "tick", "tick"]
    last = live.progress[-1]
    assert last["status"].startswith("step 4: loss ")
    lines = last["panels"][0]
    assert lines["kind"] == "lines" and lines["x"] == [0.0, 2.0, 4.0] and len(lines["series"][0]["y"]) == 3
    assert last["panels"][1]["title"] == "gradient norm per layer" and last["panels"][1]["log"] is True


def test_update_ratio_of_big_layers_is_estimated_from_a_sample() -> None:
    """Parameters above 1024 elements are sampled (a full copy per step would cost too much); the
    estimate stays close to the exact ratio, here under Adam whose update is uneven across elements."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 384), nn.Tanh(), nn.Linear(384, 10))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    exact = []
    with monitor("loss") as mon:
        for _ in range(3):
            loss = nn.functional.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            before = [p.detach().clone() for p in net[0].parameters()]
            opt.step()
            moved = math.sqrt(sum((p - b).norm().item() ** 2 for p, b in zip(net[0].parameters(), before)))
            exact.append(moved / math.sqrt(sum(b.norm().item() ** 2 for b in before)))
    assert np.allclose(mon.history.update_ratio[:, 0], exact, rtol=0.1)


def test_names_are_found_where_optimizer_step_is_called() -> None:
    """`loss` local to a train() function is seen, through the lr scheduler's step wrapper too."""
    net, opt, x, y = setup()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    seen = []

    def train() -> None:
        for _ in range(3):
            loss = nn.functional.mse_loss(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            seen.append(loss.item())

    with monitor("loss", "opt.param_groups[0]['lr']") as mon:
        train()
    assert np.allclose(mon.history["loss"], seen) and not mon.history.errors
    assert list(mon.history["opt.param_groups[0]['lr']"]) == [0.05, 0.025, 0.0125]


def test_layers_are_named_from_the_step_callers_locals_else_one_per_parameter() -> None:
    def train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()

    with monitor("loss") as named:
        train(*setup())
    assert named.history.layers == ("model.0", "model.2")
    with monitor("1") as unnamed:
        w = torch.zeros(3, requires_grad=True)
        opt = torch.optim.SGD([{"params": [w]}, {"params": [nn.Parameter(torch.ones(2))]}], lr=0.1)
        (w.sum() * 2).backward()
        opt.step()
    assert unnamed.history.layers == ("SGD.param_groups[0][0]", "SGD.param_groups[1][0]")
    assert unnamed.history.grad_norm[0, 0] == pytest.approx(2 * math.sqrt(3))
    assert unnamed.history.grad_norm[0, 1] == -1  # no gradient: marked, not zero


def test_checking_new_rows_only_finds_the_same_alerts_as_a_full_scan() -> None:
    rng = np.random.default_rng(0)
    n = 300
    loss = 1 + 0.05 * rng.standard_normal(n)
    loss[120] = 40.0                      # spike
    loss[200:] = np.nan                    # non-finite
    norms = np.abs(rng.standard_normal((n, 5))).astype(np.float32)
    norms[150, 2], norms[90, 4], norms[:50, 1] = 1e5, 1e-9, -1
    full = history(loss, norms)
    expected = alerts(full, Rules(plateau_window=30))
    found: tuple[Alert, ...] = ()
    start = 0
    for end in (17, 21, 95, 121, 122, 151, 230, n):
        part = MonitorHistory(full.expressions, full.steps[:end], full.times[:end], full.values[:end], full.layers,
                              full.grad_norm[:end], full.update_ratio[:end])
        found = alerts(part, Rules(plateau_window=30), start=start, before=found)
        start = end
    key = lambda found: [(a.kind, a.step, a.series, a.of) for a in found]  # noqa: E731 - NaN != NaN in values
    assert key(found) == key(expected)
    assert {a.kind for a in expected} == {"spike", "non-finite", "exploding", "vanishing"}


def test_the_result_keeps_neither_the_model_nor_the_optimizer_alive() -> None:
    net, opt, x, y = setup()
    refs = [weakref.ref(net), weakref.ref(opt), weakref.ref(next(net.parameters()))]
    with monitor("loss", live=True) as mon:
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
    del net, opt, loss
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    assert len(mon.history) == 1 and mon.history.layers == ("net.0", "net.2")
