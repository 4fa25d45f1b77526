"""%%explain and a ``torch.compile``'d model: compiled code runs eagerly under the recorder (and the
card says so), so its errors are the eager ones at the model's own line; the model is neither traced
with the recorder's function mode nor recompiled, and runs compiled again afterwards."""
from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch
from IPython.utils.capture import capture_output
from torch import nn

COMPILED = "CompiledFunctionBackward"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.fixture
def shell(ipython: Any) -> Iterator[Any]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.compile(Net(), backend="aot_eager")
    assert type(model(torch.randn(3, 4)).grad_fn).__name__ == COMPILED
    ipython.user_ns.update(model=model, torch=torch)
    yield ipython
    for name in ("model", "y", "_explain"):
        ipython.user_ns.pop(name, None)
    torch._dynamo.reset()


def test_a_compiled_model_is_not_recompiled_under_explain_and_stays_compiled(shell: Any) -> None:
    before = graphs()
    for _ in range(10):  # past dynamo's recompile limit (8), had each run traced the recorder's mode
        with capture_output() as cap:
            shell.run_cell_magic("explain", "", "y = model(torch.randn(3, 4))\n")
    assert "torch.compile'd code (model) ran eagerly while explain recorded it" in cap.stdout
    assert "runs compiled again afterwards" in cap.stdout
    assert graphs() == before  # nothing traced or recompiled
    model = shell.user_ns["model"]
    assert type(model(torch.randn(3, 4)).grad_fn).__name__ == COMPILED
    assert type(model(torch.randn(7, 4)).grad_fn).__name__ == COMPILED


def test_a_shape_error_inside_a_compiled_model_is_a_shape_error_at_the_models_line(shell: Any) -> None:
    with capture_output():
        with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
            shell.run_cell_magic("explain", "", "y = model(torch.randn(3, 5))\n")
    d = shell.user_ns["_explain"]
    assert (d.kind, d.op, d.module) == ("shape", "aten::linear", "model.fc1")
    assert d.line == "return self.fc2(torch.relu(self.fc1(x)))" and d.filename == __file__
    assert "expects 4 input features but gets 5" in d.hint
    assert "ran eagerly while explain recorded it" in d.note and "note" in d.text()
    model = shell.user_ns["model"]
    assert type(model(torch.randn(3, 4)).grad_fn).__name__ == COMPILED
