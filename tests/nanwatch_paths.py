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
