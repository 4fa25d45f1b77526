"""%%profile's CUDA path on the CPU, with a fake Kineto result: a kernel's time goes to the op that launched
it, a CUDA runtime call recorded on CUPTI's thread joins its op's thread (so a sync inside ``.item()`` is
the main thread's), the sync verdict names the line, and a device with no kernels is said."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from torch_nbdebug.data.profile import Sample
from torch_nbdebug.process.profile import summarize
from torch_nbdebug.record.profile import ProfileRecorder

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
T0 = 1_000_000_000


class FakeEvent:
    def __init__(self, name: str, start_us: float, end_us: float, thread: int = 1, device: Any = CPU,
                 corr: int = 0, linked: int = 0, annotation: bool = False) -> None:
        self._v = (name, T0 + int(start_us * 1000), T0 + int(end_us * 1000), thread, device, corr, linked, annotation)

    def name(self) -> str: return self._v[0]
    def start_ns(self) -> int: return self._v[1]
    def end_ns(self) -> int: return self._v[2]
    def start_thread_id(self) -> int: return self._v[3]
    def device_type(self) -> Any: return self._v[4]
    def correlation_id(self) -> int: return self._v[5]
    def linked_correlation_id(self) -> int: return self._v[6]
    def is_user_annotation(self) -> bool: return self._v[7]
    def is_python_function(self) -> bool: return False
    def is_hidden_event(self) -> bool: return False


def step(t: float, corr: int) -> list[FakeEvent]:
    """forward: a linear launching a 300 us kernel; then .item(): a copy and a 2 ms stream sync recorded by
    CUPTI on thread 99; then the optimizer."""
    return [
        FakeEvent("module: model.fc", t, t + 100, annotation=True),
        FakeEvent("aten::linear", t + 10, t + 90, corr=corr),
        FakeEvent("cudaLaunchKernel", t + 20, t + 30, thread=99, linked=corr),
        FakeEvent("void gemm", t + 25, t + 325, device=CUDA, linked=corr),
        FakeEvent("aten::item", t + 100, t + 2200, corr=corr + 1),
        FakeEvent("cudaStreamSynchronize", t + 150, t + 2150, thread=99, linked=corr + 1),
        FakeEvent("Optimizer.step#SGD.step", t + 2200, t + 2400, annotation=True),
    ]


def fake_recorder(events: list[FakeEvent], marks: list[float]) -> ProfileRecorder:
    rec = ProfileRecorder({}, steps=None)
    rec.device = "cuda"
    clock = FakeEvent("torch_nbdebug: clock", 0, 1, annotation=True)
    result = SimpleNamespace(trace_start_ns=lambda: T0, events=lambda: [clock, *events])
    rec.profiler = SimpleNamespace(profiler=SimpleNamespace(kineto_results=result), stop=lambda: None)
    rec._start_ns = 5_000_000  # our clock at the marker: the profiler's 0
    rec._end_ns = rec._start_ns + int(marks[-1] * 1000)
    rec._marks = [rec._start_ns + int(m * 1000) for m in marks]
    return rec


def test_kernels_go_to_their_op_and_runtime_calls_join_its_thread() -> None:
    events = step(10, 1) + step(2510, 3) + step(5010, 5)
    rec = fake_recorder(events, [2500, 5000, 7500])
    rec._sampler.positions = [("/tmp/ipykernel_1/1.py", 4, "<module>"), ("/tmp/ipykernel_1/1.py", 5, "<module>")]
    rec._sampler.samples = [(rec._start_ns + int(t * 1000), line, w) for base in (10, 2510, 5010)
                            for t, line, w in ((base + 95, 0, 90_000), (base + 2000, 1, 1_900_000))]
    capture = rec.finish("finished")
    by_name = {e.name: e for e in capture.events}
    assert by_name["cudaStreamSynchronize"].thread == 1  # CUPTI's thread 99 replaced by the op's
    assert by_name["cudaStreamSynchronize"].parent == capture.events.index(by_name["aten::item"])
    assert by_name["aten::linear"].device == 300.0 and by_name["aten::item"].device == 0.0
    assert by_name["void gemm"].on_device and by_name["void gemm"].parent == -1
    data = summarize(capture, warmup=1)
    assert data.verdict.kind == "sync" and data.verdict.line.text == "" and data.verdict.line.lineno == 5
    assert [s.syncs for s in data.steps] == [1, 1]
    assert data.steps[0].device_busy_ms == 0.3
    (fc,) = [m for m in data.modules if m.path == "model.fc"]
    assert fc.device_ms == 0.3


def test_a_cuda_run_without_kernels_says_cupti_recorded_nothing() -> None:
    events = [e for e in step(10, 1) + step(2510, 3) if e.device_type() == CPU]
    capture = fake_recorder(events, [2500, 5000]).finish("finished")
    assert any("CUPTI" in n for n in capture.notes)
    assert summarize(capture).steps[0].device_busy_ms is None
