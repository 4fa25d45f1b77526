"""Monitor views on hand-built histories: text, sanitizer-proof HTML, widget payload, live panels."""
from __future__ import annotations

import dataclasses

import numpy as np

from torch_nbdebug.data.monitor import MonitorHistory
from torch_nbdebug.process.monitor import alerts
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


def test_many_alerts_are_summarised_not_listed_forever() -> None:
    base = history(30, layers=40)
    norms = base.grad_norm.copy()
    norms[10] = 1e6  # every layer explodes at step 11
    h = dataclasses.replace(base, grad_norm=norms)
    found = alerts(h)
    assert len(found) == 40
    text = render.text(h, found)
    assert "... and 32 more (all of them in .alerts)" in text
    assert render.html(h, found).count("<li>") == 21


def test_stopped_and_failed_titles_keep_the_data() -> None:
    assert "stopped at step 7: what was recorded is kept" in render.title(history(7, status="stopped"))
    assert "the cell raised at step 3" in render.title(history(3, status="failed"))
