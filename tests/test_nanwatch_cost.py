"""nanwatch's cost on the GPU's terms, counted on the CPU: host synchronisations of the deferred (CUDA)
path, and what reading once per step keeps exact.

On CUDA every ``Tensor.item/tolist/numpy/__bool__``, ``.cpu()`` and ``.to("cpu")`` of a device tensor
blocks the host until the GPU has caught up. The deferred path runs on the CPU too (``defer=True``), so
counting those calls around a training step, beyond the ones the plain step makes itself, counts the
synchronisations the watch would add on a GPU.
"""
from __future__ import annotations

import collections
import math
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bench_files import bench_module
from host_syncs import OpCount
from torch_nbdebug.api.nanwatch import nanwatch
from torch_nbdebug.record.nanwatch.checks.optim import GRAD_GONE

_READS = ("item", "tolist", "numpy", "__bool__", "cpu", "to")


models = bench_module("models")  # the 2-layer GPT the benchmarks time (one definition of "the small model")


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[collections.Counter]:
    """Counts host reads (the calls that synchronise on CUDA) by method name while the test runs."""
    counts: collections.Counter = collections.Counter()

    def counting(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            target = args[0] if args else kwargs.get("device")
            if name != "to" or (isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"):
                counts[name] += 1
            return method(self, *args, **kwargs)
        return wrapper

    for name in _READS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    yield counts


def small_gpt_step(loss_module: bool = False) -> tuple[nn.Module, Callable[[], None]]:
    torch.manual_seed(0)
    model = models.small_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 512, (2, 33))
    criterion = nn.CrossEntropyLoss()

    def loss() -> torch.Tensor:
        logits = model(idx[:, :-1]).flatten(0, 1)
        return criterion(logits, idx[:, 1:].flatten()) if loss_module else F.cross_entropy(logits, idx[:, 1:].flatten())

    return model, lambda: models.training_step(opt, loss)


def plain_reads(step: Callable[[], None], reads: collections.Counter) -> int:
    step()  # AdamW's state exists from here on, as in the watched steps
    reads.clear()
    step()
    return sum(reads.values())


@pytest.mark.parametrize("mode", ["op", "module"])
@pytest.mark.parametrize("loss_module", [False, True], ids=["functional-loss", "loss-module"])
def test_deferred_path_reads_the_device_once_per_training_step(mode: str, loss_module: bool,
                                                               reads: collections.Counter) -> None:
    model, step = small_gpt_step(loss_module)
    plain = plain_reads(step, reads)
    with nanwatch(mode=mode, defer=True, namespace={"model": model}) as report:
        step()
        per_step = []
        for _ in range(3):
            reads.clear()
            step()
            per_step.append(sum(reads.values()) - plain)
        reads.clear()
    at_exit = sum(reads.values())
    assert per_step == [1, 1, 1], f"host reads per training step beyond the plain step's: {per_step}"
    assert at_exit <= 1  # what the last step queued (its optimizer step) is read once at the end
    assert report.events == () and report.layers  # a healthy step: nothing born, the table filled


def test_evaluation_without_backward_reads_at_the_end_of_each_forward(reads: collections.Counter) -> None:
    """No backward will follow: each forward is read as it ends, while its activations are alive."""
    model, _ = small_gpt_step()
    idx = torch.randint(0, 512, (2, 32))
    with nanwatch(defer=True, namespace={"model": model}):
        with torch.no_grad():
            reads.clear()
            for _ in range(3):
                model(idx)
            in_loop = sum(reads.values())
    assert in_loop == 3


def test_a_loss_after_the_model_is_read_while_its_tensors_are_alive() -> None:
    """The deferred path reads when the backward starts: a birth in the loss computed after the model
    names its input with the same exact statistics as the immediate path (the input is freed once the
    backward has run, which is when the flags used to be read)."""
    def run(defer: bool) -> Any:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.Softmax(-1))
        with nanwatch(defer=defer, namespace={"model": model}) as report:
            # Saturated: some probabilities are exactly 0; no name holds them after this line.
            (-(model(torch.randn(8, 4) * 1e4).log() * 0.5).sum()).backward()
        return report

    immediate, deferred = run(False), run(True)
    assert immediate.first is not None and deferred.first is not None
    assert deferred.first.op == immediate.first.op == "aten.log.default"
    assert deferred.first.deferred and not immediate.first.deferred
    assert deferred.first.inputs == immediate.first.inputs
    assert deferred.first.inputs[0].min == 0.0 and deferred.first.inputs[0].zeros > 0


@pytest.mark.parametrize("defer", [False, True])
def test_optimizer_birth_keeps_the_step_as_it_was(defer: bool) -> None:
    """The deferred path judges a step's norms with the next forward: the learning rate the step used
    (not the scheduler's next one), its line and iteration are kept from the step itself; its gradient,
    freed by the next zero_grad, is known as finite."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1e38 if s == 2 else 1.0)
    x = torch.full((8, 4), 2.0)
    with nanwatch(defer=defer, namespace={"model": model}) as report:
        for _ in range(4):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()  # @step
            sched.step()
    first = report.first
    assert first is not None and (first.phase, first.param, first.iteration) == ("optimizer", "model.weight", 3)
    assert first.lr == 1e38 and "lr=1e+38" in first.detail and "gradient finite" in first.detail
    assert first.lineno == _line("# @step")
    grad = first.inputs[0]
    assert grad.finite and grad.shape == (1, 4)
    if defer:
        assert grad.note == GRAD_GONE and grad.min is None
    else:
        assert grad.min == grad.max == 16.0


def test_deferred_optimizer_birth_in_the_last_step_has_exact_gradient_statistics() -> None:
    """The last step's norms are read when the watch ends, while its gradients are still there."""
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e38)
    with nanwatch(defer=True, namespace={"model": model}) as report:
        model(torch.full((8, 4), 2.0)).sum().backward()
        opt.step()
    grad = report.first.inputs[0] if report.first is not None else None
    assert grad is not None and grad.min == grad.max == 16.0 and grad.note == ""
    assert report.first.phase == "optimizer" and not report.first.output.finite


def _line(marker: str) -> int:
    for number, text in enumerate(Path(__file__).read_text().splitlines(), start=1):
        if marker in text and "_line(" not in text:
            return number
    raise AssertionError(marker)


def test_the_optimizer_check_is_one_batched_norm_and_nothing_per_parameter() -> None:
    """After each step: one ``_foreach_norm`` and one ``stack`` per (device, dtype) group, no op per
    parameter (a ``detach`` each was a tenth of the check on the small model)."""
    from torch_nbdebug.record.nanwatch.checks.optim import norm_groups

    model, _ = small_gpt_step()
    params = list(model.parameters())
    with OpCount(views=True) as counted:
        groups, norms = norm_groups(params)
    assert counted.ops == {"_foreach_norm": 1, "stack": 1}
    assert groups == [list(range(len(params)))]
    expected = torch.stack([p.detach().norm() for p in params])
    assert torch.allclose(norms[0], expected)
    wide = params[1].detach().double()
    with OpCount(views=True) as mixed:
        groups, norms = norm_groups([params[0], wide])
    assert mixed.ops == {"_foreach_norm": 2, "stack": 2} and groups == [[0], [1]]


def test_the_finite_steps_check_concatenates_the_1d_parameters_and_norms_the_others_in_one_kernel() -> None:
    """The usual (finite) step reads one value: the 1-D parameters (biases, LayerNorm weights) summed in one
    ``cat``, the others' norms in one ``_foreach_norm``: a fixed number of ops, none per parameter; a
    non-finite parameter, 1-D or not, makes the total non-finite; several dtypes: None (a norm per group)."""
    from torch_nbdebug.record.nanwatch.checks.optim import finite_total

    model, _ = small_gpt_step()
    params = list(model.parameters())
    assert any(p.dim() == 1 for p in params) and any(p.dim() != 1 for p in params)
    with OpCount(views=True) as counted:
        total = finite_total(params)
    assert counted.ops == {"cat": 1, "sum": 2, "_foreach_norm": 1, "stack": 1, "add": 1}
    assert total is not None and math.isfinite(float(total))
    for bad in (next(p for p in params if p.dim() == 1), next(p for p in params if p.dim() != 1)):
        copies = [p.detach().clone() for p in params]
        copies[[id(p) for p in params].index(id(bad))].view(-1)[0] = float("inf")
        assert not math.isfinite(float(finite_total(copies)))  # type: ignore[arg-type]
    assert finite_total([params[0], params[1].detach().double()]) is None


def test_a_large_1d_tensor_is_normed_in_place_not_copied_into_the_finite_steps_sum() -> None:
    """A flat shard (FSDP, ZeRO: a whole model's parameters in one 1-D tensor) is not copied by ``cat`` at
    every step: it joins the others' ``_foreach_norm``, and an Inf at its end still makes the total
    non-finite."""
    from torch_nbdebug.record.nanwatch.checks import optim

    shard, bias = torch.zeros(optim._SMALL + 1), torch.ones(8)
    with OpCount(views=True) as counted:
        total = optim.finite_total([shard, bias])
    assert counted.ops == {"cat": 1, "sum": 2, "_foreach_norm": 1, "stack": 1, "add": 1}
    assert total is not None and float(total) == 8.0
    with OpCount(views=True) as alone:
        optim.finite_total([shard])
    assert "cat" not in alone.ops
    shard[-1] = float("inf")
    assert not math.isfinite(float(optim.finite_total([shard, bias])))  # type: ignore[arg-type]


def test_a_watched_backward_lists_the_weights_without_module_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default watch checks before each backward that the model's weights are those of its forward:
    listed by one loop over the module tree, not ``Module.parameters()`` (a generator chain that cost
    more than the check)."""
    model, step = small_gpt_step()
    step()
    calls = collections.Counter()
    listing = nn.Module.parameters

    def counted(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        calls["parameters"] += 1
        return listing(self, *args, **kwargs)

    with nanwatch(namespace={"model": model}) as report:
        step()
        monkeypatch.setattr(nn.Module, "parameters", counted)
        for _ in range(2):
            step()
        monkeypatch.setattr(nn.Module, "parameters", listing)
    assert calls["parameters"] == 0
    assert report.events == () and report.layers


def test_the_backward_walk_names_each_node_class_once_and_knows_a_padding_embedding() -> None:
    """The walk before the engine starts judges a node by its class (``name()`` read once per class);
    an embedding masks its gradient only with a ``padding_idx``, whichever came first."""
    from torch_nbdebug.record.nanwatch.replay.backward import KINDS as _KINDS, BackwardWatch

    weight = torch.randn(5, 3, requires_grad=True)
    idx = torch.tensor([0, 1, 2])
    for order in ([None, 0], [0, None]):
        found = []
        for padding in order:
            out = (F.embedding(idx, weight, padding_idx=padding) * 2).relu().sum()
            absorbers: list = []
            BackwardWatch._walk_call(out.grad_fn, 0, 2**62, "region", {}, absorbers)
            found.append(sorted(node.name() for node, _ in absorbers))
        with_pad = ["EmbeddingBackward0", "ReluBackward0"]
        assert found == ([["ReluBackward0"], with_pad] if order[0] is None else [with_pad, ["ReluBackward0"]])
    kinds = {cls.__name__: kind for cls, kind in _KINDS.items()}
    assert kinds["ReluBackward0"] == 1 and kinds["MulBackward0"] == 0 and kinds["EmbeddingBackward0"] == 2


def test_the_module_tree_walk_lists_what_modules_and_parameters_list() -> None:
    """One loop gives ``modules()`` and ``parameters()`` (each once, in order: shared modules and
    weights too); a class that lists its modules its own way gets its own listing."""
    from torch_nbdebug.record.nanwatch.replay.forward import module_tree

    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.ReLU(), nn.Sequential(shared, nn.Linear(3, 2)), nn.LayerNorm(2))
    model[3].weight = model[2][1].bias  # a weight shared under two names
    modules, params = module_tree(model)
    assert modules == list(model.modules()) and len(modules) == 6
    assert params == tuple(model.parameters())

    class Listed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(2, 2)

        def modules(self) -> Any:  # type: ignore[override]
            return iter([self])

    odd = Listed()
    assert module_tree(odd) == ([odd], tuple(odd.parameters()))


def test_a_kept_module_output_has_its_statistics_from_when_the_module_returned() -> None:
    """The replay's module layer computes each output's min, max and sum as the module returns (the
    output is still in the cache then) and reads them all when the outermost call returns."""
    from torch_nbdebug.record.nanwatch.replay.kept import KeptReadings

    kept = KeptReadings()
    t = torch.tensor([1.0, -2.0, 4.0])
    kept.output(t, "model.fc", nn.Linear(3, 3), (), None, 0)
    t.data.fill_(float("nan"))  # (no version bump: the entry is not dropped as written since)
    (entry,) = kept.take()
    assert entry.values == [-2.0, 4.0, 1.0]


def test_a_finite_forward_builds_a_replay_call_and_finds_the_users_line_for_the_model_call_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU each module output is read as the module returns: a finite one needs no replay, so
    neither its call's arguments nor the user's line (a stack walk) are taken; only the model call's,
    whatever the number of modules inside it."""
    from torch_nbdebug.record.nanwatch.core import events as nanwatch_events
    from torch_nbdebug.record.nanwatch.replay import forward as nanwatch_replay

    walk, make_call = nanwatch_events.user_frame, nanwatch_replay.Call

    def counting(counts: collections.Counter, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return function(*args, **kwargs)
        return wrapper

    by_size = {}
    for layers in (2, 8):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(layers)])
        x = torch.randn(4, 8)
        counts: collections.Counter = collections.Counter()
        with nanwatch(namespace={"model": model}) as report:
            model(x).sum().backward()  # (the first step: the watch's own first-use work)
            monkeypatch.setattr(nanwatch_events, "user_frame", counting(counts, "stack walks", walk))
            monkeypatch.setattr(nanwatch_replay, "Call", counting(counts, "calls", make_call))
            model(x).sum().backward()
            monkeypatch.setattr(nanwatch_events, "user_frame", walk)
            monkeypatch.setattr(nanwatch_replay, "Call", make_call)
        assert report.events == () and len(report.layers) == 1 + 3 * layers
        by_size[layers] = counts
    assert by_size[2]["calls"] == 1 and by_size[2] == by_size[8], by_size
