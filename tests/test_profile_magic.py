"""%%profile through a real IPython shell: the bundle, the statement line in the cell, the module paths,
-o / _profile / %profile, --steps/--warmup/--trace, bad input as UsageError, the widget's state."""
from __future__ import annotations

import gc
import json
from typing import Any, Iterator

import pytest
import torch
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from torch_nbdebug.magics.profile import MAGICS

WIDGET = "application/vnd.jupyter.widget-view+json"

SETUP = """
import torch
from torch import nn
torch.manual_seed(0)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 8)
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 64), torch.randn(64, 8)
"""

LOOP = """for step in range(8):
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    slow = sorted(str(k) for k in range(40000))
"""


@pytest.fixture
def ip() -> Iterator[Any]:
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.register_magics(MAGICS)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # see tests/test_profile.py: a second thread's wake-ups are noise here
    shell.run_cell(SETUP)
    yield shell
    torch.set_num_threads(before)
    for kind, names in MAGICS.magics.items():
        for name in names:
            shell.magics_manager.magics[kind].pop(name, None)
    for name in ("Net", "model", "opt", "x", "y", "loss", "step", "slow", "_profile", "r"):
        shell.user_ns.pop(name, None)
    gc.collect()


def test_cell_magic_shows_one_bundle_and_names_the_cells_statement_and_the_modules(ip: Any) -> None:
    with capture_output() as cap:
        result = ip.run_cell("%%profile --steps 5\n" + LOOP, store_history=True)
    assert result.success, result
    count = ip.execution_count - 1
    assert len(cap.outputs) == 1
    data = cap.outputs[0].data
    assert {"text/plain", "text/html", WIDGET} <= set(data)
    assert "verdict: HOST" in data["text/plain"]
    assert "<img" in data["text/html"] and "Top lines" in data["text/html"]
    prof = ip.user_ns["_profile"]
    assert prof.verdict.kind == "host"
    line = prof.verdict.line
    assert line.text == "slow = sorted(str(k) for k in range(40000))" and line.lineno == 6
    assert line.cell == count and f"In [{count}], line 6: slow = sorted(" in data["text/plain"]
    assert {"model", "model.fc1", "model.fc2"} <= {m.path for m in prof.by_module}
    assert len(prof.breakdown) == 5


def test_o_returns_the_profile_and_the_line_magic_shows_the_last_one(ip: Any) -> None:
    with capture_output() as cap:
        prof = ip.run_cell_magic("profile", "-o --warmup 2 --steps 0", LOOP)
    assert not cap.outputs and prof is ip.user_ns["_profile"]
    assert [s.number for s in prof.breakdown] == [2, 3, 4, 5, 6, 7]
    with capture_output() as cap:
        ip.run_line_magic("profile", "")
    assert "%%profile" in cap.outputs[0].data["text/plain"]
    assert ip.run_line_magic("profile", "-o") is prof


def test_trace_writes_a_perfetto_file(ip: Any, tmp_path: Any) -> None:
    path = tmp_path / "step trace.json"
    with capture_output() as cap:
        ip.run_cell_magic("profile", f'-q --steps 2 --trace "{path}"', LOOP)
    assert "ui.perfetto.dev" in cap.stdout
    names = {e.get("name") for e in json.loads(path.read_text())["traceEvents"]}
    assert {"module: model.fc1", "module: model.fc2"} <= names


@pytest.mark.parametrize("line, cell, message", [
    ("--steps -1", LOOP, "--steps"),
    ("--warmup -2", LOOP, "--warmup"),
    ("--steps many", LOOP, "bad arguments|invalid"),
    ("--bogus", LOOP, "bad arguments|unrecognized"),
    ("", "   \n", "needs code|no code"),
    ("", "for i in range(3)\n    pass", "syntax error"),
    ("--trace ''", LOOP, "file name"),
])
def test_bad_input_is_a_usage_error(ip: Any, line: str, cell: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        ip.run_cell_magic("profile", line, cell)


def test_a_running_torch_profiler_is_a_usage_error_before_the_cell_runs(ip: Any) -> None:
    from torch.profiler import profile as torch_profile

    ip.user_ns["ran"] = []
    with torch_profile():
        with pytest.raises(UsageError, match="already running"):
            ip.run_cell_magic("profile", "", "ran.append(1)")
    assert ip.user_ns.pop("ran") == []


def test_no_report_yet_says_what_to_write(ip: Any) -> None:
    ip.user_ns.pop("_profile", None)
    with pytest.raises(UsageError, match="%%profile"):
        ip.run_line_magic("profile", "")


def test_the_users_exception_propagates_and_the_report_is_still_shown(ip: Any) -> None:
    cell = LOOP + "raise RuntimeError('boom')\n"
    with capture_output() as cap:
        result = ip.run_cell(f"%%profile -o\n{cell}")
    assert isinstance(result.error_in_exec, RuntimeError) and str(result.error_in_exec) == "boom"
    assert ip.user_ns["_profile"].data.status == "failed"
    assert any("the cell raised" in o.data["text/plain"] for o in cap.outputs)


def test_the_widget_carries_the_report_and_opens_a_line(ip: Any) -> None:
    ip.run_cell_magic("profile", "-q --steps 3", LOOP)
    view = ip.user_ns["_profile"].widget()
    report = view.report
    assert report["verdict"]["kind"] == "host"
    assert report["lines"][0]["where"].endswith("line 6")
    assert any("sorted(str(k)" in text for text in report["lines"][0]["context"])
    assert report["categories"] == ["data", "forward", "backward", "optimizer", "sync", "python"]
    assert len(report["timeline"]) > 0 and report["timeline_step"] in [s["number"] for s in report["steps"]]
    assert view.zoom == [] and view.opened == -1


def test_profile_help_is_the_magics_docstring(ip: Any) -> None:
    with capture_output() as cap:
        ip.run_line_magic("pinfo", "%profile")
    assert "--steps" in cap.stdout and "verdict" in cap.stdout
