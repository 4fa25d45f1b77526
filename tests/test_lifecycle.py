"""HookScope (record/lifecycle.py): what a recorder installs is all taken off again, whatever happens."""
from __future__ import annotations

import _thread
import signal
from typing import Any

import pytest
import torch

from torch_nbdebug.record.lifecycle import HookScope
from torch_nbdebug.record.modules import global_hook_counts


class _Manager:
    def __init__(self, log: list[str], name: str, fail_exit: bool = False) -> None:
        self.log, self.name, self.fail_exit = log, name, fail_exit

    def __enter__(self) -> "_Manager":
        self.log.append(f"enter {self.name}")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.log.append(f"exit {self.name} {exc[0].__name__ if exc[0] else None}")
        if self.fail_exit:
            raise RuntimeError(f"{self.name} would not exit")


def _failing(message: str) -> Any:
    def undo() -> None:
        raise ValueError(message)
    return undo


def test_close_undoes_in_reverse_order_once() -> None:
    log: list[str] = []
    scope = HookScope()
    module = torch.nn.Linear(2, 2)

    def install(s: HookScope) -> None:
        s.enter(_Manager(log, "a"))
        s.hook(module.register_forward_hook(lambda *a: None))
        s.callback(lambda: log.append("callback"))
        s.enter(_Manager(log, "b"))

    scope.open(install)
    assert len(scope) == 4 and len(module._forward_hooks) == 1
    scope.close()
    assert log == ["enter a", "enter b", "exit b None", "callback", "exit a None"]
    assert len(module._forward_hooks) == 0 and len(scope) == 0
    scope.close()  # again: nothing left to undo
    assert len(log) == 5


def test_managers_are_exited_with_the_recordings_exception() -> None:
    log: list[str] = []
    scope = HookScope()
    scope.open(lambda s: s.enter(_Manager(log, "mode")) and None)
    scope.close(KeyError, KeyError("x"), None)
    assert log == ["enter mode", "exit mode KeyError"]


def test_a_failed_undo_is_reported_and_the_rest_still_undone() -> None:
    log: list[str] = []
    scope = HookScope()
    module = torch.nn.Linear(2, 2)

    def install(s: HookScope) -> None:
        s.hook(module.register_forward_pre_hook(lambda *a: None))
        s.callback(_failing("first undo failed"))
        s.enter(_Manager(log, "mode", fail_exit=True))

    scope.open(install)
    with pytest.raises(RuntimeError, match="mode would not exit") as raised:
        scope.close()
    assert log == ["enter mode", "exit mode None"]
    assert len(module._forward_pre_hooks) == 0 and len(scope) == 0  # undone despite two failures
    assert any("ValueError: first undo failed" in note for note in raised.value.__notes__)


def test_a_failed_install_undoes_what_was_installed_and_raises_the_install_error() -> None:
    log: list[str] = []
    scope = HookScope()

    def install(s: HookScope) -> None:
        s.enter(_Manager(log, "tracker"))
        raise OSError("cannot install")

    with pytest.raises(OSError, match="cannot install"):
        scope.open(install)
    assert log == ["enter tracker", "exit tracker None"] and len(scope) == 0


def test_a_stop_while_installing_is_raised_once_all_is_installed_and_leaves_nothing() -> None:
    before, previous = global_hook_counts(), signal.getsignal(signal.SIGINT)
    installed: list[str] = []
    scope = HookScope()
    module = torch.nn.Linear(2, 2)

    def install(s: HookScope) -> None:
        s.hook(torch.nn.modules.module.register_module_forward_hook(lambda *a: None))
        _thread.interrupt_main()  # Stop between two steps: held until the last is done
        sum(range(3))
        s.hook(module.register_forward_hook(lambda *a: None))
        installed.append("both")

    with pytest.raises(KeyboardInterrupt):
        scope.open(install)
    assert installed == ["both"]
    assert global_hook_counts() == before and len(module._forward_hooks) == 0 and len(scope) == 0
    assert signal.getsignal(signal.SIGINT) is previous


def test_a_stop_during_close_leaves_nothing_installed() -> None:
    before = global_hook_counts()
    scope = HookScope()
    module = torch.nn.Linear(2, 2)
    undone: list[str] = []

    def install(s: HookScope) -> None:
        s.hook(torch.nn.modules.module.register_module_forward_pre_hook(lambda *a: None))
        s.hook(module.register_forward_hook(lambda *a: None))
        s.callback(lambda: undone.append("last"))

        def press_stop() -> None:
            _thread.interrupt_main()  # Stop while the first undo runs
            sum(range(3))
            undone.append("first")
        s.callback(press_stop)

    scope.open(install)
    with pytest.raises(KeyboardInterrupt):
        scope.close()
    assert undone == ["first", "last"]
    assert global_hook_counts() == before and len(module._forward_hooks) == 0 and len(scope) == 0
