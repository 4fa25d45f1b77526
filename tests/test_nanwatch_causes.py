"""Issue 9 item 6: the place was already right in these families; the event now names the real cause.

Every test runs on both check paths (the ``check_path`` fixture) and asserts the structured ``cause``
with the op, module and line; the hint is written from the cause. Plus: work in another thread never
leaks into a watch (item 3).
"""
from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from IPython.utils.capture import capture_output
from torch import nn

from torch_nbdebug.api.nanwatch import nanwatch
from nanwatch_paths import marker_line, watch_kind  # noqa: F401 - every test under both op-mode watches

from test_nanwatch import check_path  # noqa: F401 - every test on both check paths

SRC = open(__file__).read().splitlines()


def line(marker: str) -> int:
    return marker_line(SRC, marker)


# -- a NaN already in a parameter or buffer -----------------------------------------------------------
def test_poisoned_batchnorm_running_var_is_named_not_called_input_data() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[1].running_var[1] = float("nan")  # an earlier batch poisoned it
    model.eval()
    with nanwatch() as report:
        model(torch.randn(3, 4))  # @bn-eval
    first = report.first
    assert (first.phase, first.op, first.module, first.lineno) == \
        ("input", "aten.native_batch_norm.default", "model.1", line("# @bn-eval"))
    assert (first.cause, first.param, first.param_kind) == ("nonfinite_buffer", "model.1.running_var", "buffer")
    assert "running_var" in first.title() and "input data" not in first.title()
    assert "reset_running_stats" in first.hint and "earlier batch" in first.hint


def test_weight_set_to_nan_is_the_parameter() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        model[2].weight[1, 1] = float("nan")
    with nanwatch() as report:
        model(torch.rand(8, 4))  # @nan-weight
    first = report.first
    assert (first.phase, first.module, first.lineno) == ("input", "model.2", line("# @nan-weight"))
    assert (first.cause, first.param, first.param_kind) == ("nonfinite_parameter", "model.2.weight", "parameter")


def test_plain_input_data_is_still_input_data() -> None:
    model = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    x[1, 1] = float("nan")
    with nanwatch() as report:
        model(x)  # @data-nan
    first = report.first
    assert (first.phase, first.module, first.lineno, first.cause, first.param) == \
        ("input", "model", line("# @data-nan"), "input_data", None)


# -- known causes -----------------------------------------------------------------------------------
def test_ctc_loss_target_longer_than_input() -> None:
    torch.manual_seed(0)
    steps, batch, classes, target_len = 5, 2, 4, 8
    log_probs = torch.randn(steps, batch, classes).log_softmax(2).requires_grad_()
    targets = torch.randint(1, classes, (batch, target_len))
    with nanwatch() as report:
        loss = F.ctc_loss(log_probs, targets, torch.full((batch,), steps), torch.full((batch,), target_len))  # @ctc
        loss.backward()
    first = report.first
    assert (first.phase, first.op, first.kind, first.lineno) == \
        ("forward", "aten._ctc_loss.Tensor", "inf", line("# @ctc"))
    assert first.cause == "ctc_target_too_long" and "zero_infinity" in first.hint


def test_learning_rate_growth_until_the_loss_overflows() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 10.0 ** step)  # no cap
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with nanwatch() as report:
        for _ in range(12):
            opt.zero_grad()
            loss = (model(x) - y).pow(2).mean()  # @lr-loss
            loss.backward()
            opt.step()
            sched.step()
    first = report.first
    assert (first.phase, first.op, first.kind, first.lineno) == \
        ("forward", "aten.pow.Tensor_Scalar", "inf", line("# @lr-loss"))
    assert (first.cause, first.lr, first.lr_step, first.iteration) == ("lr_growth", 1e6, 9, 10)
    assert "lr=1e+06" in first.hint and "optimizer step 8" in first.hint and "in step 9" in first.hint  # from 0


def test_learning_rate_growth_until_the_update_overflows() -> None:
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1e9 ** step, 1e40))
    lrs = {}
    with nanwatch() as report:
        for step in range(1, 7):
            opt.zero_grad()
            model(torch.full((8, 4), 2.0)).sum().backward()
            lrs[step] = opt.param_groups[0]["lr"]
            opt.step()  # @lr-step
            sched.step()
    first = report.first
    assert (first.phase, first.op, first.param, first.lineno) == \
        ("optimizer", "SGD.step", "model.weight", line("# @lr-step"))
    assert first.cause == "lr_growth" and first.lr == lrs[first.iteration] and first.lr_step == first.iteration
    assert first.grad_finite is True and f"lr={first.lr:.4g}" in first.hint and f"step {first.iteration - 1}" in first.hint


@pytest.mark.parametrize("fn,phase,op", [("sqrt", "backward", "SqrtBackward0"), ("log", "forward", "aten.log.default")])
def test_clamp_in_front_of_sqrt_or_log(fn: str, phase: str, op: str) -> None:
    """``sqrt(x.clamp(min=0))`` is finite, but its gradient at the clamped zeros is infinite;
    ``log(x.clamp(min=0))`` is -inf already in forward."""
    x = torch.tensor([-1.0, 4.0], requires_grad=True)
    with nanwatch() as report:
        y = getattr(torch, fn)(x.clamp(min=0))  # @clamp-domain
        y.sum().backward()
    first = report.first
    assert (first.phase, first.op, first.kind, first.lineno) == (phase, op, "inf", line("# @clamp-domain"))
    assert (first.cause, first.input_op) == ("clamp_at_domain_edge", "ClampBackward1")
    assert "torch.where" in first.hint and "clamp_min(1e-12)" in first.hint


def test_clamp_in_front_of_rsqrt_is_a_forward_birth() -> None:
    x = torch.tensor([-1.0, 4.0], requires_grad=True)
    with nanwatch() as report:
        y = torch.rsqrt(x.clamp_min(0.0))  # @clamp-rsqrt
    first = report.first
    assert (first.phase, first.op, first.kind, first.lineno) == \
        ("forward", "aten.rsqrt.default", "inf", line("# @clamp-rsqrt"))
    assert (first.cause, first.input_op) == ("clamp_at_domain_edge", "ClampMinBackward0")


def test_logsumexp_over_a_fully_masked_row() -> None:
    """The forward gives -inf (not a birth: the row was masked on purpose); its gradient is NaN."""
    scores = torch.randn(2, 3, requires_grad=True)
    mask = torch.tensor([[True, True, True], [False, True, False]])
    with nanwatch() as report:
        lse = torch.logsumexp(scores.masked_fill(mask, float("-inf")), -1)  # @lse
        lse.sum().backward()
    first = report.first
    assert (first.phase, first.op, first.forward_op, first.lineno) == \
        ("backward", "LogsumexpBackward0", "aten.logsumexp.default", line("# @lse"))
    assert first.cause == "all_masked_row" and "forward was not finite" in first.hint


def test_softmax_over_a_fully_masked_row() -> None:
    scores = torch.randn(2, 3)
    mask = torch.tensor([[True, True, True], [False, True, False]])
    with nanwatch() as report:
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)  # @softmax-row
    first = report.first
    assert (first.phase, first.op, first.kind, first.lineno) == \
        ("forward", "aten._softmax.default", "nan", line("# @softmax-row"))
    assert first.cause == "all_masked_row"


def test_kl_div_of_log_of_zero_probabilities() -> None:
    p = torch.tensor([[0.0, 0.5, 0.5]])
    q = torch.tensor([[0.2, 0.3, 0.5]])
    with nanwatch() as report:
        kl = F.kl_div(p.log(), q, reduction="batchmean")  # @kl-div
    first = report.first
    assert (first.phase, first.op, first.kind, first.lineno) == \
        ("forward", "aten.log.default", "inf", line("# @kl-div"))
    assert first.cause == "log_of_zero_probability" and "log_softmax" in first.hint


def test_adam_on_float16_parameters_with_the_default_eps() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(4, 1).half()
    opt = torch.optim.Adam(lin.parameters(), lr=1e-3)  # eps=1e-8 is 0 in float16
    x = torch.randn(8, 4).half() * 1e-3
    with nanwatch() as report:
        for _ in range(2):
            opt.zero_grad()
            lin(x).float().mean().backward()
            opt.step()  # @adam-fp16
    first = report.first
    assert (first.phase, first.op, first.param, first.lineno) == \
        ("optimizer", "Adam.step", "lin.weight", line("# @adam-fp16"))
    assert (first.cause, first.eps, first.iteration) == ("adam_eps_underflow", 1e-8, 1)
    assert "float16" in first.hint and "eps" in first.hint


@pytest.mark.parametrize("decomposition", ["eigh", "svd"])
def test_backward_of_eigh_or_svd_with_repeated_eigenvalues(decomposition: str) -> None:
    a = torch.eye(3, requires_grad=True)
    with nanwatch() as report:
        if decomposition == "eigh":
            _, vectors = torch.linalg.eigh(a)  # @eigh
        else:
            vectors, _, _ = torch.linalg.svd(a)  # @svd
        vectors.sum().backward()
    first = report.first
    node = {"eigh": "LinalgEighBackward0", "svd": "LinalgSvdBackward0"}[decomposition]
    assert (first.phase, first.op, first.lineno) == ("backward", node, line(f"# @{decomposition}"))
    assert first.cause == "repeated_eigenvalues" and "eigenvalues" in first.hint


def test_cause_reaches_the_magic_report(ipython: Any) -> None:
    ipython.run_cell("import torch\nfrom torch import nn\n"
                     "bn_net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()\n"
                     "bn_net[1].running_var[2] = float('nan')\n")
    with capture_output() as cap:
        ipython.run_cell_magic("nanwatch", "", "x = torch.randn(3, 4)\nout = bn_net(x)\n")
    report = ipython.user_ns["_nanwatch"]
    first = report.first
    assert (first.phase, first.module, first.lineno, first.cause, first.param) == \
        ("input", "bn_net.1", 2, "nonfinite_buffer", "bn_net.1.running_var")
    shown = "".join(str(o.data.get("text/plain", "")) for o in cap.outputs)
    assert "bn_net.1.running_var" in shown and "reset_running_stats" in shown
    for name in ("bn_net", "x", "out", "_nanwatch"):
        ipython.user_ns.pop(name, None)


# -- threads (item 3) ---------------------------------------------------------------------------------
class LogHead(nn.Module):
    def __init__(self, shift: float) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.shift = shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.fc(x) - self.shift)  # @thread-birth


def _worker(results: list[Any], start: threading.Barrier) -> None:
    worker_net = nn.Sequential(nn.Linear(4, 4), LogHead(100.0))
    opt = torch.optim.SGD(worker_net.parameters(), lr=1e38)
    start.wait()
    with nanwatch(namespace={"worker_net": worker_net}) as report:
        for _ in range(3):
            opt.zero_grad()
            worker_net(torch.randn(2, 4)).sum().backward()
            opt.step()
    results.append(report)


def test_each_watch_reports_its_own_threads_births_only() -> None:
    """Module and optimizer hooks are global; a second thread running its own watch (and making its
    own NaN) must not show up in this watch, and this thread's births not in that one."""
    main_net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for _ in range(20):
        results: list[Any] = []
        start = threading.Barrier(2)
        worker = threading.Thread(target=_worker, args=(results, start))
        worker.start()
        with nanwatch() as report:
            start.wait()
            for _ in range(20):
                h = main_net(torch.randn(2, 4))
            bad = torch.sqrt(h - 100.0)  # @main-birth
        worker.join()
        assert [(e.op, e.lineno, e.module) for e in report.events] == \
            [("aten.sqrt.default", line("# @main-birth"), None)], report.text()
        (other,) = results
        assert (other.first.op, other.first.lineno, other.first.module) == \
            ("aten.log.default", line("# @thread-birth"), "worker_net.1")
        assert all(e.lineno != line("# @main-birth") for e in other.events)
        assert all((layer.module or "").startswith("main_net") for layer in report.layers), report.layers


# -- on a CUDA device (run when one is lent): the same births on both paths -----------------------------
@pytest.mark.cuda
def test_births_and_causes_on_cuda() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).cuda().eval()
    model[1].running_var[1] = float("nan")
    with nanwatch() as report:
        model(torch.randn(3, 4, device="cuda"))  # @cuda-bn
    assert (report.first.phase, report.first.module, report.first.lineno, report.first.param) == \
        ("input", "model.1", line("# @cuda-bn"), "model.1.running_var")
    x = torch.tensor([0.0, 1.0], device="cuda", requires_grad=True)
    with nanwatch() as report:
        y = torch.where(x > 0, torch.log(x), 0.0)  # @cuda-where
        y.sum().backward()
    assert (report.first.op, report.first.lineno, report.first.cause) == \
        ("LogBackward0", line("# @cuda-where"), "where_trap")
    assert [e.op for e in report.absorbed] == ["aten.log.default"]


# -- pow: which of its three ways to go non-finite -----------------------------------------------------
@pytest.mark.parametrize("base, exponent, words", [
    (torch.full((4,), 1e20), 3.0, "pow overflowed"),  # (1e20)**3 passes float32's largest number
    (torch.tensor([0.0, 1.0]), -1.0, "0 to a negative power"),
    (torch.tensor([-1.0, 4.0]), 0.5, "negative base with a fractional exponent"),
])
def test_the_pow_hint_names_the_way_it_went_non_finite(base: torch.Tensor, exponent: float, words: str) -> None:
    with nanwatch() as report:
        torch.pow(base, exponent)
    e = report.first
    assert e is not None and e.op == "aten.pow.Tensor_Scalar" and words in e.hint, (e and e.hint)
