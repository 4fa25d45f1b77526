"""%grads and %%grads through a real IPython shell; the widget's synced state."""
from __future__ import annotations

import gc
from typing import Any, Iterator

import numpy as np
import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from torch_nbdebug.magics.grads import MAGICS

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
for _ in range(3):
    opt.zero_grad()
    loss = nn.functional.mse_loss(net(x), y)
    loss.backward()
    opt.step()
"""


@pytest.fixture
def ip() -> Iterator[Any]:
    """The real IPython shell with only the %grads magics registered (removed afterwards)."""
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.register_magics(MAGICS)
    shell.run_cell(SETUP)
    yield shell
    for kind, names in MAGICS.magics.items():
        for name in names:
            shell.magics_manager.magics[kind].pop(name, None)
    for name in ("net", "opt", "x", "y", "loss", "res", "r"):
        shell.user_ns.pop(name, None)
    gc.collect()


def test_line_magic_shows_text_html_and_widget(ip: Any) -> None:
    ip.run_cell("nn.functional.mse_loss(net(x), y).backward()")
    with capture_output() as cap:
        ip.run_line_magic("grads", "net")
    data = cap.outputs[0].data
    assert {"text/plain", "text/html", WIDGET} <= set(data)
    assert "net.0" in data["text/plain"] and "net.2" in data["text/plain"]
    assert 'class="tnd-figure tnd-flow"' in data["text/html"]


def test_line_magic_returns_the_report_with_o(ip: Any) -> None:
    ip.run_cell("nn.functional.mse_loss(net(x), y).backward()")
    report = ip.run_line_magic("grads", "-o net --layer net.2")
    assert report.layer_names == ("net.0", "net.2") and report.start_layer == 1
    assert report.layer("net.0").params[0].norm == pytest.approx(float(ip.user_ns["net"][0].weight.grad.norm()))


def test_cell_magic_records_every_step(ip: Any) -> None:
    with capture_output() as cap:
        ip.run_cell_magic("grads", "net", LOOP)
    data = cap.outputs[0].data
    assert {"text/plain", "text/html", WIDGET} <= set(data)
    assert "3 of 3 optimizer steps" in data["text/plain"]
    assert 'class="tnd-figure tnd-heatmap"' in data["text/html"] and "data:image/png;base64," in data["text/html"]
    res = ip.run_cell_magic("grads", "-o -a net", LOOP)
    assert res.steps == (0, 1, 2) and res.layer(1).activation is not None


def test_cell_magic_shows_the_report_and_reraises_the_users_error(ip: Any) -> None:
    with capture_output() as cap:
        result = ip.run_cell("%%grads net\n" + LOOP + "raise RuntimeError('loss went bad')\n")
    assert isinstance(result.error_in_exec, RuntimeError) and "loss went bad" in str(result.error_in_exec)
    assert any("3 of 3 optimizer steps" in o.data.get("text/plain", "") for o in cap.outputs)
    assert not any(len(m._forward_pre_hooks) for m in ip.user_ns["net"].modules())


@pytest.mark.parametrize("line, message", [
    ("nope", "name 'nope' is not defined"),
    ("x", "needs an nn.Module"),
    ("net", r"run loss.backward\(\) first"),
    ("net --bins 0", "bins"),
    ("", "arguments"),
])
def test_bad_input_is_a_usage_error(ip: Any, line: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        ip.run_line_magic("grads", line)


def test_cell_magic_without_body_or_with_bad_sample_is_a_usage_error(ip: Any) -> None:
    with pytest.raises(UsageError, match="needs code below it"):
        ip.run_cell_magic("grads", "net", "  \n")
    with pytest.raises(UsageError, match="sample must be"):
        ip.run_cell_magic("grads", "net --sample 0", LOOP)


def test_widget_state_carries_the_numbers(ip: Any) -> None:
    res = ip.run_cell_magic("grads", "-o net", LOOP)
    view = res.widget()
    meta = view.meta
    n_s, n_p, n_f = len(res.steps), len(res.trace.params), len(meta["fields"])
    stats = np.frombuffer(view.stats, dtype="<f4").reshape(n_s, n_p, n_f)
    np.testing.assert_allclose(stats, res.trace.stats.astype(np.float32), equal_nan=True)
    assert [layer["name"] for layer in meta["layers"]] == ["net.0", "net.2"]
    assert len(view.hist) == len(meta["hist_rows"]) * n_p * meta["bins"] * 4
    flow = np.frombuffer(view.flow, dtype="<f4").reshape(n_s, 2, 4)
    assert flow[-1, 0, 0] == pytest.approx(res.layer("net.0").norm, rel=1e-5)
    assert view.step == n_s - 1 and view.layer == res.start_layer


def test_through_load_ext_with_every_feature_loaded(ipython: Any) -> None:
    """The same magics as a user gets them: ``%load_ext torch_nbdebug`` (the shared fixture)."""
    ipython.run_cell(SETUP)
    try:
        with capture_output() as cap:
            result = ipython.run_cell("%%grads net\n" + LOOP)
        assert result.success
        data = cap.outputs[0].data
        assert {"text/plain", "text/html", WIDGET} <= set(data) and "net.2" in data["text/plain"]
    finally:
        for name in ("net", "opt", "x", "y", "loss"):
            ipython.user_ns.pop(name, None)
