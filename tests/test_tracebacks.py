"""What a user sees when the code under a magic fails: IPython's traceback of their cell, with no frame
of torch_nbdebug (the magics and the cell runner set ``__tracebackhide__``, which IPython honours)."""
from __future__ import annotations

import re
from typing import Any

import pytest
from IPython.utils.capture import capture_output

SETUP = "import torch\nmodel = torch.nn.Linear(2, 1)\nx = torch.ones(3, 2)\n"
MAGICS = ["%%nanwatch", "%%cudamem", "%%grads model", "%%explain", "%%graph"]
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture
def shell(ipython: Any) -> Any:
    assert ipython.run_cell(SETUP).success
    yield ipython
    for name in ("model", "x", "y", "loss", "_nanwatch", "_explain", "fail"):
        ipython.user_ns.pop(name, None)


def _traceback(shell: Any, cell: str) -> tuple[BaseException, str]:
    """Run a cell as Jupyter does; return its exception and the traceback text shown (no colours)."""
    with capture_output() as cap:
        result = shell.run_cell(cell)
    assert result.error_in_exec is not None, "the cell was expected to fail"
    return result.error_in_exec, _ANSI.sub("", cap.stdout + cap.stderr)


@pytest.mark.parametrize("magic", MAGICS)
def test_an_error_in_the_cell_body_shows_only_the_users_frames(shell: Any, magic: str) -> None:
    exc, text = _traceback(shell, f"{magic}\ny = model(x)\nraise ValueError('boom in the cell')\n")
    assert isinstance(exc, ValueError)
    assert "ValueError: boom in the cell" in text and "----> 2 raise ValueError('boom in the cell')" in text
    assert "torch_nbdebug" not in text, text


@pytest.mark.parametrize("magic", MAGICS)
def test_an_error_in_the_users_function_keeps_its_frame(shell: Any, magic: str) -> None:
    cell = f"{magic}\ndef fail(t):\n    raise KeyError(t.shape[0])\ny = model(x)\nfail(y)\n"
    exc, text = _traceback(shell, cell)
    assert isinstance(exc, KeyError)
    assert "----> 4 fail(y)" in text and "----> 2     raise KeyError(t.shape[0])" in text
    assert "torch_nbdebug" not in text, text


@pytest.mark.parametrize("magic", ["%%nanwatch", "%%grads model", "%%explain", "%%cudamem", "%%graph"])
def test_a_pytorch_error_shows_torchs_frames_and_not_ours(shell: Any, magic: str) -> None:
    """``F.cross_entropy`` is Python: under %%explain the recorder's torch-function mode runs between
    the cell and it, and that frame is hidden too."""
    cell = f"{magic}\nloss = torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2]))\n"
    exc, text = _traceback(shell, cell)
    assert isinstance(exc, (IndexError, RuntimeError))
    assert "torch/nn/functional.py" in text.replace("\\", "/")
    assert "torch_nbdebug/" not in text.replace("\\", "/"), text


@pytest.mark.parametrize("magic", ["%%nanwatch", "%%nanwatch --mode op", "%%grads model", "%%explain",
                                   "%%cudamem", "%%graph"])
def test_an_op_failing_in_c_under_a_mode_of_ours_shows_no_frame_of_ours(shell: Any, magic: str) -> None:
    """``F.linear`` is C: under %%explain the innermost Python frame is the recorder's mode, which
    IPython would always show; the exception hook leaves it out of what is shown (only)."""
    exc, text = _traceback(shell, f"{magic}\ny = model(torch.ones(3, 5))\n")
    assert isinstance(exc, RuntimeError) and "mat1 and mat2 shapes cannot be multiplied" in text
    assert "----> 1 y = model(torch.ones(3, 5))" in text and "torch/nn/modules/linear.py" in text.replace("\\", "/")
    assert "torch_nbdebug/" not in text.replace("\\", "/"), text


def test_the_exceptions_own_traceback_is_left_as_it_is(shell: Any) -> None:
    exc, text = _traceback(shell, "%%explain\ny = model(torch.ones(3, 5))\n")
    files = []
    tb = exc.__traceback__
    while tb is not None:
        files.append(tb.tb_frame.f_code.co_filename.replace("\\", "/"))
        tb = tb.tb_next
    assert files[-1].endswith("torch_nbdebug/record/explain/recorder.py")  # the mode called F.linear
    assert "torch_nbdebug/" not in text.replace("\\", "/")


def _frames(text: str) -> list[str]:
    """The functions of the frames a traceback shows, outermost first (no line numbers)."""
    return re.findall(r"^File .*?:\d+, in (.+)$", text, re.M)


@pytest.mark.parametrize("body", ["y = model(torch.ones(3, 5))\n", "loss = x.sum()\nloss.backward()\n",
                                  "loss = torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2]))\n"])
def test_explain_shows_the_frames_the_plain_cell_shows(shell: Any, body: str) -> None:
    """The card comes near the cell: no line calling the magic (``run_cell_magic``), no frames the
    recorder's function mode adds (``handle_torch_function``, ``Tensor.backward`` entered twice) and
    none its module hooks add (``_call_impl.<locals>.inner``)."""
    _, plain = _traceback(shell, body)
    _, text = _traceback(shell, "%%explain\n" + body)
    assert "run_cell_magic" not in text and "handle_torch_function(public_api" not in text, text
    assert _frames(text) == _frames(plain), text
    assert text.count("\nCell In[") == plain.count("\nCell In[") == 1
