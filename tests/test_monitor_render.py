"""Monitor views on hand-built histories: text, sanitizer-proof HTML, widget payload, live panels."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from torch_nbdebug.data.monitor import MonitorHistory
from torch_nbdebug.process.monitor import alerts, flat_limits, group_alerts, smooth
from torch_nbdebug.render import monitor as render


def history(n: int, names: tuple[str, ...] = ("loss",), layers: int = 2, status: str = "finished") -> MonitorHistory:
    values = np.linspace(2.0, 1.0, n)[:, None].repeat(len(names), 1)
    norms = np.full((n, layers), 0.5, np.float32)
    return MonitorHistory(names, np.arange(1, n + 1), np.linspace(0, 3, n), values,
                          tuple(f"model.l{i}" for i in range(layers)), norms, norms / 100, status=status)


def test_empty_run_says_what_records() -> None:
    h = history(0)
    assert "no optimizer step ran" in render.text(h, ())
    assert render.figure_png(h, ()) is None and "<img" not in render.html(h, ())
    progress = render.progress(h, ())
    assert "waiting for the first optimizer step" in progress["status"] and not progress["alert"]


def test_user_strings_are_escaped_in_html() -> None:
    h = history(5, names=("d['<b>x</b>']",))
    out = render.html(h, ())
    assert "<b>x</b>" not in out and "&lt;b&gt;x&lt;/b&gt;" in out
    assert "<style" not in out and "<svg" not in out and "<script" not in out


def test_widget_payload_is_thinned_for_long_runs_and_keeps_the_last_step() -> None:
    h = history(10_000, layers=3)
    view = render.widget(h, ())
    meta = view.meta
    assert len(meta["steps"]) <= 2000 and meta["steps"][-1] == 10_000
    assert len(np.frombuffer(view.values, np.float32)) == len(meta["steps"])
    assert len(np.frombuffer(view.norms, np.float32)) == 3 * len(meta["layer_steps"]) <= 3 * 400
    panels = render.progress(h, ())["panels"]
    assert len(panels[0]["x"]) <= 400 and panels[0]["x"][-1] == 10_000.0


def test_a_divergence_is_one_row_per_step_and_kind_led_by_the_non_finite_loss() -> None:
    base = history(12, names=("loss", "lr"), layers=16)
    values, norms = base.values.copy(), base.grad_norm.copy()
    values[4:, 0] = np.nan  # the loss is nan from step 5
    norms[3, :15] = np.linspace(2e3, 9e3, 15)  # 15 layers explode at step 4 (the worst: model.l14)
    norms[4:] = np.nan  # and every layer's gradient is non-finite from step 5
    h = dataclasses.replace(base, values=values, grad_norm=norms)
    found = alerts(h)
    assert len(found) == 32  # the data model keeps one alert per (kind, series)
    groups = group_alerts(found)
    assert [(g.step, g.kind, len(g.members)) for g in groups] == [(5, "non-finite", 1), (4, "exploding", 15),
                                                                    (5, "non-finite", 16)]
    assert groups[0].worst.series == "loss" and groups[1].worst.series == "model.l14"
    assert "(and 14 more layers)" in groups[1].message()
    text = render.text(h, found)
    rows = text[text.index("alerts:"):].splitlines()[1:]
    assert len(rows) == 3 and rows[0].startswith("  non-finite: step 5: loss is nan")
    out = render.html(h, found)
    listed = out[out.index('<ul class="tnd-alerts">'):]
    assert listed.count("<summary>") == 2 and listed.count("<details>") == 2  # per-layer rows folded
    assert listed.index("loss is nan") < listed.index("exploding")
    assert listed.count("<li>") == 3 + 15 + 16
    meta = render.widget(h, found).meta
    assert [g["count"] for g in meta["groups"]] == [1, 15, 16] and len(meta["alerts"]) == 32
    table = [p for p in render.progress(h, found)["panels"] if p["kind"] == "table"][0]
    assert len(table["rows"]) == 3 and table["rows"][0][1] == "non-finite"


def test_many_alert_rows_are_summarised_not_listed_forever() -> None:
    base = history(60, layers=40)
    norms = base.grad_norm.copy()
    for li in range(40):
        norms[li + 10, li] = 1e6  # each layer explodes at its own step: forty rows
    h = dataclasses.replace(base, grad_norm=norms)
    found = alerts(h)
    assert len(found) == 40
    text = render.text(h, found)
    assert "... and 32 more (all of them in .alerts)" in text
    assert render.html(h, found).count("<li>") == 21


def test_a_constant_series_is_drawn_flat_whatever_the_smoothing_noise() -> None:
    lr = np.full(30, 0.003)
    assert flat_limits(lr) == pytest.approx((0.0027, 0.0033))
    noisy = smooth(lr, 0.6)  # the debiased average may add ~1e-18 of float noise: still flat
    assert flat_limits(np.concatenate([lr, noisy, lr + 1e-18])) == pytest.approx((0.0027, 0.0033))
    assert flat_limits(np.zeros(5)) == (-1.0, 1.0)
    assert flat_limits(np.linspace(2.30, 2.31, 5)) is None  # a real (small) change is drawn as such
    assert flat_limits(np.full(3, np.nan)) is None


def test_the_static_figure_draws_a_fixed_learning_rate_flat() -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    base = history(30, names=("loss", "lr"))
    values = base.values.copy()
    values[:, 1] = 0.003 + np.where(np.arange(30) % 2, 4e-19, -4e-19)  # float noise, as smoothing leaves
    h = dataclasses.replace(base, values=values)
    drawn: list[Figure] = []
    original = render.png

    def spy(draw, width, height):  # type: ignore[no-untyped-def]
        fig = Figure()
        draw(fig)
        drawn.append(fig)
        return original(draw, width, height)

    render.png = spy
    try:
        png = render.figure_png(h, ())
    finally:
        render.png = original
    assert png is not None and png[:8] == b"\x89PNG\r\n\x1a\n"
    ax = drawn[0].axes[1]
    assert ax.get_ylim() == pytest.approx((0.0027, 0.0033))
    FigureCanvasAgg(drawn[0]).draw()
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert len(labels) == len(set(labels)), labels


def test_layer_colours_are_told_apart() -> None:
    from matplotlib.colors import to_rgb

    def lab(colour: str) -> np.ndarray:  # CIE L*a*b* (D65) of an sRGB colour
        rgb = np.array(to_rgb(colour))
        lin = np.where(rgb > 0.04045, ((rgb + 0.055) / 1.055) ** 2.4, rgb / 12.92)
        xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]) @ lin
        f = np.cbrt(xyz / np.array([0.9505, 1.0, 1.089]))
        return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])

    colours = render.LAYER_COLOURS
    gaps = [np.linalg.norm(lab(a) - lab(b)) for i, a in enumerate(colours) for b in colours[i + 1:]]
    assert len(colours) == 8 and min(gaps) > 25, min(gaps)
    assert render.widget(history(3), ()).meta["colours"] == list(colours)  # the widget draws with the same


def test_stopped_and_failed_titles_keep_the_data() -> None:
    assert "stopped at step 7: what was recorded is kept" in render.title(history(7, status="stopped"))
    assert "the cell raised at step 3" in render.title(history(3, status="failed"))
