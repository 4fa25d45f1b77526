"""Live views (render/live.py): rate limiting, front-end detection, replacement, failure and Stop paths."""
from __future__ import annotations

import types
from typing import Any

import pytest
from IPython.core.formatters import DisplayFormatter

from torch_nbdebug.render.bundle import WIDGET_MIME
from torch_nbdebug.render.live import LiveDisplay, Progress, RateLimiter, live_frontend


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Publisher:
    """Records what a shell's display publisher is asked to publish."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def publish(self, data: Any, metadata: Any = None, *, transient: Any = None, update: bool = False,
                **kw: Any) -> None:
        self.sent.append({"data": data, "transient": transient or {}, "update": update})


def kernel_shell() -> Any:
    """An object that looks like ipykernel's shell: the class name and module live_frontend checks."""
    cls = type("ZMQInteractiveShell", (), {"__module__": "ipykernel.zmqshell"})
    shell = cls()
    shell.kernel = object()
    shell.display_pub = Publisher()
    shell.display_formatter = DisplayFormatter()
    return shell


class Report:
    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        return {"text/plain": "final report", "text/html": "<b>final report</b>"}


# -- rate limiter ---------------------------------------------------------------------------------
def test_rate_limiter_allows_one_update_per_interval() -> None:
    clock = FakeClock()
    limiter = RateLimiter(0.25, clock)
    assert not limiter.due()  # just shown: the first update waits one interval
    clock.now += 0.25
    assert limiter.due()
    assert not limiter.due()  # asked again at once: not due
    due = 0
    for _ in range(1000):  # 1000 steps over 1 second: four updates, never one per step
        clock.now += 0.001
        due += limiter.due()
    assert due == 4


def test_rate_limiter_rejects_a_non_positive_interval() -> None:
    with pytest.raises(ValueError, match="positive"):
        RateLimiter(0)


# -- front end ----------------------------------------------------------------------------------
def test_plain_ipython_and_no_ipython_have_no_live_front_end(ipython: Any) -> None:
    assert live_frontend(ipython) is None  # the terminal shell of the tests
    assert live_frontend() is None         # the running IPython is that shell too


def test_an_ipykernel_shell_is_a_live_front_end_unless_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    shell = kernel_shell()
    assert live_frontend(shell) is shell
    shell.kernel = None  # a shell object without its kernel cannot send comm messages
    assert live_frontend(shell) is None
    shell.kernel = types.SimpleNamespace(_allow_stdin=False)  # a batch run: nbclient, papermill
    assert live_frontend(shell) is None
    shell.kernel._allow_stdin = True  # JupyterLab, Notebook, VS Code
    assert live_frontend(shell) is shell
    monkeypatch.setenv("TORCH_NBDEBUG_LIVE", "0")
    assert live_frontend(shell) is None


# -- the protocol ---------------------------------------------------------------------------------
def make(shell: Any, progress: Any = None, **kw: Any) -> tuple[LiveDisplay, FakeClock, list[Any], list[int]]:
    clock, shown, calls = FakeClock(), [], []

    def default() -> Progress:
        calls.append(1)
        return Progress(status=f"call {len(calls)}", panels=[{"kind": "table", "columns": ["a"], "rows": [["x"]]}])

    display = LiveDisplay("%%test", progress or default, fallback=shown.append, shell=shell, clock=clock, **kw)
    return display, clock, shown, calls


def test_live_view_is_shown_updated_when_due_and_replaced_in_place() -> None:
    shell = kernel_shell()
    display, clock, shown, calls = make(shell)
    display.start()
    first = shell.display_pub.sent[0]
    display_id = first["transient"]["display_id"]
    assert not first["update"] and WIDGET_MIME in first["data"] and "running" in first["data"]["text/plain"]
    view = display._view
    for _ in range(50):  # 50 steps within one interval: counted, but no update pushed
        display.tick()
    assert calls == [] and view.updates == 0
    clock.now += 0.3
    display.tick()
    assert len(calls) == 1 and view.steps == 51 and view.status == "call 1" and view.updates == 1
    assert view.elapsed == pytest.approx(0.3) and view.panels[0]["rows"] == [["x"]]
    display.show(Report())
    display.close()
    assert shown == []  # replaced in place, not shown again
    last = shell.display_pub.sent[-1]
    assert len(shell.display_pub.sent) == 2 and last["update"] and last["transient"]["display_id"] == display_id
    assert last["data"]["text/plain"] == "final report"
    assert view.comm is None  # the widget's comm is closed


def test_a_live_view_without_a_final_view_is_cleared() -> None:
    shell = kernel_shell()
    display, _, _, _ = make(shell)
    with display:
        pass
    sent = shell.display_pub.sent
    assert len(sent) == 2 and sent[1]["update"] and sent[1]["data"] == {"text/plain": ""}
    assert sent[1]["transient"] == sent[0]["transient"]


def test_without_a_front_end_nothing_is_published_and_show_falls_back(ipython: Any) -> None:
    published: list[Any] = []
    display, clock, shown, calls = make(ipython)
    ipython.display_pub, saved = Publisher(), ipython.display_pub
    try:
        with display:
            for _ in range(10):
                clock.now += 1
                display.tick()
            display.show("the report")
        published = ipython.display_pub.sent
    finally:
        ipython.display_pub = saved
    assert not display.active and published == [] and calls == [] and shown == ["the report"]


def test_disabled_is_not_live_even_under_a_kernel() -> None:
    shell = kernel_shell()
    display, _, shown, _ = make(shell, enabled=False)
    with display:
        display.show("the report")
    assert shell.display_pub.sent == [] and shown == ["the report"]


def test_a_failing_progress_stops_updates_and_never_reaches_the_users_code() -> None:
    shell = kernel_shell()
    calls: list[int] = []

    def broken() -> Progress:
        calls.append(1)
        raise RuntimeError("recorder went away")

    display, clock, _, _ = make(shell, broken)
    display.start()
    view = display._view
    for _ in range(5):
        clock.now += 1
        display.tick()  # no exception
    assert calls == [1] and view.alert and "RuntimeError: recorder went away" in view.status
    display.close()


def test_a_stop_during_an_update_propagates_and_the_view_is_still_replaced() -> None:
    shell = kernel_shell()

    def stopped() -> Progress:
        raise KeyboardInterrupt

    display, clock, _, _ = make(shell, stopped)
    with pytest.raises(KeyboardInterrupt):
        with display:
            clock.now += 1
            display.tick()
    assert shell.display_pub.sent[-1]["update"] and display.error is None


def test_show_after_replacement_uses_the_fallback() -> None:
    shell = kernel_shell()
    display, _, shown, _ = make(shell)
    with display:
        display.show(Report())
        display.show("second")  # a second output (a cell value) is an ordinary display
    assert shown == ["second"] and len(shell.display_pub.sent) == 2



def test_a_widget_final_view_replaces_the_live_one_through_an_empty_output() -> None:
    """JupyterLab would re-render a widget replaced by a widget in the live view's renderer, which hides
    itself once the live widget is closed: the empty text between makes it build a fresh one."""
    shell = kernel_shell()
    display, _, _, _ = make(shell)
    final = {"text/plain": "report", WIDGET_MIME: {"model_id": "abc", "version_major": 2, "version_minor": 0}}

    class WidgetReport:
        def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
            return final

    with display:
        view = display._view
        display.show(WidgetReport())
        assert view.comm is None  # closed before the replacement
    sent = shell.display_pub.sent
    assert [s["update"] for s in sent] == [False, True, True]
    assert sent[1]["data"] == {"text/plain": ""} and sent[2]["data"] == final
    assert len({s["transient"]["display_id"] for s in sent}) == 1
