"""Both op-mode watches for the scenario tests: replay (the default: the per-op watch off inside a
model's forward, a non-finite module call replayed under it) and the always-on per-op watch
(``replay=False`` / ``--no-replay``). A test module imports ``watch_kind``; every test in it then runs
under both, with the same assertions: the report must be the same."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from torch_nbdebug.api import nanwatch as nanwatch_api
from torch_nbdebug.api.nanwatch import nanwatch


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


def both(make: Callable[[], Any], body: Callable[[Any], None], seed: int = 0, grad: bool = True) -> tuple[Any, Any]:
    """The same code under the always-on watch and under replay, each on a fresh model made after
    ``torch.manual_seed(seed)``; ``grad=False``: the watch and the code run under ``no_grad``."""
    reports = []
    for replay in (False, True):
        torch.manual_seed(seed)
        model = make()
        with torch.set_grad_enabled(grad), nanwatch(replay=replay, namespace={"model": model}) as report:
            body(model)
        reports.append(report)
    return reports[0], reports[1]
