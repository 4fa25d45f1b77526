"""%%nanwatch through a real IPython shell: MIME output, _nanwatch, options and bad input."""
from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output

from torch_nbdebug.api.nanwatch import NanReport, last_report
from torch_nbdebug.errors import NanBirthError
from nanwatch_paths import watch_kind  # noqa: F401 - every test under both op-mode watches
from torch_nbdebug.magics.nanwatch import NanwatchMagics
from torch_nbdebug.render.bundle import WIDGET_MIME

from test_nanwatch import check_path  # noqa: F401 - every test on both check paths

SETUP = """
import torch
from torch import nn
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
    def forward(self, x):
        return torch.log(self.fc(x))
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 4), Block(), nn.Linear(4, 1))
xb = torch.randn(8, 4)
"""

LOG_LINE = SETUP.strip().splitlines().index("        return torch.log(self.fc(x))") + 1
BODY = """loss = net(xb).sum()
loss.backward()
"""


@pytest.fixture
def ip(ipython: Any) -> Any:
    ipython.run_cell(SETUP)
    yield ipython
    for name in ("net", "xb", "loss", "_nanwatch", "big", "Block"):
        ipython.user_ns.pop(name, None)


def _run(ip: Any, line: str, body: str) -> tuple[Any, list[dict[str, Any]]]:
    with capture_output() as cap:
        result = ip.run_cell_magic("nanwatch", line, body)
    return result, [out.data for out in cap.outputs]


def test_magic_shows_the_report_and_stores_it(ip: Any) -> None:
    result, outputs = _run(ip, "", BODY)
    assert result is None
    report = ip.user_ns["_nanwatch"]
    assert isinstance(report, NanReport) and last_report() is report
    first = report.first
    assert (first.phase, first.op, first.module, first.lineno) == ("forward", "aten.log.default", "net.1", LOG_LINE)
    assert first.line == "return torch.log(self.fc(x))"  # the line of the cell that defined Block
    [data] = outputs
    assert {"text/plain", "text/html", WIDGET_MIME} <= set(data)
    assert "aten.log.default" in data["text/plain"] and "net.1" in data["text/html"]


def test_cell_line_is_reported_for_births_in_the_cell(ip: Any) -> None:
    _run(ip, "", "a = torch.ones(3)\nb = torch.log(a - 2)\nc = b * 2\n")
    first = ip.user_ns["_nanwatch"].first
    assert (first.lineno, first.line, first.op) == (2, "b = torch.log(a - 2)", "aten.log.default")
    state = ip.user_ns["_nanwatch"].widget().report
    assert state["cell_source"].splitlines()[1] == "b = torch.log(a - 2)" and state["source_first_line"] == 1


def test_dash_o_returns_the_report(ip: Any) -> None:
    result, outputs = _run(ip, "-o", BODY)
    assert isinstance(result, NanReport) and result is ip.user_ns["_nanwatch"]
    assert outputs == []  # shown once, as the cell's result


def test_user_exception_is_reraised_unchanged_and_report_shown(ip: Any) -> None:
    ip.user_ns["boom"] = ValueError("mine")
    with pytest.raises(ValueError) as info:
        _run(ip, "", BODY + "raise boom\n")
    assert info.value is ip.user_ns.pop("boom")
    assert ip.user_ns["_nanwatch"].first.op == "aten.log.default"


def test_raise_flag_raises_at_the_birth_and_shows_report(ip: Any) -> None:
    with capture_output() as cap:
        with pytest.raises(NanBirthError) as info:
            ip.run_cell_magic("nanwatch", "--raise", "a = torch.ones(2)\nb = torch.sqrt(-a)\nran = True\n")
    assert "ran" not in ip.user_ns
    assert info.value.event.lineno == 2 and "line 2" in str(info.value) and "torch.sqrt(-a)" in str(info.value)
    assert any("text/html" in out.data for out in cap.outputs)
    assert ip.user_ns["_nanwatch"].first.op == "aten.sqrt.default"


def test_options_reach_the_watch(ip: Any) -> None:
    _run(ip, "--mode module --no-backward --no-optimizer --ignore-inf", BODY)
    report = ip.user_ns["_nanwatch"]
    assert report.summary.mode == "module" and report.first.module == "net.1"
    opts = report.summary.options
    assert (opts["backward"], opts["optimizer"], opts["ignore_inf"]) == (False, False, True)
    _, outputs = _run(ip, "-q", BODY)
    assert outputs == []


@pytest.mark.parametrize("line,body,message", [
    ("--bogus", BODY, "bogus"),
    ("--mode fast", BODY, "fast"),
    ("", "   \n", "needs code"),
    ("", "x = (1,\n", "syntax error at line 1"),
])
def test_bad_input_gives_usage_errors(ip: Any, line: str, body: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        ip.run_cell_magic("nanwatch", line, body)


def test_cell_without_torch_gets_a_note(ip: Any) -> None:
    _, [data] = _run(ip, "", "total = sum(range(5))\n")
    assert "no torch operations" in data["text/plain"]
    ip.user_ns.pop("total", None)


def test_help_lists_the_options() -> None:
    doc = NanwatchMagics.nanwatch.__doc__ or ""
    for flag in ("--raise", "--mode", "--no-backward", "--no-optimizer", "--ignore-inf", "-o"):
        assert flag in doc


def test_memory_after_the_magic_equals_memory_before(ip: Any) -> None:
    _run(ip, "", "big = torch.randn(256, 256, requires_grad=True)\nout = torch.log(big).sum()\nout.backward()\n")
    ref = weakref.ref(ip.user_ns["big"])
    for name in ("big", "out"):
        ip.user_ns.pop(name)
    gc.collect()
    assert ref() is None


def test_keyboard_interrupt_leaves_nothing_behind(ip: Any) -> None:
    from torch_nbdebug.record.modules import global_hook_counts

    before = global_hook_counts()
    with pytest.raises(KeyboardInterrupt):
        _run(ip, "", BODY + "raise KeyboardInterrupt\n")
    assert global_hook_counts() == before
    assert ip.user_ns["_nanwatch"].first.op == "aten.log.default"
