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


# -- issue 29: what a cell writes in place is restored, whatever the tensor; grad mode too ----------
ODD_TENSORS = """
import warnings
class Tagged(torch.Tensor):
    pass
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # beta/prototype warnings of the layouts
    coo = torch.tensor([[0., 2.], [3., 0.]]).to_sparse()
    csr = torch.tensor([[0., 2.], [3., 0.]]).to_sparse_csr()
    nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    jagged = torch.nested.nested_tensor([torch.ones(2, 3), torch.ones(4, 3)], layout=torch.jagged)
tagged = torch.ones(3).as_subclass(Tagged)
"""
ODD_NAMES = ("warnings", "Tagged", "coo", "csr", "nested", "jagged", "tagged")


@pytest.mark.parametrize("name, write, expected", [
    ("coo", "coo.mul_(2)", "coo.to_dense().tolist() == [[0., 4.], [6., 0.]]"),
    ("coo", "coo.add_(torch.tensor([[1., 0.], [0., 0.]]).to_sparse())",  # one more stored element
     "coo.to_dense().tolist() == [[1., 2.], [3., 0.]]"),
    ("csr", "csr.mul_(2)", "csr.to_dense().tolist() == [[0., 4.], [6., 0.]]"),
    ("nested", "nested.mul_(2)", "nested.to_padded_tensor(0.).tolist() == [[2., 2., 0.], [2., 2., 2.]]"),
    ("jagged", "jagged.mul_(2)", "(jagged.values() == 2).all().item()"),
    ("tagged", "tagged.mul_(2)", "tagged.tolist() == [2., 2., 2.] and type(tagged) is Tagged"),
])
def test_sparse_nested_and_subclass_tensors_written_in_place_are_written_once(ip: Any, name: str, write: str,
                                                                             expected: str) -> None:
    """Before, these tensors were left out of the snapshot: the cell's in-place write happened twice
    (2 x 2 = 4) while the report said the runs were identical."""
    assert ip.run_cell(ODD_TENSORS).success
    try:
        _run(ip, "", f"out = {write}\n")
        report = ip.user_ns["_repro"]
        assert ip.ev(expected), f"{name} after %%repro: written twice?"
        assert report.identical and name in report.summary.state, report.text()
    finally:
        for n in ODD_NAMES:
            ip.user_ns.pop(n, None)


def test_a_cell_that_turns_autograd_off_runs_twice_from_the_same_grad_mode(ip: Any) -> None:
    """Before, the second run started with autograd off (the first run's last line): backward failed
    only under %%repro."""
    body = "loss = net(xb).pow(2).mean()\nloss.backward()\nout = torch.set_grad_enabled(False)\n"
    try:
        _run(ip, "", body)
        assert not torch.is_grad_enabled()  # as if the cell ran once
    finally:
        torch.set_grad_enabled(True)
    assert ip.user_ns["_repro"].identical, ip.user_ns["_repro"].text()


def test_a_user_exception_under_repro_shows_only_the_users_frames(ip: Any) -> None:
    """As under every other magic (tests/test_tracebacks.py): the user's exception, raised in the cell,
    in a function of theirs or by an op under the recorder's dispatch mode, with no frame of ours."""
    import re

    for cell, shown in [("y = net(xb)\nraise ValueError('boom in the cell')\n", "----> 2 raise ValueError('boom in the cell')"),
                        ("def fail(t):\n    raise KeyError(t.shape[0])\nfail(net(xb))\n", "----> 3 fail(net(xb))"),
                        ("y = net(torch.ones(3, 5))\n", "mat1 and mat2 shapes cannot be multiplied")]:
        with capture_output() as cap:
            result = ip.run_cell("%%repro\n" + cell)
        assert result.error_in_exec is not None
        text = re.sub(r"\x1b\[[0-9;]*m", "", cap.stdout + cap.stderr)
        assert shown in text, text
        assert "torch_nbdebug" not in text, text
