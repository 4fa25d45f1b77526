"""repro() on CPU: every cause with its op, module, line and phase, the state-after-once semantics, cleanup."""
from __future__ import annotations

import gc
import random
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from torch_nbdebug.api.repro import ReproReport, last_report, repro, run_twice
from torch_nbdebug.errors import InputError


def line_of(fn: Any, text: str) -> int:
    """The absolute line number in this file of the line of ``fn`` containing ``text``."""
    import inspect

    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc(x)).sum()


def make(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.Adam(model.parameters(), lr=0.1), torch.randn(16, 4)


def test_identical_training_step_and_state_after_once() -> None:
    model, opt, x = make()
    twin, twin_opt, _ = make()
    twin.load_state_dict(model.state_dict())

    def step(m: nn.Module, o: torch.optim.Optimizer) -> torch.Tensor:
        loss = m(x).pow(2).mean()
        o.zero_grad()
        loss.backward()
        o.step()
        return loss

    report = repro(lambda: step(model, opt), state=(model, opt))
    assert isinstance(report, ReproReport) and report.identical and report.cause is None and report.first is None
    assert report.summary.ops[0] == report.summary.ops[1] > 20
    step(twin, twin_opt)  # one plain step
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q) and torch.equal(p.grad, q.grad)
        assert opt.state[p]["step"].item() == 1.0  # stepped once, not twice
    assert "identical" in report.text() and "tnd-repro" in report.html()


def test_rng_without_restoring_names_the_dropout() -> None:
    torch.manual_seed(0)
    model, x = Noisy(), torch.randn(8, 4)
    report = repro(lambda: model(x), state={"model": model}, restore_rng=False)
    first = report.first
    assert not report.identical and report.cause == "rng"
    assert (first.op, first.module, first.phase) == ("aten.bernoulli_.float", "model.drop", "forward")
    assert first.lineno == line_of(Noisy.forward, "self.drop(") and first.filename == __file__
    assert first.line == "return self.drop(self.fc(x)).sum()" and first.max_abs_diff > 0
    assert "seed" in report.hint


def test_rng_restored_by_default_is_identical() -> None:
    torch.manual_seed(0)
    model, x = Noisy(), torch.randn(8, 4)
    before = torch.get_rng_state()
    report = repro(lambda: model(x).backward(), state=model)
    assert report.identical
    torch.set_rng_state(before)
    model(x)  # one run draws as much as the two runs drew together: state after once
    assert torch.equal(torch.get_rng_state(), torch.get_rng_state())


def test_private_generator_not_in_state_is_rng() -> None:
    gen = torch.Generator().manual_seed(0)
    w = nn.Linear(4, 4)

    def cell() -> torch.Tensor:
        noise = torch.randn(4, 4, generator=gen)
        return w(noise).sum()

    report = repro(cell, state=w)
    assert report.cause == "rng" and report.first.op == "aten.randn.generator"
    assert report.first.lineno == line_of(cell, "torch.randn(4, 4, generator=gen)")
    assert repro(cell, state=(w, gen)).identical  # a generator given as state is restored


def test_uninitialized_memory_read() -> None:
    x = torch.randn(8)

    def cell() -> torch.Tensor:
        buf = torch.empty(64)
        buf.add_(1.0)  # reads garbage
        return (buf[:8] * x).sum()

    for _ in range(3):  # garbage may repeat by chance; it differs on one of a few tries
        report = repro(cell)
        if not report.identical:
            break
    first = report.first
    assert report.cause == "uninitialized" and first.op == "aten.add_.Tensor"
    assert first.lineno == line_of(cell, "buf.add_(1.0)") and first.phase == "forward"
    assert first.allocated_at is not None and "torch.empty(64)" in first.allocated_at
    assert "torch.zeros" in report.hint


def test_empty_then_written_is_fine() -> None:
    def cell() -> torch.Tensor:
        buf = torch.empty(64)
        buf.fill_(2.0)
        out = torch.empty(8)
        torch.mul(buf[:8], 3.0, out=out)
        return nn.functional.dropout(out, 0.5).sum()

    assert repro(cell).identical


def test_external_python_random_value() -> None:
    model, _, x = make()

    def cell() -> torch.Tensor:
        scale = torch.tensor(random.random())
        return (model(x) * scale).sum()

    report = repro(cell, state=model, restore_rng=False)
    assert report.cause == "external" and report.first.op == "aten.lift_fresh.default"
    assert report.first.lineno == line_of(cell, "random.random()") and "Python data" in report.first.input
    assert repro(cell, state=model).identical  # restore_rng also restores Python's random


def test_external_attribute_changed_by_previous_run() -> None:
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.calls = nn.Linear(4, 1), 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            return self.fc(x) * self.calls

    model, x = Counter(), torch.randn(2, 4)
    report = repro(lambda: model(x).sum(), state={"model": model})
    first = report.first
    assert report.cause == "external" and (first.op, first.module) == ("aten.mul.Tensor", "model")
    assert first.lineno == line_of(Counter.forward, "* self.calls") and first.input.startswith("a Python number")


def test_tensor_not_in_state_changed_in_place() -> None:
    total = torch.zeros(3)  # not passed as state
    report = repro(lambda: total.add_(1.0).mul(2))
    assert report.cause == "external" and report.first.op == "aten.add_.Tensor"
    assert "outside the snapshot" in report.first.input
    total.zero_()
    assert repro(lambda: total.add_(1.0).mul(2), state=total).identical
    assert torch.equal(total, torch.ones(3))  # restored copy-on-write, then run once


_calls = [0]


@torch.library.custom_op("nbdebug_test::jitter", mutates_args=())
def jitter(x: torch.Tensor) -> torch.Tensor:
    """A fake nondeterministic kernel: the last bits depend on how often it ran (like atomics' order)."""
    _calls[0] += 1
    return x + _calls[0] * 1e-4


@jitter.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_nondeterministic_kernel_fake_on_cpu() -> None:
    model, _, x = make()

    def cell() -> torch.Tensor:
        h = model[0](x)
        return jitter(h).sum()

    report = repro(cell, state=model)
    first = report.first
    assert report.cause == "nondeterministic_op" and first.op == "nbdebug_test.jitter.default"
    assert first.lineno == line_of(cell, "jitter(h)") and first.phase == "forward" and first.input is None
    assert 0 < first.max_abs_diff <= 1.1e-4 and "use_deterministic_algorithms" in report.hint


def test_backward_op_names_forward_module_and_line() -> None:
    class Jittery(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return JitterGrad.apply(self.fc(x))

    class JitterGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            return jitter(g)

    model, x = Jittery(), torch.randn(3, 4)
    report = repro(lambda: model(x).sum().backward(), state={"model": model})
    first = report.first
    assert report.cause == "nondeterministic_op" and first.phase == "backward"
    assert first.op == "nbdebug_test.jitter.default" and first.module == "model"
    assert first.lineno == line_of(JitterGrad.forward, "return x * 2")  # the forward op that made the node


def test_nondeterministic_ops_listed_on_cpu() -> None:
    target = torch.zeros(5, 2)
    report = repro(lambda: target.clone().index_copy_(0, torch.tensor([0, 2]), torch.ones(2, 2)))
    [use] = report.nondeterministic_ops
    assert (use.op, use.device, use.count) == ("aten.index_copy_.default", "cpu", 1)
    assert "index_copy_" in use.line and report.identical


def test_optimizer_phase_and_scheduler_restored() -> None:
    model, opt, x = make()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def cell() -> None:
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()

    report = repro(cell, state=(model, opt, sched))
    assert report.identical
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05) and sched.last_epoch == 1


def test_user_exception_is_reraised_and_report_kept() -> None:
    model, _, x = make()
    calls = []

    def cell() -> torch.Tensor:
        calls.append(1)
        if len(calls) == 2:
            raise KeyError("second run only")
        return model(x).sum()

    with pytest.raises(KeyError, match="second run only"):
        repro(cell, state=model)
    report = last_report()
    assert report is not None and report.cause == "external" and not report.identical

    def broken() -> None:
        raise ValueError("mine")

    with pytest.raises(ValueError, match="mine"):
        repro(broken)
    assert "first run raised" in last_report().text()


def test_bad_input() -> None:
    with pytest.raises(InputError, match="fn must be a function"):
        repro(3)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="item 1 is a str"):
        repro(lambda: None, state=(nn.Linear(1, 1), "x"))
    with pytest.raises(InputError, match="restore_rng"):
        repro(lambda: None, restore_rng="yes")  # type: ignore[arg-type]


def test_no_tensor_kept_alive_and_value_of_second_run() -> None:
    model, opt, x = make()
    report, value = run_twice(lambda: model(x), state=(model, opt))
    ref = weakref.ref(value)
    params = [weakref.ref(p) for p in model.parameters()]
    del value, model, opt
    gc.collect()
    assert ref() is None and all(r() is None for r in params) and report.identical
    assert "tensor(" not in repr(report.to_dict())  # plain data


def test_namespace_bindings_run_once() -> None:
    ns: dict[str, Any] = {"x": torch.ones(2), "n": 0, "torch": torch}
    code = compile("x = x + 1\nn = n + 1\ny = x * 2\n", "<cell>", "exec")
    report = repro(lambda: exec(code, ns), namespace=ns)
    assert report.identical and ns["n"] == 1 and torch.equal(ns["x"], torch.full((2,), 2.0))


def test_unknown_when_state_changes_outside_torch_ops() -> None:
    w = torch.zeros(4)

    def cell() -> torch.Tensor:
        out = (w * 2).sum()
        w.numpy()[0] += 1.0  # a write torch never sees: the snapshot cannot undo it
        return out

    report = repro(cell, state={"w": w})
    assert report.cause == "unknown" and report.first.op == "aten.mul.Tensor"
    assert report.first.input == "w: changed outside torch's ops, not restored" and "`w` was changed" in report.hint


def test_device_path_batches_fingerprints(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path (fingerprints left on the device, read 64 ops at a time), run on the CPU."""
    from torch_nbdebug.record.repro import ReproRecorder

    torch.manual_seed(0)
    model, x = Noisy(), torch.randn(8, 4)

    def cell() -> None:
        for _ in range(30):  # more ops than one batch
            model(x).backward()

    with ReproRecorder() as at_once:
        cell()
    monkeypatch.setattr(ReproRecorder, "read_at_once", ())
    torch.manual_seed(0)
    model, x = Noisy(), torch.randn(8, 4)
    with ReproRecorder() as batched:
        cell()
    assert len(batched.traces) == len(at_once.traces) > 128
    assert [t.outputs for t in batched.traces] == [t.outputs for t in at_once.traces]
    assert [t.inputs for t in batched.traces] == [t.inputs for t in at_once.traces]
    report = repro(lambda: model(x), state={"model": model}, restore_rng=False)
    assert report.cause == "rng" and report.first.module == "model.drop"


def test_preflight_flags_unseeded_loader_workers() -> None:
    data = torch.utils.data.TensorDataset(torch.randn(8, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=2)
    seeded = torch.utils.data.DataLoader(data, batch_size=4, num_workers=2, generator=torch.Generator().manual_seed(0))
    report = repro(lambda: torch.ones(2).sum(), state={"loader": loader, "seeded": seeded})
    flagged = [p.name for p in report.preflight if p.status == "warn" and p.name.startswith("DataLoader")]
    assert flagged == ["DataLoader loader"] and report.identical
    names = {p.name for p in report.preflight}
    assert {"torch.use_deterministic_algorithms", "CUBLAS_WORKSPACE_CONFIG", "torch.backends.cudnn.benchmark"} <= names


def test_grad_scaler_made_lazily_in_the_cell_runs_once() -> None:
    model, opt, x = make()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1)

    def cell() -> None:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    report = repro(cell, state={"model": model, "opt": opt, "scaler": scaler})
    assert report.identical and scaler.get_scale() == 2.0**5  # grew once, not twice
    assert opt.state[next(model.parameters())]["step"].item() == 1.0


def test_batch_norm_in_training_is_identical_and_its_running_statistics_move_once() -> None:
    """``native_batch_norm`` updates the running statistics in place without its schema saying so: they were
    not saved before the first run, the runs "differed", and the statistics moved twice."""
    import copy

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16))
    x = torch.randn(4, 8)
    once = copy.deepcopy(net)
    once(x)
    report = repro(lambda: net(x).sum(), state=(net,))
    assert report.identical, report.text()
    assert torch.equal(net[1].running_mean, once[1].running_mean)
    assert torch.equal(net[1].running_var, once[1].running_var)
    assert net[1].num_batches_tracked.item() == 1


def test_an_eval_mode_cnn_step_is_identical_every_time() -> None:
    """Batch norm in eval mode and max pooling allocate with ``empty`` and leave some of it unwritten; whether
    the allocator later reused those addresses decided which optimizer ops were compared in full, so runs
    "differed" at the optimizer's first ``add_`` in 2 to 8 of 10 calls."""

    class CNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
            self.conv2, self.bn2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
            self.pool, self.fc = nn.MaxPool2d(2), nn.Linear(16 * 4 * 4, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.pool(torch.relu(self.bn1(self.conv1(x))))
            x = self.pool(torch.relu(self.bn2(self.conv2(x))))
            return self.fc(x.flatten(1))

    torch.manual_seed(0)
    model = CNN().eval()
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step() -> None:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    results = [repro(step, state=(model, opt)) for _ in range(8)]
    assert all(r.identical for r in results), [r.text() for r in results if not r.identical][:1]
