"""nanwatch's module tracker tells its subscribers of each call of the watching thread, in the order they
subscribed, and none of them while a replay runs (record/nanwatch/modules/tracker.py)."""
from __future__ import annotations

import threading
from typing import Any, Optional

import torch
from torch import nn

from torch_nbdebug.record.nanwatch.modules.tracker import CallWatcher, ThreadTracker, WatchThread


class _Log(CallWatcher):
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def outermost_started(self) -> None:
        self.log.append(f"{self.name} model")

    def call_started(self, args: Any) -> None:
        self.log.append(f"{self.name} started")

    def call_entered(self, path: str, module: nn.Module) -> None:
        self.log.append(f"{self.name} entered {path}")

    def call_returned(self, module: nn.Module, output: Any, path: Optional[str], outermost: bool) -> None:
        self.log.append(f"{self.name} returned {path} {outermost}")


class _EnteredOnly(CallWatcher):
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def call_entered(self, path: str, module: nn.Module) -> None:
        self.log.append(f"only entered {path}")


def test_subscribers_are_told_in_order_and_not_while_a_replay_runs() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    log: list[str] = []
    thread = WatchThread()
    tracker = ThreadTracker(thread, {"model": model})
    tracker.subscribe(_Log("a", log))
    tracker.subscribe(_EnteredOnly(log))
    tracker.subscribe(_Log("b", log))
    with tracker:
        model(torch.ones(1, 2))
        calls = list(log)
        thread.replaying = True
        model(torch.ones(1, 2))
        thread.replaying = False
    assert calls == ["a model", "b model", "a started", "b started", "a entered model", "only entered model",
                     "b entered model", "a started", "b started", "a entered model.0", "only entered model.0",
                     "b entered model.0", "a returned model.0 False", "b returned model.0 False",
                     "a returned model True", "b returned model True"]
    assert log == calls  # a replay's module calls: nobody told
    assert not tracker.stack


def test_another_threads_modules_are_not_ours_and_say_so() -> None:
    model = nn.Linear(2, 2)
    log: list[str] = []
    thread = WatchThread()
    tracker = ThreadTracker(thread, {"model": model})
    tracker.subscribe(_Log("a", log))
    with tracker:
        worker = threading.Thread(target=lambda: model(torch.ones(1, 2)))
        worker.start()
        worker.join()
    assert log == [] and thread.other_thread
