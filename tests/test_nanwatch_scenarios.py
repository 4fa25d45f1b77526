"""Scenarios a demanding PyTorch user tries with nanwatch, beyond the seven cases of issue 2.

Each test says in its docstring what an experienced user expects where the behaviour is debatable.
"""
from __future__ import annotations

import gc
import math
import threading
import time
import traceback
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output
from torch import nn

from torch_nbdebug.api.nanwatch import NanReport, nanwatch
from nanwatch_paths import marker_line, watch_kind  # noqa: F401 - every test under both op-mode watches
from torch_nbdebug.errors import NanBirthError

from test_nanwatch import check_path  # noqa: F401 - every test on both check paths

SRC = open(__file__).read().splitlines()


def line(marker: str) -> int:
    """1-based line of this file holding ``marker`` (a comment next to the code under test)."""
    return marker_line(SRC, marker)


# -- deep models: module paths ---------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, d: int, bad: bool) -> None:
        super().__init__()
        self.q = nn.Linear(d, d)
        self.bad = bad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.q(x)
        if self.bad:
            h = torch.sqrt(h - 10.0)  # @deep-birth
        return h


class Block(nn.Module):
    def __init__(self, d: int, bad: bool) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = Attention(d, bad)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln(x))
        return x + self.mlp(x)


class Deep(nn.Module):
    def __init__(self, d: int = 8, n: int = 6, bad_at: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d, i == bad_at) for i in range(n))
        self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_birth_deep_in_a_modulelist_of_custom_blocks() -> None:
    torch.manual_seed(0)
    model = Deep()
    with nanwatch() as report:
        model(torch.randn(2, 5, 8)).mean().backward()
    first = report.first
    assert (first.phase, first.op, first.module) == ("forward", "aten.sqrt.default", "model.blocks.3.attn")
    assert first.lineno == line("# @deep-birth") and first.kind == "nan"
    assert [e.phase for e in report.events] == ["forward"], report.text()
    assert [layer.module for layer in report.layers if layer.birth] == ["model.blocks.3.attn"]
    rows = {layer.module: layer for layer in report.layers}
    assert rows["model.blocks.2"].fwd_finite is True and rows["model.head"].fwd_finite is False


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, bad: bool = False) -> torch.Tensor:
        h = self.fc(x)
        return torch.log(h - 100.0) if bad else h  # @shared-birth


class TwoCalls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = Shared()
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.shared(self.shared(x), bad=True))


def test_shared_module_called_twice_is_named_once_and_counted_twice() -> None:
    net = TwoCalls()
    with nanwatch() as report:
        net(torch.randn(2, 4)).sum().backward()
    assert (report.first.module, report.first.lineno) == ("net.shared", line("# @shared-birth"))
    rows = {layer.module: layer for layer in report.layers}
    assert rows["net.shared"].calls == 2 and rows["net.shared.fc"].calls == 2


def test_model_created_inline_is_named_by_its_class() -> None:
    """A model never stored in a variable gets the lower-cased class name as its root (debatable;
    it is what torchinfo-style tools show)."""
    with nanwatch() as report:
        nn.Sequential(nn.Linear(4, 4), Shared())(torch.randn(2, 4))
        Shared()(torch.randn(2, 4), bad=True)
    assert (report.first.module, report.first.op) == ("shared", "aten.log.default")


def test_model_defined_inside_the_watched_block_is_named_by_its_variable() -> None:
    with nanwatch() as report:
        fresh = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Identity(), TwoCalls()))
        fresh(torch.randn(2, 4))
    assert report.first.module == "fresh.1.1.shared"


# -- births in backward -----------------------------------------------------------------------------
EDGE_CASES = {
    "acos": (lambda x: torch.acos(x), "AcosBackward0", "aten.acos.default"),  # @edge-acos
    "pow": (lambda x: torch.pow(x - 1.0, 0.5), "PowBackward0", "aten.pow.Tensor_Scalar"),  # @edge-pow
    # 1 / 1e-30 is finite, but its gradient -1 / (1e-30)**2 underflows the square to 0: -inf.
    "div": (lambda x: x / (x * 1e-30), "DivBackward0", "aten.div.Tensor"),  # @edge-div
}


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_backward_births_at_the_edge_of_a_domain(name: str) -> None:
    """Forward finite, gradient infinite: the node, and the forward op and line (the lambda's)."""
    fn, node, fwd_op = EDGE_CASES[name]
    x = torch.ones(3, requires_grad=True)
    with nanwatch() as report:
        y = fn(x)
        y.sum().backward()
    assert torch.isfinite(y).all() and not torch.isfinite(x.grad).all()
    first = report.first
    assert first is not None, name
    assert (first.phase, first.op, first.kind, first.forward_op) == ("backward", node, "inf", fwd_op)
    assert first.lineno == line(f"# @edge-{name}") and first.forward_lineno == first.lineno
    assert first.hint


def test_norm_of_a_zero_vector_is_not_a_false_alarm() -> None:
    """PyTorch's norm gradient computes 0/0 inside and masks it to 0: the gradient is finite, so an
    experienced user expects no report (anything else trains people to ignore the tool)."""
    v = torch.zeros(3, requires_grad=True)
    with nanwatch() as report:
        v.norm().backward()
    assert torch.isfinite(v.grad).all()
    assert report.events == (), report.text()


def test_where_trap_with_a_python_scalar_branch() -> None:
    x = torch.tensor([0.0, 1.0, 2.0], requires_grad=True)
    with nanwatch() as report:
        y = torch.where(x > 0, torch.log(x), 0.0)  # @where-scalar
        y.sum().backward()
    first = report.first
    assert (first.phase, first.op, first.forward_op) == ("backward", "LogBackward0", "aten.log.default")
    assert first.lineno == line("# @where-scalar") and "torch.where" in first.hint


def test_log_masked_in_place_is_absorbed_in_forward_and_trapped_in_backward() -> None:
    """``y = log(x); y.masked_fill_(x <= 0, 0)`` is the in-place spelling of the where trap."""
    x = torch.tensor([0.0, 1.0, 2.0], requires_grad=True)
    with nanwatch() as report:
        y = torch.log(x)
        y.masked_fill_(x <= 0, 0.0)
        y.sum().backward()
    assert report.first.phase == "backward" and report.first.op == "LogBackward0"
    assert [e.op for e in report.absorbed] == ["aten.log.default"]


class BadGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad / (x - x)  # @custom-backward


def test_custom_function_backward_points_at_the_users_backward_line() -> None:
    """The NaN is made by the user's own backward code: that line is the one to fix."""
    x = torch.ones(3, requires_grad=True)
    with nanwatch() as report:
        BadGrad.apply(x).sum().backward()
    first = report.first
    assert (first.phase, first.op, first.kind) == ("backward", "BadGradBackward", "inf")
    assert first.lineno == line("# @custom-backward") and first.aten_op == "aten.div.Tensor"
    assert "your own backward" in first.detail and "gradcheck" in first.hint


def test_tensor_hook_that_makes_inf_points_at_the_hook() -> None:
    x = torch.ones(3, requires_grad=True)
    with nanwatch() as report:
        y = x * 3  # @hooked-forward
        y.register_hook(lambda g: g / 0.0)  # @bad-hook
        y.sum().backward()
    first = report.first
    assert first.phase == "backward" and first.kind == "inf"
    assert first.lineno == line("# @bad-hook") and first.forward_lineno == line("# @hooked-forward")


def test_sum_of_huge_finite_values_is_a_birth_even_if_its_input_sum_overflows() -> None:
    """A cheap check sums each tensor; a sum of huge *finite* values overflowing must neither make
    the inputs look non-finite (that hid this birth) nor flag the finite tensor itself."""
    x = torch.ones(3)
    with nanwatch() as report:
        big = x * 3e38
        total = big.sum()  # @huge-sum
    assert torch.isfinite(big).all() and torch.isinf(total)
    assert [(e.op, e.kind, e.lineno) for e in report.events] == [("aten.sum.default", "inf", line("# @huge-sum"))]


def test_gradient_accumulation_overflow_in_accumulate_grad() -> None:
    """Without zero_grad, .grad grows each backward until it passes float32's max."""
    x = torch.ones(3, requires_grad=True)
    with nanwatch() as report:
        for _ in range(3):
            (x * 2e38)[0].backward()  # @accumulate
    first = report.first
    assert (first.phase, first.op, first.kind, first.iteration) == \
        ("backward", "torch::autograd::AccumulateGrad", "inf", 2)
    assert first.lineno == line("# @accumulate") and "zero_grad" in first.hint


def test_where_trap_through_autograd_grad() -> None:
    x = torch.tensor([0.0, 1.0], requires_grad=True)
    with nanwatch() as report:
        y = torch.where(x > 0, torch.log(x), 0.0)  # @grad-api
        (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.isnan(g[0])
    assert (report.first.op, report.first.lineno) == ("LogBackward0", line("# @grad-api"))


def test_raise_in_backward_stops_the_backward_with_the_report() -> None:
    x = torch.zeros(2, requires_grad=True)
    with pytest.raises(NanBirthError) as info:
        with nanwatch(raise_on_birth=True) as report:
            torch.sqrt(x).sum().backward()  # @raise-backward
    assert info.value.event.op == "SqrtBackward0" and info.value.report is report
    assert info.value.event.lineno == line("# @raise-backward")
    assert x.grad is None  # stopped before the gradient was accumulated


# -- births in forward ------------------------------------------------------------------------------
def test_log_of_zero_is_an_inf_birth_with_an_eps_hint() -> None:
    p = torch.tensor([0.0, 0.5, 0.5])
    with nanwatch() as report:
        ent = -(p * torch.log(p)).sum()  # @entropy
    assert math.isnan(ent.item())
    events = report.events
    assert (events[0].op, events[0].kind, events[0].lineno) == ("aten.log.default", "inf", line("# @entropy"))
    assert "clamp" in events[0].hint and "eps" in events[0].hint
    # 0 * -inf is a second, NaN birth at the same line (an infinity met a zero).
    assert (events[1].op, events[1].kind) == ("aten.mul.Tensor", "nan") and "0 * inf" in events[1].hint


@pytest.mark.parametrize("dtype,big", [(torch.float16, 12.0), (torch.bfloat16, 100.0)])
def test_exp_overflow_in_half_types(dtype: torch.dtype, big: float) -> None:
    """bfloat16 overflows only past ~3.4e38 (exp(89)), float16 past 65504 (exp(11.1))."""
    x = torch.full((4,), big, dtype=dtype)
    safe = torch.full((4,), 11.0 if dtype == torch.float16 else 88.0, dtype=dtype)
    with nanwatch() as report:
        torch.exp(safe)
        torch.exp(x)  # @half-exp
    assert [(e.op, e.kind, e.lineno) for e in report.events] == [("aten.exp.default", "inf", line("# @half-exp"))]
    assert report.first.output.dtype == str(dtype).replace("torch.", "")


def test_casting_to_float16_overflows_is_a_birth() -> None:
    """``x.half()`` on values past 65504 makes inf from finite data: the most common float16 birth."""
    x = torch.tensor([1e5, 1.0])
    buf = torch.empty(2, dtype=torch.float16)
    with nanwatch() as report:
        h = x.half()  # @cast-half
        buf.copy_(x)  # @copy-half
        b = x.to(torch.bfloat16).float()
    assert [(e.op, e.kind, e.lineno) for e in report.events] == [
        ("aten._to_copy.default", "inf", line("# @cast-half")), ("aten.copy_.default", "inf", line("# @copy-half"))]
    assert "65504" in report.first.hint


def test_grad_scaler_skipped_steps_are_absorbed_with_a_note() -> None:
    """GradScaler *expects* inf gradients while it calibrates the scale and skips those steps: they
    are listed as absorbed (with a note), not as births; a real NaN in the same loop still is one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
    x = torch.randn(4, 8) * 100
    with nanwatch() as report:
        for i in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        bad = torch.log(loss - loss - 1.0)  # @after-scaler
    assert scaler.get_scale() < 2.0 ** 40  # the scaler did skip steps
    assert [(e.phase, e.lineno) for e in report.events] == [("forward", line("# @after-scaler"))]
    assert {e.phase for e in report.absorbed} == {"backward"} and all("GradScaler" in e.hint for e in report.absorbed)
    assert any("GradScaler skipped" in n for n in report.notes)
    assert "Absorbed" in report.text() and all(torch.isfinite(p).all() for p in model.parameters())


def test_float16_matmul_overflow() -> None:
    a = torch.full((4, 4), 200.0, dtype=torch.float16)
    with nanwatch() as report:
        b = a @ a  # @fp16-mm
    assert (report.first.op, report.first.kind, report.first.lineno) == ("aten.mm.default", "inf", line("# @fp16-mm"))
    assert "float16" in report.first.hint


def test_cross_entropy_blames_the_earlier_op_not_the_loss() -> None:
    logits = torch.randn(4, 3)
    scale = torch.tensor([-1.0, 1.0, 1.0])
    with nanwatch() as report:
        h = logits * torch.sqrt(scale)  # @before-loss
        loss = F.cross_entropy(h, torch.tensor([0, 1, 2, 0]))
    assert [(e.op, e.lineno) for e in report.events] == [("aten.sqrt.default", line("# @before-loss"))]


def test_layer_norm_with_eps_zero_on_constant_input() -> None:
    ln = nn.LayerNorm(4, eps=0.0)
    with nanwatch() as report:
        ln(torch.ones(2, 4))
    first = report.first
    assert (first.op, first.module, first.kind) == ("aten.native_layer_norm.default", "ln", "nan")
    assert "eps" in first.hint and "variance" in first.hint


def test_batch_norm_eval_with_zero_running_var_in_float16() -> None:
    bn = nn.BatchNorm1d(4, eps=0.0).half().eval()
    bn.running_var.zero_()
    with nanwatch() as report:
        bn(torch.ones(3, 4, dtype=torch.float16))
    assert report.first.module == "bn" and "batch_norm" in report.first.op
    assert "eps" in report.first.hint and "overflow" not in report.first.hint
    assert bn.training is False


def test_in_place_ops_are_births_too() -> None:
    """``x.log_()`` overwrites its input: the check must judge the input as it was before the op."""
    outside = torch.tensor([0.0, 1.0])
    with nanwatch() as report:
        outside.log_()  # @log-inplace
        y = torch.tensor([1.0, 2.0]) * 1.0
        y.div_(0.0)  # @div-inplace
    assert [(e.phase, e.op, e.kind, e.lineno) for e in report.events] == [
        ("forward", "aten.log_.default", "inf", line("# @log-inplace")),
        ("forward", "aten.div_.Tensor", "inf", line("# @div-inplace"))]
    assert "log of zero" in report.events[0].hint and "division by zero" in report.events[1].hint


def test_out_variant_is_a_birth_not_input_data() -> None:
    x = torch.tensor([100.0, 1.0])
    out = torch.empty(2)
    with nanwatch() as report:
        torch.exp(x, out=out)  # @exp-out
        y = x - 200.0
        torch.log(y, out=y)  # @log-out-self
    assert [(e.phase, e.op, e.kind, e.lineno) for e in report.events] == [
        ("forward", "aten.exp.out", "inf", line("# @exp-out")),
        ("forward", "aten.log.out", "nan", line("# @log-out-self"))]


def test_integer_division_by_zero_is_the_users_error_and_float_division_an_inf() -> None:
    a = torch.tensor([1, 2])
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        with nanwatch() as report:
            a // 0
    assert report.events == ()
    with nanwatch() as report:
        b = a / 0  # @true-div
    assert (report.first.op, report.first.kind, report.first.lineno) == ("aten.div.Tensor", "inf", line("# @true-div"))


# -- input data ------------------------------------------------------------------------------------
def test_dataloader_batch_with_nan_is_input_data_at_its_iteration() -> None:
    """The NaN is in the dataset: phase "input" at the third batch, in the model's first layer,
    even though the DataLoader stacked the batch inside the watched code."""
    torch.manual_seed(0)
    data = torch.randn(40, 4)
    data[21, 2] = float("nan")  # batch 3 of 8 rows
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=8)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch() as report:
        for (xb,) in loader:
            opt.zero_grad()
            loss = model(xb).pow(2).mean()  # @loader-consumer
            loss.backward()
            opt.step()
    first = report.first
    assert (first.phase, first.iteration, first.module) == ("input", 3, "model")
    assert first.lineno == line("# @loader-consumer") and "data" in first.hint


def test_inf_in_data_copied_inside_the_watch_is_still_input_data() -> None:
    data = torch.randn(6, 4)
    data[4, 0] = float("inf")
    model = nn.Linear(4, 2)
    with nanwatch() as report:
        batch = torch.stack([data[i] for i in range(6)]).to(torch.float32).clone()
        model(batch)
    assert report.first.phase == "input" and report.first.module == "model"


def test_nan_written_by_the_code_itself_is_reported_not_ignored() -> None:
    """``x[0] = float('nan')`` inside the cell: no op *made* the NaN, but staying silent would be
    worse; the first consumer is named, as for input data."""
    with nanwatch() as report:
        x = torch.randn(4)
        x[0] = float("nan")
        y = x.exp()  # @nan-consumer
    assert (report.first.phase, report.first.lineno) == ("input", line("# @nan-consumer"))


def test_module_mode_loader_nan_is_one_input_event_not_one_per_later_batch() -> None:
    """After the NaN batch poisons the weights, later batches' outputs are not new births."""
    data = torch.randn(40, 4)
    data[21, 2] = float("nan")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=8)
    lin = nn.Linear(4, 1)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    with nanwatch(mode="module") as report:
        for (xb,) in loader:
            opt.zero_grad()
            lin(xb).pow(2).mean().backward()
            opt.step()
    assert [(e.phase, e.module, e.iteration) for e in report.events] == [("input", "lin", 3)]


def test_module_mode_names_a_non_finite_parameter_as_input() -> None:
    net = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    with torch.no_grad():
        net[1].weight[0, 0] = float("nan")
    with nanwatch(mode="module") as report:
        net(torch.randn(2, 3))
    assert [(e.phase, e.module, e.detail) for e in report.events] == [
        ("input", "net.1", "non-finite parameter net.1.weight")]


# -- optimizer ---------------------------------------------------------------------------------------
def test_adam_with_eps_zero_and_a_zero_gradient() -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0)
    x = torch.randn(8, 4)
    x[:, 1] = 0.0  # weight[0, 1] gets a zero gradient: Adam computes 0 / (0 + 0)
    with nanwatch() as report:
        for _ in range(2):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()  # @adam-step
    first = report.first
    assert (first.phase, first.param, first.iteration, first.kind) == ("optimizer", "model.weight", 1, "nan")
    assert first.op == "Adam.step" and first.lineno == line("# @adam-step")
    assert "eps" in first.hint and "overflowed" not in first.hint


def test_sgd_with_momentum_and_a_scheduler_exploding() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1e9 ** step, 1e40))
    x = torch.full((8, 4), 2.0)
    went_bad = None
    with nanwatch() as report:
        for step in range(1, 7):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
            sched.step()
            if went_bad is None and not torch.isfinite(model.weight).all():
                went_bad = step
    first = report.first
    assert first.phase == "optimizer" and first.param == "model.weight" and first.kind == "inf"
    assert went_bad is not None and first.iteration == went_bad and "learning rate" in first.hint


def test_step_on_gradients_already_nan_blames_the_backward() -> None:
    """The step only spreads a NaN gradient into the weights: the birth is the backward op."""
    model = nn.Sequential(nn.Linear(3, 3))
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanwatch() as report:
        torch.sqrt(model(torch.randn(2, 3)).pow(2).sum(-1)).sum().backward()
        opt.step()
    assert report.first.phase == "backward" and report.first.op == "SqrtBackward0"
    assert not any(e.phase == "optimizer" for e in report.events)
    assert torch.isnan(model[0].weight).any()


# -- intentional infinities -----------------------------------------------------------------------------
def test_intentional_infinities_in_common_idioms_are_quiet() -> None:
    s = torch.randn(2, 4, 4, requires_grad=True)
    with nanwatch() as report:
        causal = torch.ones(4, 4, dtype=torch.bool).triu(1)
        a = s.masked_fill(causal, torch.finfo(s.dtype).min).softmax(-1)
        b = s.masked_fill(causal, float("-inf")).softmax(-1)
        c = torch.clamp(s, min=-float("inf"), max=float("inf"))
        d = torch.full((4,), float("-inf")).exp()
        e = torch.logsumexp(s.masked_fill(causal, float("-inf")), -1)
        f = s.masked_fill(torch.ones(4, 4, dtype=torch.bool), float("-inf")).max(-1).values
        g = torch.where(causal, float("-inf"), s).softmax(-1)
        (a.sum() + b.sum() + c.sum() + d.sum() + e.sum() + g.sum()).backward()
    assert report.events == (), report.text()
    assert torch.isfinite(s.grad).all()
    with nanwatch() as report:
        h = s.masked_fill(causal, float("-inf")).softmax(-1)
        bad = torch.log(h - 1.0)  # @real-nan-after-mask
    assert (report.first.op, report.first.lineno) == ("aten.log.default", line("# @real-nan-after-mask"))


def test_scaled_dot_product_attention_masks_are_quiet() -> None:
    """is_causal, a float -inf mask built before the watch, and a boolean mask: no births."""
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    additive = torch.zeros(4, 4).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), float("-inf"))
    keep = torch.ones(4, 4, dtype=torch.bool).tril()
    with nanwatch() as report:
        a = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        b = F.scaled_dot_product_attention(q, q, q, attn_mask=additive)
        c = F.scaled_dot_product_attention(q, q, q, attn_mask=keep)
        (a + b + c).sum().backward()
    assert report.events == (), report.text()


# -- grad modes ------------------------------------------------------------------------------------
@pytest.mark.parametrize("ctx", ["no_grad", "inference_mode", "eval"])
def test_births_under_grad_modes(ctx: str) -> None:
    torch.manual_seed(0)
    model = Deep()
    was_training = ctx != "eval"
    if ctx == "eval":
        model.eval()
    manager = torch.no_grad() if ctx == "no_grad" else torch.inference_mode() if ctx == "inference_mode" \
        else torch.enable_grad()
    with nanwatch() as report, manager:
        model(torch.randn(2, 5, 8))
    assert (report.first.op, report.first.module) == ("aten.sqrt.default", "model.blocks.3.attn")
    assert model.training is was_training and torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


# -- robustness ------------------------------------------------------------------------------------
def test_shape_error_is_reraised_unchanged_ending_at_the_users_line() -> None:
    w = torch.randn(3, 5)
    with pytest.raises(RuntimeError) as info:
        with nanwatch() as report:
            torch.log(torch.zeros(2))
            torch.randn(2, 4) @ w  # @shape-error
    exc = info.value
    assert type(exc) is RuntimeError and "shapes cannot be multiplied" in str(exc)
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "site-packages" not in f.filename and "torch_nbdebug" not in f.filename]
    assert (frames[-1].filename, frames[-1].lineno) == (__file__, line("# @shape-error"))
    assert report.first.op == "aten.log.default" and any("RuntimeError" in n for n in report.notes)


def test_no_big_intermediate_is_kept_alive_after_a_birth() -> None:
    x = torch.randn(512, 512, requires_grad=True)
    with nanwatch() as report:
        big = torch.log(x - 1.0)
        mid = big * 2
        mid.sum().backward()
    refs = [weakref.ref(t) for t in (big, mid)]
    del big, mid
    gc.collect()
    assert all(r() is None for r in refs)
    assert report.first.op == "aten.log.default"


def test_another_thread_does_not_crash_and_is_noted() -> None:
    """Dispatch modes are per thread: work in another thread is not checked op by op; say so."""
    model = nn.Sequential(nn.Linear(4, 4), Shared())
    out: list[torch.Tensor] = []
    with nanwatch() as report:
        worker = threading.Thread(target=lambda: out.append(model(torch.randn(2, 4))))
        worker.start()
        worker.join()
        model(torch.randn(2, 4))
    assert out and any("another thread" in n for n in report.notes)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_inside_the_watch(backend: str) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.log(x) * 2

    compiled = torch.compile(f, backend=backend)
    with nanwatch() as report:
        y = compiled(torch.tensor([-1.0, 1.0]))
    assert torch.isnan(y[0])
    assert report.first is not None and report.first.kind == "nan"


def test_complex_sparse_and_meta_tensors_do_not_crash() -> None:
    """Complex values are not checked (NaN in complex needs its own rules); their real parts are."""
    with nanwatch() as report:
        c = torch.log(torch.zeros(3, dtype=torch.cfloat))
        s = torch.eye(3).to_sparse()
        d = torch.sparse.mm(s, torch.ones(3, 3)) + (s * 2).to_dense()
        m = torch.empty(3, device="meta").log()
        spectrum = torch.fft.fft(torch.zeros(4)).abs().log()  # @fft-log
    assert not report.notes, report.notes
    assert [(e.op, e.lineno) for e in report.events] == [("aten.log.default", line("# @fft-log"))]


def test_ten_thousand_ops_do_not_hang() -> None:
    """A guard against per-op work growing with the number of ops (speed itself is in bench/): 10,000
    ops take ~2 s here; a quadratic recorder would take minutes."""
    x = torch.randn(16)
    with nanwatch() as report:
        start = time.perf_counter()
        for _ in range(5000):
            x = x * 1.0001 + 0.0
        elapsed = time.perf_counter() - start
    assert report.summary.ops_seen == 10000 and report.events == ()
    assert elapsed < 30.0, elapsed


# -- the magic -------------------------------------------------------------------------------------
@pytest.fixture
def ip(ipython: Any) -> Any:
    names = ("_nanwatch", "h", "m", "y", "r")
    for name in names:  # the shell is shared with other test files, which may have left these
        ipython.user_ns.pop(name, None)
    ipython.run_cell("import torch\nfrom torch import nn")
    yield ipython
    for name in names:
        ipython.user_ns.pop(name, None)


@pytest.mark.parametrize("line_,body,message", [
    ("", "# only a comment\n", "no code"),
    ("--raise-on", "y = 1\n", "raise-on"),
    ("--max-events 0", "y = torch.ones(1)\n", "max_events"),
    ("", "def f(:\n    pass\n", "syntax error at line 1"),
])
def test_magic_bad_input_is_a_usage_error(ip: Any, line_: str, body: str, message: str) -> None:
    """A usage error says what to fix and shows no (empty) report: nothing ran."""
    with capture_output() as cap:
        with pytest.raises(UsageError, match=message):
            ip.run_cell_magic("nanwatch", line_, body)
    assert cap.outputs == [] and "y" not in ip.user_ns


def test_magic_module_mode_names_the_module_and_returns_the_report(ip: Any) -> None:
    ip.run_cell("m = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4, eps=0.0))\n"
                "with torch.no_grad(): m[0].weight.zero_(); m[0].bias.fill_(1.0)")
    with capture_output() as cap:
        r = ip.run_cell_magic("nanwatch", "--mode module -o", "h = m(torch.randn(2, 4))\n")
    assert isinstance(r, NanReport) and r is ip.user_ns["_nanwatch"] and cap.outputs == []
    assert (r.first.module, r.first.lineno) == ("m.1", 1)


def test_magic_raise_traceback_names_the_cell_line_and_hides_internals(ip: Any) -> None:
    with capture_output() as cap:
        result = ip.run_cell("%%nanwatch --raise\na = torch.ones(2)\nb = torch.log(-a)\nc = 1\n")
    assert isinstance(result.error_in_exec, NanBirthError)
    text = cap.stdout + cap.stderr + "".join(str(o.data.get("text/plain", "")) for o in cap.outputs)
    assert "line 2" in text and "torch.log(-a)" in text
    assert "nanwatch_mode.py" not in text
    assert ip.user_ns["_nanwatch"].first.lineno == 2
    ip.user_ns.pop("a", None)


def test_magic_flags_ignore_inf_no_backward_no_optimizer(ip: Any) -> None:
    body = ("w = torch.zeros(3, requires_grad=True)\n"
            "opt = torch.optim.SGD([w], lr=1e38)\n"
            "z = torch.log(torch.zeros(2))\n"
            "torch.sqrt(w).sum().backward()\n"
            "w.grad = torch.full((3,), 1e10); opt.step()\n")
    with capture_output():
        ip.run_cell_magic("nanwatch", "", body)
    # log(0), sqrt'(0), and a finite gradient times lr=1e38 in the step: one birth in each phase.
    assert [e.phase for e in ip.user_ns["_nanwatch"].events] == ["forward", "backward", "optimizer"]
    with capture_output():
        ip.run_cell_magic("nanwatch", "--ignore-inf --no-backward --no-optimizer", body)
    assert ip.user_ns["_nanwatch"].events == ()
    for name in ("w", "opt", "z"):
        ip.user_ns.pop(name, None)
