"""Both op-mode watches for the scenario tests: replay (the default: the per-op watch off inside a
model's forward, a non-finite module call replayed under it) and the always-on per-op watch
(``replay=False`` / ``--no-replay``). A test module imports ``watch_kind``; every test in it then runs
under both, with the same assertions: the report must be the same."""
from __future__ import annotations

import pytest

from torch_nbdebug.api import nanwatch as nanwatch_api


@pytest.fixture(autouse=True, params=["replay", "always-on"])
def watch_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``nanwatch()`` and ``%%nanwatch`` without ``replay=``/``--no-replay`` take this default."""
    monkeypatch.setattr(nanwatch_api, "REPLAY_DEFAULT", request.param == "replay")
    return str(request.param)


@pytest.fixture(autouse=True)
def immediate_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replay is the immediate (CPU) path's: never let a CUDA-initialised process pick the deferred one.
    A test module that imports this fixture runs every test on that path."""
    monkeypatch.setattr(nanwatch_api, "_cuda_in_use", lambda: False)


def marker_line(source: list[str], marker: str) -> int:
    """The 1-based line of ``source`` holding ``marker`` (exactly one, not counting the lines that ask for it)."""
    found = [i + 1 for i, text in enumerate(source) if marker in text and "line(" not in text]
    assert len(found) == 1, marker
    return found[0]
