"""The CUDA path's bookkeeping, checked on any machine with the allocator calls replaced by fakes."""
from __future__ import annotations

from typing import Any

import pytest
import torch

import torch_nbdebug.record.memory.cuda as memory_cuda
from torch_nbdebug.api.memory import memory_timeline, resolve_device


class FakeAllocator:
    """Stands in for torch.cuda's history switches; records every call in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, enabled: bool, snapshot: dict[str, Any]) -> None:
        self.enabled = enabled
        self.calls: list[tuple[Any, ...]] = []
        self.snapshot = snapshot
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
        monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: self.enabled, raising=False)
        monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", self.record)
        monkeypatch.setattr(torch.cuda.memory, "_snapshot", self.take)

    def record(self, enabled: Any = "all", **kwargs: Any) -> None:
        self.calls.append(("record", enabled, kwargs.get("clear_history", False)))
        self.enabled = enabled is not None

    def take(self, *a: Any) -> dict[str, Any]:
        self.calls.append(("snapshot",))
        return self.snapshot


def snapshot() -> dict[str, Any]:
    trace = [{"action": "segment_alloc", "addr": 0, "size": 1 << 21, "time_us": 1},
             {"action": "alloc", "addr": 0, "size": 1024, "time_us": 2, "frames": []},
             {"action": "free_completed", "addr": 0, "size": 1024, "time_us": 3, "frames": []}]
    return {"segments": [{"device": 0, "address": 0, "total_size": 1 << 21, "blocks": []}],
            "device_traces": [trace]}


def test_history_turned_on_then_off_and_cleared(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeAllocator(monkeypatch, enabled=False, snapshot=snapshot())
    with memory_timeline({}, device="cuda") as tl:
        pass
    assert fake.calls == [("record", "all", True), ("snapshot",), ("record", None, True)]
    assert not fake.enabled
    assert tl.device == "cuda:0" and tl.peak_bytes == 1024 and tl.final_bytes == 0
    assert tl.reserved.tolist() == [0, 1 << 21, 1 << 21]
    assert tl.snapshot is fake.snapshot  # --export writes the allocator's own snapshot


def test_users_history_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeAllocator(monkeypatch, enabled=True, snapshot=snapshot())
    with memory_timeline({}, device="cuda"):
        pass
    assert fake.calls == [("snapshot",)] and fake.enabled


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_history_restored_when_the_block_fails(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    fake = FakeAllocator(monkeypatch, enabled=False, snapshot=snapshot())
    with pytest.raises(type(error)):
        with memory_timeline({}, device="cuda"):
            raise error
    assert fake.calls[-1] == ("record", None, True) and not fake.enabled


def test_resolve_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolve_device(None) == ("cuda", 0, "")
    assert resolve_device("cuda:1") == ("cuda", 1, "")
    assert resolve_device("CPU") == ("cpu", 0, "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("cuda")[0] == "cpu" and "no CUDA device" in resolve_device("cuda")[2]
    assert memory_cuda.history_enabled() is False


def test_lines_come_from_the_allocator_stacks_when_we_record_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Our history records Python stacks: the recorder walks no stack per allocation, the line still shows.
    A history the user turned on may have none: then the recorder names lines itself."""
    from torch_nbdebug.record.memory import MemoryRecorder

    frames = [{"filename": torch.__file__, "line": 3, "name": "inner"},
              {"filename": "<cell>", "line": 7, "name": "<module>"}]
    trace = snapshot()
    trace["device_traces"][0][1]["frames"] = frames
    fake = FakeAllocator(monkeypatch, enabled=False, snapshot=trace)
    walks: list[bool] = []
    original = MemoryRecorder.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        walks.append(kwargs["record_lines"])
        original(self, *args, **kwargs)

    monkeypatch.setattr(MemoryRecorder, "__init__", init)
    with memory_timeline({}, device="cuda") as tl:
        pass
    line = tl.allocations[0].line
    assert line is not None and (line.filename, line.lineno) == ("<cell>", 7)
    fake.enabled = True
    with memory_timeline({}, device="cuda"):
        pass
    with memory_timeline({}, device="cuda", record_lines=False):
        pass
    assert walks == [False, True, False]
