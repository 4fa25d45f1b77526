"""TensorBoard export, read back with TensorBoard's own event reader."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from torch_nbdebug.api.grads import record_gradients
from torch_nbdebug.api.memory import memory_timeline
from torch_nbdebug.api.monitor import monitor
from torch_nbdebug.api.nanwatch import nanwatch
from torch_nbdebug.api.tensorboard import clean_tag, to_tensorboard
from torch_nbdebug.errors import InputError

pytest.importorskip("tensorboard", reason="needs the tensorboard extra: pip install torch_nbdebug[tensorboard]")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def read(logdir: Path) -> EventAccumulator:
    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    events.Reload()
    return events


def scalars(events: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in events.Scalars(tag)]


def text(events: EventAccumulator, tag: str) -> str:
    return events.Tensors(f"{tag}/text_summary")[0].tensor_proto.string_val[0].decode()  # add_text adds the suffix


def train(steps: int = 6, nan_at: int = -1) -> tuple[nn.Module, Any, list[float]]:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    seen = []
    for step in range(steps):
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        if step == nan_at:
            loss = loss * float("nan")
        loss.backward()
        opt.step()
        seen.append(loss.item())
    return net, opt, seen


def test_monitor_scalars_layers_and_alerts(tmp_path: Path) -> None:
    with monitor("loss", "opt.param_groups[0]['lr']", namespace=None) as mon:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        x, y = torch.randn(16, 4), torch.randn(16, 2)
        for step in range(6):
            opt.zero_grad()
            loss = nn.functional.mse_loss(net(x), y) * (float("nan") if step == 4 else 1.0)
            loss.backward()
            opt.step()
    assert mon.to_tensorboard(tmp_path) == str(tmp_path)
    events = read(tmp_path)
    got = scalars(events, "monitor/loss")
    assert [s for s, _ in got] == [0, 1, 2, 3, 4, 5]
    assert np.allclose([v for _, v in got], mon.history["loss"], equal_nan=True)
    lr_tag = "monitor/" + clean_tag("opt.param_groups[0]['lr']")
    assert lr_tag == "monitor/opt.param_groups_0___lr__"
    assert [v for _, v in scalars(events, lr_tag)] == pytest.approx([0.05] * 6)
    norms = [v for _, v in scalars(events, "grad_norm/net.0")]
    assert np.allclose(norms[:4], mon.history.grad_norm[:4, 0])
    assert len(scalars(events, "update_ratio/net.2")) == 4  # NaN ratios after the NaN step are left out
    assert "non-finite" in text(events, "monitor/alerts") and "%%nanwatch" in text(events, "monitor/alerts")


def test_gradient_trace_norms_and_histograms(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    with record_gradients(net, name="net") as trace:
        for _ in range(3):
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
    assert trace.to_tensorboard(tmp_path) == str(tmp_path)  # the method on the result
    events = read(tmp_path)
    norms = scalars(events, "grad_norm/net.0")
    assert [s for s, _ in norms] == list(trace.steps)
    assert norms[-1][1] == pytest.approx(trace.layer("net.0", -1).norm, rel=1e-5)
    hist = events.Histograms("grad_hist/net.2.weight")
    assert len(hist) == len(trace.hist_rows)
    assert hist[-1].histogram_value.num == pytest.approx(16)  # all 16 elements of the 2x8 weight
    assert scalars(events, "grad_update_ratio/net.2")


def test_memory_timeline_bytes_by_category(tmp_path: Path) -> None:
    ns: dict[str, Any] = {}
    with memory_timeline(ns) as tl:
        net = nn.Linear(64, 64)
        net(torch.randn(8, 64)).sum().backward()
    tl.to_tensorboard(tmp_path)
    events = read(tmp_path)
    params = scalars(events, "memory/parameters")
    assert params[-1][1] == pytest.approx(sum(p.numel() * 4 for p in net.parameters()))
    total = scalars(events, "memory/total")
    assert max(v for _, v in total) == pytest.approx(tl.peak_bytes) and len(total) <= 2000
    assert "peak" in text(events, "memory/summary")


def test_nanwatch_births_as_text(tmp_path: Path) -> None:
    with nanwatch(namespace={}) as report:
        torch.log(torch.tensor([-1.0, 2.0]))
    report.to_tensorboard(tmp_path)
    events = read(tmp_path)
    assert "log" in text(events, "nanwatch/births")
    assert scalars(events, "nanwatch/births") == [(0, 1.0)]


def test_magic_option_writes_the_run(tmp_path: Path) -> None:
    from IPython.testing.globalipapp import get_ipython

    from torch_nbdebug.magics.monitor import MAGICS

    ip = get_ipython()
    ip.register_magics(MAGICS)
    try:
        ip.user_ns["train"] = train
        ip.run_cell_magic("monitor", f'-q --tensorboard "{tmp_path}" 1.5', "_ = train()")
    finally:
        for kind, names in MAGICS.magics.items():
            for name in names:
                ip.magics_manager.magics[kind].pop(name, None)
        ip.user_ns.pop("train", None)
    assert [v for _, v in scalars(read(tmp_path), "monitor/1.5")] == [1.5] * 6


def test_wrong_object_and_missing_tensorboard(tmp_path: Path, monkeypatch: Any) -> None:
    with pytest.raises(InputError, match="gradient trace"):
        to_tensorboard(42, tmp_path)
    with pytest.raises(InputError, match="nothing recorded yet"):
        to_tensorboard(monitor("1"), tmp_path)
    with monitor("1") as done:
        pass
    with pytest.raises(InputError, match="a directory"):
        done.to_tensorboard("")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with monitor("1") as mon:
        pass
    with pytest.raises(ImportError, match=r"pip install torch_nbdebug\[tensorboard\]"):
        mon.to_tensorboard(tmp_path)
    with pytest.raises(ImportError, match="pip install"):
        monitor("loss", tensorboard=str(tmp_path))  # said before a long run, not after


def test_a_recording_still_running_says_so(tmp_path: Path) -> None:
    net = nn.Linear(2, 1)
    with record_gradients(net, name="net") as trace:
        with pytest.raises(InputError, match="still running"):
            trace.to_tensorboard(tmp_path)


def test_grads_and_cudamem_magics_write_event_files(tmp_path: Path, monkeypatch: Any) -> None:
    from IPython.core.error import UsageError
    from IPython.testing.globalipapp import get_ipython
    from IPython.utils.capture import capture_output

    from torch_nbdebug.magics.grads import MAGICS as GRADS
    from torch_nbdebug.magics.memory import MAGICS as MEMORY

    ip = get_ipython()
    ip.register_magics(GRADS)
    ip.register_magics(MEMORY)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ip.user_ns.update(net=net, opt=torch.optim.SGD(net.parameters(), lr=0.05), x=torch.randn(16, 4))
    loop = "for _ in range(3):\n    opt.zero_grad()\n    net(x).pow(2).mean().backward()\n    opt.step()\n"
    try:
        with capture_output() as cap:
            ip.run_cell_magic("grads", f'--tensorboard "{tmp_path / "g"}" net', loop)
            ip.run_cell_magic("cudamem", f"--tensorboard {tmp_path / 'm'}", "y = net(x).sum()\n")
        assert f"written to {tmp_path / 'g'}" in cap.stdout and f"written to {tmp_path / 'm'}" in cap.stdout
        norms = scalars(read(tmp_path / "g"), "grad_norm/net.0")
        layer = torch.cat([net[0].weight.grad.flatten(), net[0].bias.grad])  # the layer's last gradient
        assert len(norms) == 3 and norms[-1][1] == pytest.approx(float(layer.norm()), rel=1e-4)
        assert scalars(read(tmp_path / "m"), "memory/total")
        with pytest.raises(UsageError, match="need a cell"):
            ip.run_line_magic("cudamem", f"--tensorboard {tmp_path / 'n'}")
        monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
        with pytest.raises(UsageError, match=r"pip install torch_nbdebug\[tensorboard\]"):
            ip.run_cell_magic("grads", f"--tensorboard {tmp_path / 'h'} net", loop)  # before the loop runs
        assert not (tmp_path / "h").exists()
    finally:
        for magics in (GRADS, MEMORY):
            for kind, names in magics.magics.items():
                for name in names:
                    ip.magics_manager.magics[kind].pop(name, None)
        for name in ("net", "opt", "x", "y"):
            ip.user_ns.pop(name, None)


def test_nanwatch_magic_writes_the_births_also_when_the_cell_raises(tmp_path: Path) -> None:
    from IPython.testing.globalipapp import get_ipython
    from IPython.utils.capture import capture_output

    from torch_nbdebug.magics.nanwatch import MAGICS

    ip = get_ipython()
    ip.register_magics(MAGICS)
    before = ip.user_ns.get("torch")
    ip.user_ns["torch"] = torch
    try:
        with capture_output():
            ip.run_cell_magic("nanwatch", f"-q --tensorboard {tmp_path / 'ok'}", "y = torch.log(torch.tensor([-1.0]))\n")
            with pytest.raises(ZeroDivisionError):  # the user's exception, unchanged
                ip.run_cell_magic("nanwatch", f"-q --tensorboard {tmp_path / 'raised'}",
                                  "y = torch.log(torch.tensor([-1.0]))\n1 / 0\n")
        for run in ("ok", "raised"):
            events = read(tmp_path / run)
            assert "log" in text(events, "nanwatch/births") and scalars(events, "nanwatch/births") == [(0, 1.0)]
    finally:
        for kind, names in MAGICS.magics.items():
            for name in names:
                ip.magics_manager.magics[kind].pop(name, None)
        ip.user_ns.pop("y", None)
        if before is None:
            ip.user_ns.pop("torch", None)


def test_monitor_and_grads_number_the_same_loops_steps_alike(tmp_path: Path) -> None:
    """Issue 28, one step axis: the same loop under %%monitor and %%grads is exported on the same steps,
    numbered by the optimizer steps completed before each (0, 1, 2: the loop's own counter), and each
    tool's JSON (to_dict, to_json) says the same. Before, %%monitor wrote 1, 2, 3 and %%grads 0, 1, 2."""
    import json

    from IPython.testing.globalipapp import get_ipython
    from IPython.utils.capture import capture_output

    from torch_nbdebug.magics.grads import MAGICS as GRADS
    from torch_nbdebug.magics.monitor import MAGICS as MONITOR

    ip = get_ipython()
    ip.register_magics(GRADS)
    ip.register_magics(MONITOR)
    setup = ("torch.manual_seed(0)\nnet = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))\n"
             "opt = torch.optim.SGD(net.parameters(), lr=0.05)\nx = torch.randn(16, 4)\n")
    loop = ("for step in range(3):\n    opt.zero_grad()\n    loss = net(x).pow(2).mean()\n    loss.backward()\n"
            "    opt.step()\n    seen.append(step)\n")
    ip.user_ns.update(torch=torch, nn=nn)
    try:
        with capture_output():
            ip.run_cell(setup)
            ip.user_ns["seen"] = []
            monitored = ip.run_cell_magic("monitor", f'-o --tensorboard "{tmp_path / "monitor"}" loss', loop)
            ip.run_cell(setup)
            ip.user_ns["seen"] = []
            traced = ip.run_cell_magic("grads", f'-o --tensorboard "{tmp_path / "grads"}" net', loop)
        loop_steps = ip.user_ns["seen"]
    finally:
        for magics in (GRADS, MONITOR):
            for kind, names in magics.magics.items():
                for name in names:
                    ip.magics_manager.magics[kind].pop(name, None)
        for name in ("torch", "nn", "net", "opt", "x", "loss", "step", "seen", "_monitor"):
            ip.user_ns.pop(name, None)
    monitor_events, grads_events = read(tmp_path / "monitor"), read(tmp_path / "grads")
    assert loop_steps == [0, 1, 2]
    assert [s for s, _ in scalars(monitor_events, "monitor/loss")] == loop_steps
    for layer in ("net.0", "net.2"):
        assert [s for s, _ in scalars(monitor_events, f"grad_norm/{layer}")] == loop_steps
        assert [s for s, _ in scalars(grads_events, f"grad_norm/{layer}")] == loop_steps
    assert monitored.history.to_dict()["step"] == loop_steps
    assert json.loads(traced.trace.to_json())["steps"] == loop_steps


def test_profile_time_by_category_per_step_the_verdict_and_the_trace(tmp_path: Path) -> None:
    from torch_nbdebug.api.profile import profile

    net, opt, _ = train(1)
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    with profile({"net": net}, steps=3, tensorboard=tmp_path) as prof:
        for _ in range(4):
            opt.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()
    events = read(tmp_path)
    steps = scalars(events, "profile/step_ms")
    assert [s for s, _ in steps] == [1, 2, 3]  # the loop's own step numbers; 0 is warm-up
    assert [v for _, v in steps] == pytest.approx([s.ms for s in prof.breakdown])
    per_category = [scalars(events, f"profile/{c}_ms") for c in ("data", "forward", "backward", "optimizer", "sync",
                                                                  "python")]
    assert [sum(values) for values in zip(*[[v for _, v in c] for c in per_category])] == \
        pytest.approx([v for _, v in steps])
    assert prof.verdict.kind in text(events, "profile/verdict")
    assert list(tmp_path.glob("*.pt.trace.json"))  # the trace, where TensorBoard's profile readers look
