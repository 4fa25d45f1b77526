"""Re-running a cell closes the widgets its last run displayed; nothing else is closed."""
from __future__ import annotations

from typing import Any, Optional

import pytest

from torch_nbdebug.render import bundle


class Layout:
    closed = False

    def close(self) -> None:
        self.closed = True


class Widget:
    def __init__(self) -> None:
        self.closed, self.layout = False, Layout()

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def running(monkeypatch: pytest.MonkeyPatch) -> list[Optional[tuple[str, Any]]]:
    now: list[Optional[tuple[str, Any]]] = [None]
    monkeypatch.setattr(bundle, "_running_cell", lambda: now[0])
    monkeypatch.setattr(bundle, "_SHOWN", {})
    return now


def test_a_rerun_closes_the_last_runs_widgets_and_only_those(running: list[Any]) -> None:
    first_run, other_cell, second_run = object(), object(), object()
    running[0] = ("cell-a", first_run)
    a1, a2 = Widget(), Widget()
    bundle.retire_earlier(a1)
    bundle.retire_earlier(a2)  # two views shown by one run: both kept
    running[0] = ("cell-b", other_cell)
    b1 = Widget()
    bundle.retire_earlier(b1)
    assert not any(w.closed for w in (a1, a2, b1))
    running[0] = ("cell-a", second_run)  # cell a runs again
    a3 = Widget()
    bundle.retire_earlier(a3)
    assert a1.closed and a2.closed and a1.layout.closed and a2.layout.closed
    assert not a3.closed and not b1.closed  # the new view, and another cell's, stay


def test_the_same_widget_shown_again_is_not_closed_and_no_cell_id_closes_nothing(running: list[Any]) -> None:
    w = Widget()
    running[0] = ("cell-a", 1)
    bundle.retire_earlier(w)
    running[0] = ("cell-a", 2)
    bundle.retire_earlier(w)  # an explorer keeps its widget: shown again by the re-run
    assert not w.closed
    running[0] = None  # a terminal, nbclient: no cell id, so no re-run can be told apart
    other = Widget()
    bundle.retire_earlier(other)
    bundle.retire_earlier(Widget())
    assert not other.closed and not w.closed
