"""profile(): each verdict on a small realistic CPU training cell, the line and the module it names, the
breakdown adding up, steps and warm-up, Stop, the user's exception, nothing left installed."""
from __future__ import annotations

import json
import math
import sys
import threading
import time
from typing import Any

import pytest
import torch
from torch import nn

import torch_nbdebug as nb
from torch_nbdebug.errors import InputError



@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """One intra-op thread: on a loaded machine waking a second one costs milliseconds at random,
    which would be what these tiny steps measure."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    yield
    torch.set_num_threads(before)


class SlowDataset(torch.utils.data.Dataset):
    """Decodes each sample in Python: the classic data-bound step."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = [math.sin(i * k) for k in range(20000)]  # the slow decoding line
        return torch.tensor(row[:16]), torch.tensor(row[16:18])


def small_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))


def train(model: nn.Module, opt: Any, batches: Any) -> None:
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()


def test_a_slow_dataset_is_data_bound_and_the_verdict_names_the_decoding_line() -> None:
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(SlowDataset(), batch_size=4)
    with nb.profile(steps=5) as prof:
        train(model, opt, loader)
    v = prof.verdict
    assert v.kind == "data", prof.text()
    assert v.share > 0.5
    assert v.line is not None and v.line.function == "__getitem__"
    assert "math.sin(i * k)" in v.line.text
    assert "num_workers" in v.fix
    assert len(prof.breakdown) == 5 and prof.breakdown[0].number == 1  # step 0 is warm-up
    assert prof.data.step_source == "optimizer"


class Recurrent(nn.Module):
    """A cell unrolled in Python over a long sequence: hundreds of tiny ops per step."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], 8)
        for t in range(x.shape[1]):
            h = torch.tanh(self.cell(h) + x[:, t])  # the loop line
        return h


def test_a_python_loop_of_tiny_ops_is_launch_bound_with_its_loop_line_and_module() -> None:
    model = Recurrent()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(4, 120, 8), torch.randn(4, 8)
    with nb.profile(steps=3) as prof:
        for _ in range(4):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    v = prof.verdict
    assert v.kind == "launch", prof.text()
    assert v.figures["ops_per_step"] >= 200 and v.figures["median_op_us"] <= 25
    assert v.line is not None and "torch.tanh(self.cell(h)" in v.line.text
    assert v.module is not None and v.module.startswith("model")
    assert "torch.compile" in v.fix


def test_a_big_matmul_model_is_compute_bound_and_names_its_heaviest_layer() -> None:
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x, y = torch.randn(256, 1024), torch.randn(256, 1024)
    with nb.profile(steps=3) as prof:
        train(model, opt, [(x, y)] * 4)
    v = prof.verdict
    assert v.kind == "compute", prof.text()
    assert v.module in ("model.0", "model.2")
    assert any(o.name in ("aten::linear", "aten::addmm") or "AddmmBackward" in o.name for o in prof.ops[:3])


def test_python_work_between_ops_is_host_bound_and_names_that_line() -> None:
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 2)
    history = []
    with nb.profile(steps=4) as prof:
        for step in range(5):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            checksum = sum(k * k % 7 for k in range(60000))  # bookkeeping in Python
            history.append(checksum)
    v = prof.verdict
    assert v.kind == "host", prof.text()
    assert v.line is not None and "checksum = sum(" in v.line.text


def test_converting_big_batches_every_step_is_memory_bound() -> None:
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    raw = torch.randn(2000, 2000, dtype=torch.float64)
    with nb.profile(steps=3) as prof:
        for step in range(4):
            batch = raw.to(torch.float32).t().contiguous()  # a copy and a transpose copy per step
            opt.zero_grad()
            nn.functional.mse_loss(model(batch[:8, :16]), batch[:8, 16:18]).backward()
            opt.step()
    assert prof.verdict.kind == "memory", prof.text()
    assert prof.verdict.figures["copy_share"] >= 0.3


def test_the_categories_of_each_step_add_up_to_the_step_and_modules_are_named_like_the_user() -> None:
    model = small_model()
    opt = torch.optim.Adam(model.parameters())
    loader = torch.utils.data.DataLoader(SlowDataset(), batch_size=8)
    with nb.profile(steps=None, warmup=2) as prof:
        train(model, opt, loader)
    assert len(prof.breakdown) == 4  # 6 batches, 2 warm-up
    for step in prof.breakdown:
        assert sum(step.categories.values()) == pytest.approx(step.ms, rel=1e-6)
        assert all(v >= 0 for v in step.categories.values())
        assert step.categories["forward"] > 0 and step.categories["backward"] > 0 and step.categories["optimizer"] > 0
    paths = {m.path for m in prof.by_module}
    assert {"model", "model.0", "model.1", "model.2"} <= paths
    top = {m.path: m for m in prof.by_module}["model"]
    assert top.calls == 1 and top.ms >= top.self_ms >= 0
    assert all(0 <= r.share <= 1.0 + 1e-9 for r in prof.by_line)


def test_steps_without_an_optimizer_are_the_dataloader_batches_else_the_whole_block(monkeypatch: Any) -> None:
    loader = torch.utils.data.DataLoader(SlowDataset(), batch_size=12)
    model = small_model()
    with nb.profile(warmup=1) as prof:
        for x, _ in loader:
            model(x)
    assert prof.data.step_source == "dataloader" and len(prof.breakdown) == 3  # 4 batches, 1 warm-up
    from torch_nbdebug.record.profile_sampler import LineSampler

    start = LineSampler.start

    def slow_start(self: Any) -> None:  # a tool that takes long to set up (finding libc took ms)
        time.sleep(0.1)
        start(self)

    monkeypatch.setattr(LineSampler, "start", slow_start)
    with nb.profile() as whole:
        model(torch.randn(4, 16)).sum().backward()
    assert whole.data.step_source == "cell" and len(whole.breakdown) == 1
    assert whole.breakdown[0].ms < 100  # the step is the block's code, not the tool's setting up


def test_stop_keeps_what_was_profiled_and_the_users_exception_comes_through_unchanged() -> None:
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 2)
    with pytest.raises(KeyboardInterrupt):
        with nb.profile() as stopped:
            for step in range(100):
                train(model, opt, [(x, y)])
                if step == 4:
                    raise KeyboardInterrupt
    assert stopped.data.status == "stopped" and len(stopped.breakdown) == 4
    assert "stopped" in stopped.text()
    error = ValueError("the user's own")
    with pytest.raises(ValueError) as caught:
        with nb.profile() as failed:
            train(model, opt, [(x, y)] * 3)
            raise error
    assert caught.value is error
    assert failed.data.status == "failed"
    assert not [t for t in threading.enumerate() if t.name.startswith("torch_nbdebug-profile")]
    with nb.profile() as again:  # and a new profiler can start: nothing of the old one is running
        train(model, opt, [(x, y)] * 2)
    assert again.breakdown


@pytest.mark.parametrize("mode", ["signal", "thread"])
def test_both_samplers_name_the_slow_line_and_leave_nothing_behind(mode: str, monkeypatch: Any) -> None:
    """The timer signal (this process: nobody else uses SIGPROF) and the thread it falls back to."""
    import signal

    from torch_nbdebug.record import profile_sampler

    original = profile_sampler.LineSampler.__init__
    monkeypatch.setattr(profile_sampler.LineSampler, "__init__",
                        lambda self, *a, **k: original(self, *a, **{**k, "mode": mode}))
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(SlowDataset(), batch_size=4)
    with nb.profile(steps=4) as prof:
        train(model, opt, loader)
    assert prof.verdict.kind == "data" and "math.sin(i * k)" in prof.verdict.line.text
    assert signal.getsignal(signal.SIGPROF) == signal.SIG_DFL
    assert sys.getswitchinterval() == pytest.approx(0.005)
    assert not [t for t in threading.enumerate() if t.name.startswith("torch_nbdebug-profile")]


def test_profiling_stops_after_warmup_plus_steps_and_the_cell_runs_on() -> None:
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 2)
    with nb.profile(steps=3, warmup=2) as prof:
        train(model, opt, [(x, y)] * 30)
    assert [s.number for s in prof.breakdown] == [2, 3, 4]  # 0 and 1: warm-up
    assert prof.data.steps_seen == 30
    assert opt.state_dict()["state"] == {} and model[0].weight.grad is not None  # the loop ran to the end


def test_compare_says_what_got_faster_and_that_the_verdict_changed() -> None:
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nb.profile(steps=3) as slow:
        train(model, opt, torch.utils.data.DataLoader(SlowDataset(), batch_size=4))
    cached = [(x, y) for x, y in torch.utils.data.DataLoader(SlowDataset(), batch_size=4)]
    with nb.profile(steps=3) as fast:
        train(model, opt, cached)
    change = fast.compare(slow)
    assert change.before_verdict == "data" and change.after_verdict != "data" and change.verdict_changed
    assert change.speedup > 2
    data = {c.name: c for c in change.categories}["data"]
    assert data.delta_ms < 0 and data.after_ms == 0
    assert "faster" in change.text() and "data loading" in change.text()
    with pytest.raises(InputError):
        fast.compare("slow")  # type: ignore[arg-type]


def test_a_hundred_step_report_is_small_json_that_reads_back() -> None:
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 2)
    with nb.profile(steps=100) as prof:
        train(model, opt, [(x, y)] * 101)
    text = prof.to_json()
    assert len(prof.breakdown) == 100
    assert len(text.encode()) < 1_000_000
    back = nb.Profile.from_json(text)
    assert back.data == prof.data and back.verdict == prof.verdict
    assert json.loads(text)["schema"] == "torch_nbdebug.profile/1"
    with pytest.raises(InputError):
        nb.Profile.from_json('{"schema": "something else"}')


def test_the_chrome_trace_is_written_when_asked_and_refused_when_not_kept(tmp_path: Any) -> None:
    model = small_model()
    path = tmp_path / "steps.json"
    with nb.profile(trace=path) as prof:
        model(torch.randn(4, 16)).sum().backward()
    events = json.loads(path.read_text())["traceEvents"]
    assert any(e.get("name") == "module: model.0" for e in events)
    assert prof.data.trace == str(path)
    copy = prof.export_chrome_trace(tmp_path / "copy.json")
    assert json.loads(open(copy).read())["traceEvents"]
    with nb.profile() as plain:
        model(torch.randn(4, 16))
    with pytest.raises(InputError, match="keep_trace"):
        plain.export_chrome_trace(tmp_path / "none.json")
    with nb.profile(keep_trace=True) as kept:
        model(torch.randn(4, 16))
    kept.export_chrome_trace(tmp_path / "kept.json")
    assert (tmp_path / "kept.json").stat().st_size > 0


def test_bad_input_is_an_input_error_and_a_running_profiler_is_said() -> None:
    for kwargs in ({"steps": 0}, {"warmup": -1}, {"steps": 1.5}, {"interval": 0}, {"trace": ""}):
        with pytest.raises(InputError):
            nb.profile(**kwargs)
    from torch.profiler import profile as torch_profile

    with torch_profile():
        with pytest.raises(InputError, match="already running"):
            with nb.profile():
                pass


def test_the_sync_verdict_never_comes_on_cpu() -> None:
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 2)
    with nb.profile(steps=3) as prof:
        for _ in range(4):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            print_value = loss.item() + float(model[0].weight.detach().sum())  # what syncs on a GPU
            time.sleep(0)
    assert prof.verdict.kind != "sync"
    assert all(s.syncs == 0 and s.categories["sync"] == 0 for s in prof.breakdown)
    assert print_value == print_value
