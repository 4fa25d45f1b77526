"""Live views of %%nanwatch, %%grads, %%cudamem and %%profile through a real IPython shell.

The tests' shell is a terminal shell: first that it shows exactly what it showed before (no live view),
then, with the front-end check answering yes, what a notebook gets: the live view at once, updates
while the cell runs, the report in its place at the end (also when the cell failed or was stopped).
"""
from __future__ import annotations

import gc
from typing import Any

import pytest
import traitlets
from IPython.core.displaypub import DisplayPublisher

from torch_nbdebug.render import live
from torch_nbdebug.render.bundle import WIDGET_MIME

SETUP = """
import time, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(16, 4)
"""
LOOP = """
for i in range(8):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    if i == 3:
        loss = loss * torch.log(-x.abs()).sum()  # NaN born at iteration 3 (backward, optimizer follow)
    loss.backward()
    opt.step()
    time.sleep(0.01)
{tail}
"""
CELLS = {
    "nanwatch": "%%nanwatch\n",
    "grads": "%%grads model\n",
    "cudamem": "%%cudamem --no-lines\n",
    "profile": "%%profile --steps 4\n",
}


class Publisher(DisplayPublisher):
    """IPython's display publisher, recording what it is asked to publish instead of printing it."""

    def __init__(self, shell: Any) -> None:
        super().__init__(shell=shell)
        self.sent: list[dict[str, Any]] = []

    def publish(self, data: Any, metadata: Any = None, *, transient: Any = None, update: bool = False,
                **kw: Any) -> None:
        self.sent.append({"data": data, "transient": transient or {}, "update": update})


@pytest.fixture
def shell(ipython: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The shell with SETUP run, its display publisher recording, and every LiveView's updates kept."""
    snapshots: list[dict[str, Any]] = []

    class RecordedView(live.LiveView):
        @traitlets.observe("updates")
        def _keep(self, change: Any) -> None:
            snapshots.append({"steps": self.steps, "status": self.status, "panels": self.panels,
                              "alert": self.alert, "elapsed": self.elapsed})

    monkeypatch.setattr(live, "LiveView", RecordedView)
    monkeypatch.setattr(live, "DEFAULT_INTERVAL", 1e-6)  # an update at every step: the test loop is short
    assert ipython.run_cell(SETUP).success
    monkeypatch.setattr(ipython, "display_pub", Publisher(ipython))
    ipython.snapshots = snapshots
    yield ipython
    del ipython.snapshots
    for name in ("model", "opt", "x", "loss", "i", "_nanwatch", "_profile"):
        ipython.user_ns.pop(name, None)
    gc.collect()


def notebook(monkeypatch: pytest.MonkeyPatch, shell: Any) -> None:
    """Answer yes to "is there a live front end" (as under ipykernel)."""
    monkeypatch.setattr(live, "live_frontend", lambda given=None: shell)


def run(shell: Any, magic: str, tail: str = "") -> Any:
    return shell.run_cell(CELLS[magic] + LOOP.format(tail=tail))


@pytest.mark.parametrize("magic", sorted(CELLS))
def test_a_terminal_shell_shows_only_the_report(shell: Any, magic: str) -> None:
    result = run(shell, magic)
    assert result.success
    sent = shell.display_pub.sent
    assert len(sent) == 1 and not sent[0]["update"] and not sent[0]["transient"], sent
    assert shell.snapshots == []


@pytest.mark.parametrize("magic", sorted(CELLS))
def test_live_view_updates_while_running_then_the_report_replaces_it(
        shell: Any, magic: str, monkeypatch: pytest.MonkeyPatch) -> None:
    notebook(monkeypatch, shell)
    result = run(shell, magic)
    assert result.success
    first, last = shell.display_pub.sent[0], shell.display_pub.sent[-1]
    # shown, then replaced through an empty text output (a fresh renderer for the report's widget)
    assert len(shell.display_pub.sent) == 3 and shell.display_pub.sent[1]["data"] == {"text/plain": ""}
    assert not first["update"] and WIDGET_MIME in first["data"] and f"%%{magic}" in first["data"]["text/plain"]
    assert last["update"] and last["transient"] == first["transient"] and "running" not in last["data"]["text/plain"]
    steps = [s["steps"] for s in shell.snapshots]
    assert steps == sorted(steps) and steps[-1] == 8 and len(steps) >= 2  # one per step at this interval
    final = shell.snapshots[-1]
    if magic == "nanwatch":
        assert final["alert"] and "birth" in final["status"]
        table = final["panels"][0]
        assert table["kind"] == "table" and any("log" in row[4] for row in table["rows"])
        assert last["data"]["text/plain"] == shell.user_ns["_nanwatch"].text()
    elif magic == "grads":
        lines = final["panels"][0]
        assert lines["kind"] == "lines" and lines["x"] == list(range(8))
        assert [s["name"] for s in lines["series"]] == ["whole model", "model.0", "model.2"]
        assert lines["series"][0]["y"][3] is None  # the non-finite gradient of iteration 3 is a gap
        assert last["data"]["text/plain"].startswith("gradients of model")
    elif magic == "profile":
        statuses = [s["status"] for s in shell.snapshots]
        assert any(s.startswith("profiling: ") for s in statuses)  # during the profiled steps
        assert "profiling done" in statuses[-1] and statuses[-1].startswith("8 optimizer steps")  # 1 + 4, then on
        assert last["data"]["text/plain"] == shell.user_ns["_profile"].text()
    else:
        stack = final["panels"][0]
        by_name = {s["name"]: s["y"] for s in stack["series"]}
        assert stack["kind"] == "stack" and stack["unit"] == "bytes"
        # The model's parameters (float32), and whatever parameters earlier tests left alive in the process.
        assert by_name["parameters"][-1] >= (4 * 8 + 8 + 8 + 1) * 4
        assert len(set(by_name["parameters"])) == 1  # the loop makes no parameters
        assert by_name["gradients"][-1] > 0
        assert len(stack["x"]) == len(shell.snapshots)


@pytest.mark.parametrize("magic", sorted(CELLS))
def test_a_failed_cell_keeps_its_error_and_shows_what_was_recorded(
        shell: Any, magic: str, monkeypatch: pytest.MonkeyPatch) -> None:
    notebook(monkeypatch, shell)
    result = run(shell, magic, tail="raise ValueError('the users own error')")
    assert isinstance(result.error_in_exec, ValueError) and str(result.error_in_exec) == "the users own error"
    last = shell.display_pub.sent[-1]
    assert last["update"] and last["transient"] == shell.display_pub.sent[0]["transient"]
    assert "running" not in last["data"]["text/plain"] and last["data"]["text/plain"]


@pytest.mark.parametrize("magic", sorted(CELLS))
def test_a_stopped_cell_stops_and_shows_what_was_recorded(
        shell: Any, magic: str, monkeypatch: pytest.MonkeyPatch) -> None:
    notebook(monkeypatch, shell)
    result = shell.run_cell(CELLS[magic] + LOOP.replace("    opt.step()\n", "    opt.step()\n    if i == 5: "
                                                        "raise KeyboardInterrupt\n").format(tail="stopped = False"))
    assert isinstance(result.error_in_exec, KeyboardInterrupt) and "stopped" not in shell.user_ns
    sent = shell.display_pub.sent
    assert sent[-1]["update"] and sent[-1]["transient"] == sent[0]["transient"]
    text = sent[-1]["data"]["text/plain"]
    if magic == "grads":
        assert "6 of 6 optimizer steps" in text
    elif magic == "nanwatch":
        assert text == shell.user_ns["_nanwatch"].text() and shell.user_ns["_nanwatch"].events
    elif magic == "profile":
        assert text.startswith("%%profile") and "stopped" in text and shell.user_ns["_profile"].breakdown
    else:
        assert text.startswith("memory")


def test_a_stop_landing_in_a_live_update_stops_the_cell(shell: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_nbdebug.magics import _live

    notebook(monkeypatch, shell)

    def interrupted(self: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(_live.GradsProgress, "__call__", interrupted)
    result = run(shell, "grads", tail="finished = True")
    assert isinstance(result.error_in_exec, KeyboardInterrupt) and "finished" not in shell.user_ns
    assert shell.display_pub.sent[-1]["update"]  # the report of what was recorded replaced the view


@pytest.mark.parametrize("cell", ["%%nanwatch -q\n", "%%nanwatch -o\n", "%%grads model -o\n",
                                  "%%cudamem -o --no-lines\n", "%%profile -o\n", "%%profile -q\n"])
def test_no_live_view_when_the_report_is_not_shown(shell: Any, cell: str, monkeypatch: pytest.MonkeyPatch) -> None:
    notebook(monkeypatch, shell)
    assert shell.run_cell(cell + LOOP.format(tail="")).success
    assert shell.snapshots == []
    assert not any(s["transient"] for s in shell.display_pub.sent)


def test_live_memory_view_follows_a_forward_only_loop(shell: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An evaluation loop makes no optimizer step: the view showed "running · 0 steps" and nothing else."""
    notebook(monkeypatch, shell)
    loop = "losses = []\nwith torch.no_grad():\n    for i in range(10):\n        out = model(x)\n        losses.append(out)"
    assert shell.run_cell("%%cudamem --no-lines\n" + loop).success
    assert shell.snapshots, "no live update while the forward-only loop ran"
    statuses = [s["status"] for s in shell.snapshots]
    assert all(s["steps"] == 0 for s in shell.snapshots)  # no optimizer step: counted as none
    assert "10 forward calls so far" in statuses[-1], statuses
    assert shell.snapshots[-1]["panels"][0]["kind"] == "stack"  # bytes by category, while it ran
    assert "10 iteration(s)" in shell.display_pub.sent[-1]["data"]["text/plain"]  # was "1 iteration(s)"
    result = shell.run_cell("%%cudamem -o --no-lines\n" + loop)
    timeline = result.result
    shell.user_ns.pop("losses", None)
    shell.user_ns.pop("out", None)
    assert timeline.iterations == 10
    assert [leak.holder for leak in timeline.leaks] == ["losses"]  # `out` is losses[9]: one card, not two
