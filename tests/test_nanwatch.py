"""%%nanwatch's Python twin on tiny CPU models: the seven cases of issue 2 and the options."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from torch_nbdebug.api import nanwatch as nanwatch_api
from torch_nbdebug.api.nanwatch import NanEvent, NanReport, last_report, nanwatch
from torch_nbdebug.errors import InputError, NanBirthError
from nanwatch_paths import marker_line, watch_kind  # noqa: F401 - every test under both op-mode watches

SRC = open(__file__).read().splitlines()


@pytest.fixture(autouse=True, params=["immediate", "deferred"])
def check_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every nanwatch test runs on both check paths: immediate (CPU's default) and deferred (CUDA's
    default, run here on CPU). ``nanwatch()`` and ``%%nanwatch`` without ``defer=`` pick the path
    from ``_cuda_in_use``; tests that pass ``defer=`` themselves keep it."""
    monkeypatch.setattr(nanwatch_api, "_cuda_in_use", lambda: request.param == "deferred")
    return str(request.param)


def line(marker: str) -> int:
    """1-based line of this file holding ``marker`` (a comment next to the code under test)."""
    return marker_line(SRC, marker)


class LogBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        return torch.log(h)  # @log-birth


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), LogBlock(), nn.Linear(4, 4), nn.Linear(4, 1))


# -- case 1: forward birth inside a module, propagating ------------------------------------------
def test_forward_birth_names_the_op_module_and_line_not_the_last_layer() -> None:
    model = make_model()
    x = torch.randn(8, 4)
    with nanwatch() as report:
        loss = model(x).sum()
        loss.backward()
    assert isinstance(report, NanReport)
    first = report.first
    assert isinstance(first, NanEvent)
    assert (first.phase, first.op, first.module, first.kind) == ("forward", "aten.log.default", "model.1", "nan")
    assert first.lineno == line("# @log-birth") and first.filename == __file__
    assert "log" in first.hint and "negative" in first.hint
    assert first.output is not None and first.output.nan > 0
    assert first.inputs and first.inputs[0].finite and first.inputs[0].min < 0
    # Later layers only propagated it: a single birth, and the table marks the birth row.
    assert len(report.events) == 1
    marked = [layer.module for layer in report.layers if layer.birth]
    assert marked == ["model.1"]
    rows = {layer.module: layer for layer in report.layers}
    assert rows["model.0"].fwd_finite is True and rows["model.3"].fwd_finite is False
    assert rows["model.0"].grad_finite is True  # gradients were recorded per layer too
    assert last_report() is report


def test_forward_birth_sequence_nr_matches_the_grad_fn() -> None:
    x = torch.tensor([-1.0, 2.0], requires_grad=True)
    with nanwatch() as report:
        y = torch.sqrt(x)  # @sqrt-fwd
    assert report.first.op == "aten.sqrt.default" and report.first.lineno == line("# @sqrt-fwd")
    assert report.first.sequence_nr == y.grad_fn._sequence_nr()


# -- case 2: births in backward ---------------------------------------------------------------------
class SqrtNorm(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt((x * x).sum(-1))  # @sqrt-at-zero


def test_backward_birth_sqrt_at_zero_names_node_and_forward_line() -> None:
    model = nn.Sequential(nn.Linear(3, 3), SqrtNorm())
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
    x = torch.randn(2, 3)
    with nanwatch() as report:
        out = model(x).sum()
        out.backward()
    assert math.isfinite(out.item())
    first = report.first
    assert first.phase == "backward" and first.op == "SqrtBackward0" and first.node_name == "SqrtBackward0"
    assert first.forward_op == "aten.sqrt.default" and first.module == "model.1"
    assert first.lineno == line("# @sqrt-at-zero") and first.kind == "inf"
    assert first.sequence_nr is not None and first.aten_op is not None
    assert "sqrt" in first.hint and "eps" in first.hint


def test_backward_birth_torch_where_trap() -> None:
    x = torch.tensor([0.0, 1.0, 2.0], requires_grad=True)
    with nanwatch() as report:
        y = torch.where(x > 0, torch.log(x), torch.zeros_like(x))  # @where-trap
        y.sum().backward()
    assert torch.isfinite(y).all() and torch.isnan(x.grad).any()
    first = report.first
    assert (first.phase, first.op, first.forward_op) == ("backward", "LogBackward0", "aten.log.default")
    assert first.lineno == line("# @where-trap") and first.kind == "nan"
    assert "torch.where" in first.hint
    # The forward -inf was thrown away by the where: listed apart, not as the first birth.
    assert [e.op for e in report.absorbed] == ["aten.log.default"]


# -- case 3: what detect_anomaly misses -------------------------------------------------------------
def test_nan_loss_with_finite_gradients() -> None:
    model = nn.Linear(3, 1)
    x = torch.randn(4, 3)
    offset = torch.tensor(-1.0)
    with nanwatch() as report:
        loss = model(x).sum() + torch.sqrt(offset)  # @nan-loss
        loss.backward()
    assert math.isnan(loss.item()) and all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert [(e.phase, e.op, e.lineno) for e in report.events] == [("forward", "aten.sqrt.default", line("# @nan-loss"))]


def test_inf_from_overflow_without_nan() -> None:
    x = torch.full((3,), 100.0)
    with nanwatch() as report:
        y = torch.exp(x)  # @exp-overflow
    assert torch.isinf(y).all()
    first = report.first
    assert (first.op, first.kind, first.lineno) == ("aten.exp.default", "inf", line("# @exp-overflow"))
    assert "exp" in first.hint and first.output.inf == 3 and first.output.nan == 0


def test_nan_under_no_grad_and_eval() -> None:
    model = make_model().eval()
    with nanwatch() as report, torch.no_grad():
        model(torch.randn(8, 4))
    assert model.training is False and torch.is_grad_enabled()
    assert (report.first.op, report.first.module, report.first.phase) == ("aten.log.default", "model.1", "forward")
    assert report.first.sequence_nr is None


# -- case 4: non-finite input data ------------------------------------------------------------------
def test_nonfinite_input_data_is_phase_input_naming_first_consumer() -> None:
    model = make_model()
    x = torch.randn(8, 4)
    x[2, 1] = float("nan")
    with nanwatch() as report:
        model(x)  # @input-consumer
    first = report.first
    assert first.phase == "input" and first.module == "model.0" and first.op == "aten.addmm.default"
    assert first.lineno == line("# @input-consumer")
    assert first.inputs and any(s.nan == 1 for s in first.inputs)
    assert "data" in first.hint
    # Nothing downstream is blamed (the log's NaN is hidden in NaN-land, not a new birth from finite inputs).
    assert [e.phase for e in report.events] == ["input"]


# -- case 5: optimizer ---------------------------------------------------------------------------------
def test_optimizer_step_births_with_parameter_name_and_iteration() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    x = torch.full((8, 4), 2.0)  # gradients stay 16 (weight) and 8 (bias) whatever the weights
    with nanwatch() as report:
        for i in range(1, 7):
            for group in opt.param_groups:
                group["lr"] = min(10.0 ** (8 * i), 1e38)  # passes float32's max in step 5; loss stays finite
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()  # @opt-step
    first = report.first
    assert first.phase == "optimizer" and first.param == "model.weight" and first.iteration == 5
    assert first.step == 4 and first.op == "SGD.step" and first.module == "model"  # four steps before it (one step axis)
    assert first.lineno == line("# @opt-step")
    assert "learning rate" in first.hint and "gradient finite" in first.detail
    assert {e.phase for e in report.events} == {"optimizer"}


# -- case 6: intentional infinities ---------------------------------------------------------------------
class CausalAttention(nn.Module):
    def __init__(self, d: int = 8, bad: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.bad = bad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        t = x.shape[1]
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        scores = scores * 2.0
        out = scores.softmax(-1) @ v
        if self.bad:
            out = torch.log(out - 10.0)  # @attn-real-nan
        return out


def test_masked_fill_minus_inf_is_not_a_birth_but_a_later_nan_is() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    attn = CausalAttention()
    with nanwatch() as report:
        attn(x).sum().backward()
    assert report.events == () and report.first is None
    bad = CausalAttention(bad=True)
    with nanwatch() as report:
        bad(x).sum().backward()
    assert report.first.op == "aten.log.default" and report.first.module == "bad"
    assert report.first.lineno == line("# @attn-real-nan")


def test_constants_are_not_births_arithmetic_infinities_are() -> None:
    x = torch.randn(4)
    with nanwatch() as report:
        mask = torch.full((4, 4), float("-inf")).triu(1)
        y = x + torch.tensor(float("inf"))
        z = x * float("inf")
        w = (mask + 1.0).exp()
    assert report.events == ()
    with nanwatch() as report:
        big = torch.tensor([1e30, 2.0]) * 1e10  # @mul-overflow
    assert (report.first.op, report.first.kind, report.first.lineno) == ("aten.mul.Tensor", "inf", line("# @mul-overflow"))


def test_fully_masked_softmax_row_is_a_nan_birth() -> None:
    scores = torch.randn(3, 3)
    with nanwatch() as report:
        masked = scores.masked_fill(torch.ones(3, 3, dtype=torch.bool), float("-inf"))
        probs = masked.softmax(-1)  # @all-masked
    assert report.first.op == "aten._softmax.default" and report.first.kind == "nan"
    assert report.first.lineno == line("# @all-masked") and "masked" in report.first.hint


# -- case 7: half precision --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,value", [(torch.float16, 300.0), (torch.bfloat16, 2e19)])
def test_half_precision_overflow(dtype: torch.dtype, value: float) -> None:
    model = nn.Linear(4, 4).to(dtype)
    x = torch.full((2, 4), value, dtype=dtype)
    with nanwatch() as report:
        h = model(x)
        y = x * x  # @half-overflow
    first = report.first
    assert first.kind == "inf" and first.lineno == line("# @half-overflow") and first.op == "aten.mul.Tensor"
    assert first.output.dtype == str(dtype).replace("torch.", "") and str(first.output.dtype) in first.hint


def test_float16_exp_overflow_hint_suggests_bfloat16_or_gradscaler() -> None:
    x = torch.full((4,), 12.0, dtype=torch.float16)
    with nanwatch() as report:
        torch.exp(x)
    assert report.first.op == "aten.exp.default" and "bfloat16" in report.first.hint


def test_nonfinite_parameter_before_the_watch_is_an_input_event_naming_it() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")
    with nanwatch() as report:
        model(torch.rand(8, 4))
    first = report.first
    assert (first.phase, first.module) == ("input", "model.2")
    assert first.detail == "non-finite parameter model.2.weight" and "re-initialise" in first.hint


class Attn(nn.Module):
    def __init__(self, bad: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.bad = bad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return (h - h) / (h - h) if self.bad else h  # @nested-birth


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"attn": Attn(bad=(i == 3))}) for i in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block["attn"](x)
        return x


def test_nested_module_path_as_the_user_writes_it() -> None:
    model = Blocks()
    with nanwatch() as report:
        model(torch.randn(2, 4)).sum().backward()
    first = report.first
    assert (first.module, first.op, first.kind) == ("model.blocks.3.attn", "aten.div.Tensor", "nan")
    assert first.lineno == line("# @nested-birth") and "0/0" in first.hint
    assert len(report.events) == 1


def test_additive_mask_made_before_the_watch_is_not_input_data() -> None:
    t = 5
    mask = nn.Transformer.generate_square_subsequent_mask(t)  # -inf above the diagonal, made outside
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
    x = torch.randn(2, t, 8)
    for defer in (False, True):
        with nanwatch(defer=defer) as report:
            layer(x, src_mask=mask).sum().backward()
            scores = (torch.randn(t, t) + mask) * 0.5  # the mask's -inf flows through checked ops
            probs = scores.softmax(-1)
        assert report.events == (), report.text()
    data = torch.randn(8, 4)
    data[0, 0] = float("inf")  # +inf in data is still reported
    model = make_model()
    with nanwatch() as report:
        model(data)
    assert report.first.phase == "input"


def test_where_trap_with_sqrt_of_negatives() -> None:
    x = torch.tensor([-1.0, 4.0], requires_grad=True)
    with nanwatch() as report:
        y = torch.where(x > 0, torch.sqrt(x), torch.zeros_like(x))  # @sqrt-where
        y.sum().backward()
    assert torch.isnan(x.grad[0]) and torch.isfinite(y).all()
    first = report.first
    assert (first.phase, first.op, first.forward_op, first.kind) == ("backward", "SqrtBackward0", "aten.sqrt.default", "nan")
    assert first.lineno == line("# @sqrt-where") and "torch.where" in first.hint
    assert [e.op for e in report.absorbed] == ["aten.sqrt.default"]
