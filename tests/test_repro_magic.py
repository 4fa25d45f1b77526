"""%%repro through a real IPython shell: state found in the namespace, run-once semantics, options, errors."""
from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from torch_nbdebug.api.repro import ReproReport, last_report
from torch_nbdebug.magics.repro import ReproMagics

SETUP = """
import random
import torch
from torch import nn
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
twin = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
twin.load_state_dict(net.state_dict())
opt = torch.optim.Adam(net.parameters(), lr=0.1)
twin_opt = torch.optim.Adam(twin.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
xb = torch.randn(16, 4)
steps = 0
"""
BODY = """loss = net(xb).pow(2).mean()
opt.zero_grad()
loss.backward()
opt.step()
sched.step()
steps += 1
"""
NAMES = ("random", "net", "twin", "opt", "twin_opt", "sched", "xb", "steps", "loss", "_repro", "r", "buf", "out", "nn")


@pytest.fixture
def ip(ipython: Any) -> Any:
    ipython.run_cell(SETUP)
    yield ipython
    for name in NAMES:
        ipython.user_ns.pop(name, None)


def _run(ip: Any, line: str, body: str) -> tuple[Any, list[dict[str, Any]]]:
    with capture_output() as cap:
        result = ip.run_cell_magic("repro", line, body)
    return result, [out.data for out in cap.outputs]


def test_identical_cell_runs_once_in_effect(ip: Any) -> None:
    result, [data] = _run(ip, "", BODY)
    assert result is None and {"text/plain", "text/html"} <= set(data)
    report = ip.user_ns["_repro"]
    assert isinstance(report, ReproReport) and last_report() is report and report.identical
    assert "identical" in data["text/plain"] and "<style" not in data["text/html"] and "<svg" not in data["text/html"]
    assert {"net", "opt", "sched", "xb"} <= set(report.summary.state)
    # One plain step on the twin, from the same RNG state the magic started from.
    ip.run_cell("torch.manual_seed(0)\n_ = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))\n"
                "_ = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))\n_ = torch.randn(16, 4)\n"
                "l2 = twin(xb).pow(2).mean(); twin_opt.zero_grad(); l2.backward(); twin_opt.step()")
    ns = ip.user_ns
    assert ns["steps"] == 1 and ns["sched"].last_epoch == 1 and ns["opt"].param_groups[0]["lr"] == pytest.approx(0.05)
    for p, q in zip(ns["net"].parameters(), ns["twin"].parameters()):
        assert torch.equal(p, q) and ns["opt"].state[p]["step"].item() == 1.0
    ns.pop("l2")


def test_no_restore_rng_names_the_dropout_line(ip: Any) -> None:
    _run(ip, "--no-restore-rng", BODY)
    report = ip.user_ns["_repro"]
    first = report.first
    assert report.cause == "rng" and (first.op, first.module, first.phase) == ("aten.bernoulli_.float", "net.1", "forward")
    assert (first.lineno, first.line) == (1, "loss = net(xb).pow(2).mean()")
    assert ip.user_ns["steps"] == 1


def test_external_value_in_the_cell(ip: Any) -> None:
    _run(ip, "--no-restore-rng", "r = torch.tensor(random.random())\nout = net[0](xb) * r\n")
    first = ip.user_ns["_repro"].first
    assert ip.user_ns["_repro"].cause == "external" and (first.lineno, first.op) == (1, "aten.lift_fresh.default")


def test_uninitialized_in_the_cell(ip: Any) -> None:
    # Whether the garbage differs between runs depends on the allocator; the read is reported either way.
    _run(ip, "", "buf = torch.empty(64)\nbuf.add_(1.0)\nout = buf.sum()\n")
    report = ip.user_ns["_repro"]
    assert report.uninitialized is not None and report.uninitialized.lineno == 2
    assert report.uninitialized.allocated_at == "line 1: buf = torch.empty(64)"
    if report.identical:
        assert report.cause is None
        assert any("line 2" in n and "agreed by chance" in n and "torch.zeros" in n for n in report.notes)
        assert "agreed by chance" in report.text()
    else:
        assert report.cause == "uninitialized" and report.first.lineno == 2
        assert report.first.allocated_at == "line 1: buf = torch.empty(64)"
        assert not any("agreed by chance" in n for n in report.notes)


def test_uninitialized_read_is_reported_when_the_garbage_matches(ip: Any) -> None:
    # Multiplying garbage by zero gives equal results in both runs (unless the garbage holds NaN/Inf): the
    # read must still be reported, not called reproducible without a word.
    _run(ip, "", "buf = torch.empty(64)\nbuf.mul_(0.0)\nout = buf.sum()\n")
    report = ip.user_ns["_repro"]
    assert report.uninitialized is not None and report.uninitialized.lineno == 2
    assert report.uninitialized.op.startswith("aten.mul_")
    if report.identical:
        assert any("agreed by chance" in n for n in report.notes)


def test_dash_o_returns_and_value_is_shown(ip: Any) -> None:
    result, outputs = _run(ip, "-o", "net(xb).sum()\n")
    assert isinstance(result, ReproReport) and result is ip.user_ns["_repro"]
    assert len(outputs) == 1 and "tensor(" in outputs[0]["text/plain"]  # the cell's value, once
    _, outputs = _run(ip, "-q", "out = net(xb)\n")
    assert outputs == []
    assert ip.run_line_magic("repro", "-o") is ip.user_ns["_repro"]


def test_user_exception_reraised_and_report_shown(ip: Any) -> None:
    ip.user_ns["boom"] = ValueError("mine")
    with capture_output() as cap:
        with pytest.raises(ValueError) as info:
            ip.run_cell_magic("repro", "", "out = net(xb)\nraise boom\n")
    assert info.value is ip.user_ns.pop("boom")
    assert any("text/html" in out.data for out in cap.outputs)
    assert "first run raised" in ip.user_ns["_repro"].text()


@pytest.mark.parametrize("line,body,message", [
    ("--bogus", BODY, "bogus"),
    ("", "   \n", "needs code"),
    ("", "x = (1,\n", "syntax error at line 1"),
    ("", "# only a comment\n", "no code to run"),
])
def test_bad_input_gives_usage_errors(ip: Any, line: str, body: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        ip.run_cell_magic("repro", line, body)


def test_help_lists_the_options_and_side_effects() -> None:
    doc = ReproMagics.repro.__doc__ or ""
    for flag in ("--no-restore-rng", "-o", "-q", "twice", "once"):
        assert flag in doc


def test_no_tensor_kept_alive(ip: Any) -> None:
    _run(ip, "", "big = torch.randn(64, 64, requires_grad=True)\nout = (big * 2).sum()\nout.backward()\n")
    ref = weakref.ref(ip.user_ns["big"])
    for name in ("big", "out"):
        ip.user_ns.pop(name)
    gc.collect()
    assert ref() is None


def test_keyboard_interrupt_leaves_nothing_behind(ip: Any) -> None:
    from torch_nbdebug.record.modules import global_hook_counts

    before = global_hook_counts()
    with pytest.raises(KeyboardInterrupt):
        _run(ip, "", "out = net(xb)\nraise KeyboardInterrupt\n")
    assert global_hook_counts() == before
