"""%%monitor through a real IPython shell; the static view and the widget's synced state."""
from __future__ import annotations

import base64
import gc
from typing import Any, Iterator

import numpy as np
import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from torch_nbdebug.magics.monitor import MAGICS, split_expressions, split_line

WIDGET = "application/vnd.jupyter.widget-view+json"

SETUP = """
import torch
from torch import nn
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
opt = torch.optim.SGD(net.parameters(), lr=0.05)
x, y = torch.randn(16, 4), torch.randn(16, 2)
"""

LOOP = """
losses = []
for step in range(30):
    opt.zero_grad()
    loss = nn.functional.mse_loss(net(x), y)
    if step == 25:
        loss = loss * float("nan")
    loss.backward()
    opt.step()
    losses.append(loss.item())
"""


@pytest.fixture
def ip() -> Iterator[Any]:
    """The real IPython shell with only the %monitor magics registered (removed afterwards)."""
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.register_magics(MAGICS)
    shell.run_cell(SETUP)
    yield shell
    for kind, names in MAGICS.magics.items():
        for name in names:
            shell.magics_manager.magics[kind].pop(name, None)
    for name in ("net", "opt", "x", "y", "loss", "losses", "step", "_monitor", "r"):
        shell.user_ns.pop(name, None)
    gc.collect()


def test_cell_magic_shows_one_bundle_with_a_sanitizer_proof_figure(ip: Any) -> None:
    with capture_output() as cap:
        ip.run_cell_magic("monitor", 'loss, opt.param_groups[0]["lr"]', LOOP)
    assert len(cap.outputs) == 1  # no live front end here: the final view only, nothing else printed
    data = cap.outputs[0].data
    assert {"text/plain", "text/html", WIDGET} <= set(data)
    assert "30 steps recorded" in data["text/plain"]
    assert "non-finite: step 25: loss is nan" in data["text/plain"] and "%%nanwatch" in data["text/plain"]
    html = data["text/html"]
    assert "<svg" not in html and "<style" not in html and "style=" not in html
    png = html.split('src="data:image/png;base64,')[1].split('"')[0]
    assert base64.b64decode(png)[:8] == b"\x89PNG\r\n\x1a\n"
    assert "non-finite" in html and "step 25" in html  # the alert in words, not only on the figure
    mon = ip.user_ns["_monitor"]
    assert np.allclose(mon.history["loss"][:25], ip.user_ns["losses"][:25])
    assert mon.history['opt.param_groups[0]["lr"]'][0] == 0.05


def test_options_output_and_quiet(ip: Any) -> None:
    with capture_output() as cap:
        r = ip.run_cell_magic("monitor", "--every 5 --no-ratio -o loss", LOOP)
    assert not cap.outputs and list(r.history.steps) == [0, 5, 10, 15, 20, 25]
    assert np.isnan(r.history.update_ratio).all() and (r.history.grad_norm > 0).any()
    with capture_output() as cap:
        ip.run_cell_magic("monitor", "-q --no-layers loss", LOOP)
    assert not cap.outputs and ip.user_ns["_monitor"].history.layers == ()
    with capture_output() as cap:
        ip.run_line_magic("monitor", "")
    assert "%%monitor loss" in cap.outputs[0].data["text/plain"]


def test_rules_from_options(ip: Any) -> None:
    r = ip.run_cell_magic("monitor", "-o --exploding 1e-3 --vanishing 1e-9 loss", LOOP)
    assert {a.kind for a in r.alerts} >= {"exploding", "non-finite"}


def test_failing_cell_reraises_unchanged_and_shows_what_was_recorded(ip: Any) -> None:
    ip.run_cell("class Boom(Exception): pass")
    body = LOOP.replace("losses.append(loss.item())", "losses.append(loss.item())\n    if step == 4: raise Boom('x')")
    with capture_output() as cap, pytest.raises(ip.user_ns["Boom"]):
        ip.run_cell_magic("monitor", "-o loss", body)
    text = cap.outputs[0].data["text/plain"]  # shown even with -o: the failure is why one looks
    assert "5 steps recorded" in text and "the cell raised at step 4" in text


def test_last_value_of_the_cell_is_displayed(ip: Any) -> None:
    with capture_output() as cap:
        ip.run_cell_magic("monitor", "-q loss", LOOP + "\nlen(losses)")
    assert cap.outputs[-1].data["text/plain"] == "30"


@pytest.mark.parametrize("line, match", [
    ("", "needs something to watch"),
    ("loss --every 3", "options go before"),
    ("loss -q", "options go before"),
    ("--every 0 loss", "every"),
    ("--spike 0.5 loss", "spike_factor"),
    ("--plateau 1 loss", "plateau_window"),
    ("--vanishing 1 --exploding 0.1 loss", "vanishing"),
    ("--every", "needs a value"),
    ("--every x loss", "bad arguments|invalid"),
    ("loss +", "not a comma-separated"),
    ("loss, loss", "once"),
])
def test_bad_lines_are_usage_errors(ip: Any, line: str, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        ip.run_cell_magic("monitor", line, LOOP)
    assert "losses" not in ip.user_ns  # nothing ran


def test_empty_cell_and_no_report_yet(ip: Any) -> None:
    with pytest.raises(UsageError, match="needs code below it"):
        ip.run_cell_magic("monitor", "loss", "  \n")
    ip.user_ns.pop("_monitor", None)
    with pytest.raises(UsageError, match="no report yet"):
        ip.run_line_magic("monitor", "")


def test_split_keeps_expressions_as_written() -> None:
    assert split_line('--every 2 --tensorboard "my runs" loss, opt.param_groups[0]["lr"]') == \
        ('--every 2 --tensorboard "my runs"', ' loss, opt.param_groups[0]["lr"]')
    assert split_expressions(' loss, opt.param_groups[0]["lr"] ') == ["loss", 'opt.param_groups[0]["lr"]']
    assert split_expressions("f(a, b), -reward") == ["f(a, b)", "-reward"]
    assert split_expressions("(a, b)") == ["(a, b)"]


def test_widget_state(ip: Any) -> None:
    r = ip.run_cell_magic("monitor", "-o loss, opt.param_groups[0]['lr']", LOOP)
    view = r.widget()
    meta = view.meta
    assert meta["expressions"] == ["loss", "opt.param_groups[0]['lr']"]
    assert meta["steps"] == list(range(0, 30)) and meta["layers"] == ["net.0", "net.2"]
    values = np.frombuffer(view.values, np.float32).reshape(30, 2)
    assert np.allclose(values[:25, 0], ip.user_ns["losses"][:25]) and np.isnan(values[25, 0])
    norms = np.frombuffer(view.norms, np.float32).reshape(30, 2)
    assert np.allclose(norms, r.history.grad_norm, equal_nan=True)
    assert [a["kind"] for a in meta["alerts"] if a["series"] == "loss"] == ["non-finite"]
    assert view.smoothing == 0.6 and view.zoom == [] and view.panel == "norm"


def test_hostile_namespace_does_not_trip_the_monitor(ip: Any) -> None:
    """Objects that raise when looked at (proxies, raising __class__, odd tensors) sit next to the
    model: layers are still named, and the expressions still evaluate."""
    from test_hostile import hostile_objects

    objects = hostile_objects()
    ip.user_ns.update(objects)
    try:
        r = ip.run_cell_magic("monitor", "-o loss", LOOP)
    finally:
        for name in objects:
            ip.user_ns.pop(name, None)
        objects.clear()
    assert r.history.layers == ("net.0", "net.2") and np.isfinite(r.history["loss"][:25]).all()
    assert "could not be inspected" in r.text() and "unbound_proxy" in r.text()  # said once, in a note


# -- issue 29: bad input is a UsageError before the cell runs, or an InputError in the twin -------
def test_a_tensorboard_directory_that_cannot_be_made_is_a_usage_error_before_the_cell_runs(ip: Any,
                                                                                        tmp_path: Any) -> None:
    pytest.importorskip("tensorboard")
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    ip.user_ns["ran"] = 0
    try:
        with pytest.raises(UsageError, match="cannot make the TensorBoard directory"):
            ip.run_cell_magic("monitor", f"--tensorboard {blocker / 'runs'} loss", "ran += 1\n" + LOOP)
        assert ip.user_ns["ran"] == 0 and "_monitor" not in ip.user_ns  # the training cell never ran
    finally:
        ip.user_ns.pop("ran", None)


@pytest.mark.parametrize("line, match", [("--bogus", "unrecognized arguments: --bogus"),
                                         ("stray args", "takes no expressions"),
                                         ("-o loss", "takes no expressions")])
def test_line_magic_refuses_what_it_would_ignore(ip: Any, line: str, match: str) -> None:
    with capture_output():
        ip.run_cell_magic("monitor", "loss", LOOP)
    with pytest.raises(UsageError, match=match):
        ip.run_line_magic("monitor", line)


def test_twins_refuse_a_namespace_that_is_not_a_mapping() -> None:
    from torch_nbdebug import monitor, repro
    from torch_nbdebug.errors import InputError

    with pytest.raises(InputError, match="namespace must be a mapping"):
        monitor("loss", namespace=5)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="namespace must be a dict"):
        repro(lambda: None, namespace=5)  # type: ignore[arg-type]
