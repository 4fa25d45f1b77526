"""Issue 28: causes named by what the statistics show. An overflow is called an overflow (judged against the
dtype, never contradicting the numbers the card prints), an intentional -inf that changes sign is a birth,
and the hints name the real cause (an eps float16 cannot hold, a VAE's logvar, a softplus written by hand, an
adaptive step over a zero gradient).

Every test runs under both op-mode watches (``watch_kind``) and on both check paths (``check_path``).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bench_files import bench_module
from torch_nbdebug.api.nanwatch import nanwatch
from nanwatch_paths import marker_line, watch_kind  # noqa: F401 - every test under both op-mode watches

from test_nanwatch import check_path  # noqa: F401 - every test on both check paths

SRC = open(__file__).read().splitlines()


def line(marker: str) -> int:
    return marker_line(SRC, marker)


# -- item 1: a normalisation whose variance overflows ------------------------------------------------
# (CPU's GroupNorm keeps its variance's overflow finite, rstd = 0 and an output of zeros, up to inputs whose
# mean overflows too: from there it is NaN.)
NORMS = {
    "layernorm-2d": (lambda: nn.LayerNorm(8), (4, 8), 5e21, "aten.native_layer_norm.default"),
    "layernorm-3d": (lambda: nn.LayerNorm(8), (2, 3, 8), 5e21, "aten.native_layer_norm.default"),
    "groupnorm": (lambda: nn.GroupNorm(2, 4), (2, 4, 5), 3e38, "aten.native_group_norm.default"),
}


@pytest.mark.parametrize("case", list(NORMS))
def test_a_norm_whose_inputs_reach_5e21_overflowed(case: str) -> None:
    """float32 squares overflow from about 1.8e19: a LayerNorm over values of 5e21 gives NaN with its real
    eps (1e-5). The card says so; it never says "zero variance, eps is 0" over statistics showing 5e21."""
    make, shape, scale, op = NORMS[case]
    torch.manual_seed(0)
    model = make()
    x = torch.randn(shape).clamp(-1, 1) * scale
    with nanwatch() as report:
        out = model(x)  # @norm-overflow
    first = report.first
    assert torch.isnan(out).all() and model.eps == 1e-5
    assert (first.phase, first.op, first.module, first.lineno, first.kind) == \
        ("forward", op, "model", line("# @norm-overflow"), "nan")
    assert first.cause == "overflow", first.hint
    assert "overflowed" in first.hint and "1.845e+19" in first.hint and "learning rate" in first.hint
    assert "zero variance" not in first.hint and "eps > 0" not in first.hint
    assert max(-first.inputs[0].min, first.inputs[0].max) > 1e21  # the statistics the hint reads


def test_gpt_trained_with_adamw_at_a_huge_learning_rate() -> None:
    """The issue's case: a tiny GPT-2 under AdamW at lr=1e4 diverges; the first NaN is a LayerNorm whose inputs
    reach ~1e20, its real eps 1e-5. The card calls it an overflow, with the statistics that show it."""
    models = bench_module("models")
    torch.manual_seed(0)
    model = models.small_gpt(vocab=64, d=32, layers=2, heads=2, ctx=16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e4)
    idx = torch.randint(0, 64, (2, 16))
    with nanwatch() as report:
        for _ in range(6):
            opt.zero_grad()
            models.lm_loss(model, idx, idx).backward()
            opt.step()
    first = report.first
    assert (first.phase, first.op, first.cause) == ("forward", "aten.native_layer_norm.default", "overflow")
    assert first.module.startswith("model.blocks.") and first.iteration > 1
    assert max(-first.inputs[0].min, first.inputs[0].max) > 1.845e19
    assert "zero variance" not in first.hint and "learning rate" in first.hint


@pytest.mark.parametrize("case", list(NORMS))
def test_module_mode_names_the_overflow_too(case: str) -> None:
    make, shape, scale, _ = NORMS[case]
    torch.manual_seed(0)
    model = make()
    x = torch.randn(shape).clamp(-1, 1) * scale
    with nanwatch(mode="module") as report:
        model(x)  # @module-overflow
    first = report.first
    assert (first.module, first.lineno, first.cause) == ("model", line("# @module-overflow"), "overflow")
    assert "zero variance" not in first.hint and "learning rate" in first.hint


def test_a_constant_row_with_eps_zero_is_still_zero_variance() -> None:
    """The other way a LayerNorm goes NaN keeps its hint: small values, eps=0, a constant row."""
    model = nn.LayerNorm(4, eps=0.0)
    with nanwatch() as report:
        model(torch.ones(2, 4))  # @zero-var
    first = report.first
    assert (first.op, first.lineno, first.cause) == ("aten.native_layer_norm.default", line("# @zero-var"), None)
    assert "zero variance" in first.hint and "eps > 0" in first.hint


# -- item 2: an intentional -inf that changes sign ---------------------------------------------------
MASKED = torch.tensor([[False, False, True, True], [False, True, False, False]])


def test_label_smoothing_over_classes_masked_with_minus_inf() -> None:
    """The smoothing term sums log p over every class: log p = -inf at a masked class, and its negation is
    +inf: the loss is +Inf. That is a birth (the -inf was intentional, its sign change is not)."""
    torch.manual_seed(0)
    logits = torch.randn(2, 4, requires_grad=True)
    target = torch.tensor([0, 2])
    with nanwatch() as report:
        loss = F.cross_entropy(logits.masked_fill(MASKED, float("-inf")), target, label_smoothing=0.1)  # @smooth
    first = report.first
    assert torch.isposinf(loss) and first is not None, report.text()
    assert (first.phase, first.op, first.kind, first.lineno) == \
        ("forward", "aten.neg.default", "inf", line("# @smooth"))
    assert first.cause == "minus_inf_flipped" and "torch.finfo(dtype).min" in first.hint


def test_a_minus_inf_mask_that_only_propagates_is_no_birth() -> None:
    """masked_fill with -inf, then softmax / log_softmax and a loss that ignores the masked classes: the -inf is
    carried and thrown away, never changes sign: nothing is born."""
    torch.manual_seed(0)
    logits = torch.randn(2, 4, requires_grad=True)
    with nanwatch() as report:
        scores = logits.masked_fill(MASKED, float("-inf"))
        probs = scores.softmax(-1)
        loss = F.cross_entropy(scores, torch.tensor([0, 2])) + probs.sum()
        loss.backward()
    assert report.events == () and torch.isfinite(loss), report.text()


# -- item 3: hints name the real cause ----------------------------------------------------------------
class Embed(nn.Module):
    """Sentence embeddings, L2-normalised with F.normalize's default eps=1e-12: 0 in float16."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(torch.relu(self.proj(x)), dim=-1, eps=1e-12)  # @normalize-eps


def test_float16_normalize_whose_eps_rounds_to_zero() -> None:
    torch.manual_seed(0)
    model = Embed().half()
    with torch.no_grad():
        model.proj.bias[:] = -100.0  # every unit off for the first row: its norm is 0
        model.proj.weight[:] = 0.0
    x = torch.zeros(2, 4, dtype=torch.float16)
    with nanwatch() as report:
        model(x)
    first = report.first
    assert (first.phase, first.op, first.module, first.lineno) == \
        ("forward", "aten.div.Tensor", "model", line("# @normalize-eps"))
    assert (first.cause, first.eps) == ("eps_rounds_to_zero", 1e-12)
    assert "eps=1e-12 rounds to 0 in float16" in first.hint


def test_float16_hand_written_norm_whose_eps_rounds_to_zero() -> None:
    x = torch.ones(2, 4, dtype=torch.float16)  # constant rows: variance 0
    with nanwatch() as report:
        var = x.var(-1, unbiased=False, keepdim=True)
        y = (x - x.mean(-1, keepdim=True)) / torch.sqrt(var + 1e-12)  # @manual-eps
    first = report.first
    assert (first.op, first.lineno, first.cause, first.eps) == \
        ("aten.div.Tensor", line("# @manual-eps"), "eps_rounds_to_zero", 1e-12)


def test_float32_eps_is_not_blamed() -> None:
    """The same 0/0 in float32 with eps=0: no eps rounded, the plain 0/0 hint."""
    x = torch.ones(2, 4)
    with nanwatch() as report:
        y = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True))  # @eps0
    first = report.first
    assert (first.op, first.lineno, first.cause, first.eps) == ("aten.div.Tensor", line("# @eps0"), None, None)
    assert "0/0" in first.hint


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 8)
        self.mu, self.logvar = nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.enc(x))
        mu, logvar = self.mu(h), self.logvar(h)
        std = torch.exp(0.5 * logvar)  # @logvar
        return mu + torch.randn_like(std) * std


def test_vae_logvar_to_clamp() -> None:
    torch.manual_seed(0)
    model = VAE()
    with torch.no_grad():
        model.logvar.bias.fill_(400.0)  # exp(200) overflows float32
    with nanwatch() as report:
        model(torch.randn(3, 4))
    first = report.first
    assert (first.phase, first.op, first.module, first.lineno) == \
        ("forward", "aten.exp.default", "model", line("# @logvar"))
    assert first.cause == "logvar_exp" and "clamp" in first.hint and "logvar" in first.hint


class Softplus(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(1 + torch.exp(x))  # @softplus


def test_hand_written_softplus_is_replaced_with_f_softplus() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Softplus())
    with torch.no_grad():
        model[0].bias.fill_(100.0)  # exp(100) overflows float32
    with nanwatch() as report:
        model(torch.zeros(2, 4))
    first = report.first
    assert (first.phase, first.op, first.module, first.lineno) == \
        ("forward", "aten.exp.default", "model.1", line("# @softplus"))
    assert first.cause == "handwritten_softplus" and "F.softplus" in first.hint


def test_adam_with_eps_zero_over_a_zero_gradient_is_not_the_learning_rate() -> None:
    """A weight the loss does not reach has a zero gradient: Adam's v is 0 there and eps=0 gives 0/0."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0)
    x = torch.randn(8, 4)
    x[:, 2] = 0.0  # weight column 2 gets a gradient of exactly 0
    with nanwatch() as report:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()  # @adam-eps0
    first = report.first
    assert (first.phase, first.op, first.param, first.lineno, first.kind) == \
        ("optimizer", "Adam.step", "model.weight", line("# @adam-eps0"), "nan")
    assert first.cause == "zero_gradient_update" and "eps > 0" in first.hint
    assert "lower the learning rate" not in first.hint.lower()


# -- item 2: an Inf born inside a module and absorbed before its output --------------------------------
class RMSNorm(nn.Module):
    """Written by hand: under float16, x.pow(2) overflows past 65504 (|x| > 256) and rsqrt(inf) is 0, so the
    output is finite, and wrong (zeros)."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)  # @rms-pow
        return self.weight * (x * torch.rsqrt(var + self.eps))


class RMSNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.norm, self.out = nn.Linear(8, 8), RMSNorm(8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.fc(x)))


@pytest.mark.parametrize("read_at_exit", [True, False])  # (False: the path of outputs on a device)
@pytest.mark.parametrize("grad", [True, False])  # (no_grad: the norm's input is freed before the check)
def test_float16_rmsnorm_overflow_absorbed_inside_the_module(read_at_exit: bool, grad: bool,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_nbdebug.record.nanwatch.replay import outputs as nanwatch_modules

    monkeypatch.setattr(nanwatch_modules, "READ_AT_EXIT", read_at_exit)
    torch.manual_seed(0)
    model = RMSNet().half()
    x = (torch.randn(4, 8) * 1000).half()
    with torch.set_grad_enabled(grad), nanwatch() as report:
        y = model(x)
        if grad:
            y.float().sum().backward()
    first = report.first
    assert torch.isfinite(y).all() and first is not None, report.text()
    assert (first.phase, first.op, first.module, first.lineno, first.kind) == \
        ("forward", "aten.pow.Tensor_Scalar", "model.norm", line("# @rms-pow"), "inf")
    assert "65504" in first.hint


def test_a_healthy_float16_model_says_what_replay_did_not_watch(watch_kind: str) -> None:
    torch.manual_seed(0)
    model = RMSNet().half()
    with nanwatch() as report:
        model(torch.randn(4, 8).half()).float().sum().backward()
    assert report.events == ()
    noted = any("absorbed before its output" in n for n in report.notes)
    assert noted == (watch_kind == "replay" and not report.summary.options["defer"]), report.notes


class Mish(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.tanh(torch.log(1 + torch.exp(x)))  # @mish


def test_hand_written_mish_absorbs_its_overflow_and_is_still_named() -> None:
    """tanh(inf) = 1: the forward output stays finite, the gradient through exp is inf * 0 = NaN. The default
    watch names the exp (the backward's replay runs the forward under the per-op watch), as --no-replay does."""
    model = nn.Sequential(nn.Linear(4, 4), Mish(), nn.Linear(4, 1))
    with torch.no_grad():
        model[0].bias.fill_(100.0)
    with nanwatch() as report:
        model(torch.zeros(2, 4)).sum().backward()
    first = report.first
    assert (first.phase, first.op, first.module, first.lineno) == \
        ("forward", "aten.exp.default", "model.1", line("# @mish"))
    assert first.cause == "handwritten_softplus" and "F.mish" in first.hint
