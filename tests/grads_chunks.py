"""Test helper: count the sample chunks record_gradients allocates (their bytes are what it holds)."""
from __future__ import annotations

import weakref

import pytest

from torch_nbdebug.record.grads import steps as grads_steps


def live_chunks(monkeypatch: pytest.MonkeyPatch) -> "list[weakref.ref[grads_steps.Chunk]]":
    """Every sample chunk the recorder allocates from now on, weakly: read the live ones' bytes."""
    made: "list[weakref.ref[grads_steps.Chunk]]" = []

    class Counted(grads_steps.Chunk):
        def __init__(self, layout: grads_steps.Layout, capacity: int) -> None:
            super().__init__(layout, capacity)
            made.append(weakref.ref(self))

    monkeypatch.setattr(grads_steps, "Chunk", Counted)
    return made
