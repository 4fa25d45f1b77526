"""HookScope (record/lifecycle.py): what a recorder installs is all taken off again, whatever happens."""
from __future__ import annotations

import _thread
import signal
from typing import Any

import pytest
import torch

from torch_nbdebug.record.lifecycle import CallDispatchMode, CallFunctionMode, HookScope, TensorHooks
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


def test_tensor_hooks_are_all_removed_past_a_failure_and_pruned_when_their_tensor_is_gone() -> None:
    """The hooks a recorder puts on tensors while it runs: a long loop does not keep the dead ones' handles,
    and removing them all goes on past one that fails (each failure is handed over, none raised)."""
    class Failing:
        def hooks_dict_ref(self) -> Any:
            return self

        def remove(self) -> None:
            raise RuntimeError("cannot remove")

    hooks = TensorHooks(cap=2)
    hooks.keep(Failing())  # (removed first: the others still go)
    kept = torch.ones(2, requires_grad=True)
    hooks.keep(kept.register_hook(lambda g: g))
    for _ in range(3):  # tensors gone at once: their handles are forgotten past the cap
        hooks.keep(torch.ones(2, requires_grad=True).register_hook(lambda g: g))
    assert len(hooks._handles) == 2
    failures: list[Exception] = []
    hooks.remove_all(failures.append)
    assert [str(f) for f in failures] == ["cannot remove"]
    assert len(kept._backward_hooks or {}) == 0 and not hooks._handles


def test_call_modes_hand_each_call_to_the_recorder_and_its_result_back() -> None:
    seen: list[str] = []

    def handler(func: Any, args: Any, kwargs: dict) -> Any:
        seen.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)

    x = torch.ones(3)
    with CallFunctionMode(handler):
        y = torch.add(x, 1)
    with CallDispatchMode(handler):
        z = x * 2
    assert torch.equal(y, torch.full((3,), 2.0)) and torch.equal(z, torch.full((3,), 2.0))
    assert "add" in seen and any("mul" in name for name in seen)
