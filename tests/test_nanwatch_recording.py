"""``NanRecorder.stop()`` hands over one frozen ``NanRecording``, which is all ``api/nanwatch.py`` builds the
report from; whether a watch replays is decided by one function (``uses_replay``)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from torch_nbdebug.record.nanwatch import NanRecorder, NanRecording, uses_replay


def test_stop_returns_a_frozen_recording_of_what_was_seen() -> None:
    model = torch.nn.Linear(3, 3)
    rec = NanRecorder({"model": model}, replay=True)
    rec.start()
    try:
        out = model(torch.ones(2, 3))
        (out / torch.zeros(())).log()  # inf/0-division: born in code outside modules
    finally:
        recording = rec.stop()
    assert isinstance(recording, NanRecording)
    assert recording.options.replay and recording.saw_torch and recording.ops_seen > 0
    assert [e.op for e in recording.events][:1] == ["aten.div.Tensor"]
    assert [row.module for row in recording.layers] == ["model"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        recording.events = ()  # type: ignore[misc]
    assert rec.recording() == recording  # asking again changes nothing


@pytest.mark.parametrize("mode,defer,raising,replays", [
    ("op", False, False, True), ("module", False, False, False), ("op", True, False, False),
    ("op", False, True, False),
])
def test_replay_is_decided_in_one_place(mode: str, defer: bool, raising: bool, replays: bool) -> None:
    assert uses_replay(True, mode, defer, raising) is replays  # type: ignore[arg-type]
    assert not uses_replay(False, mode, defer, raising)  # type: ignore[arg-type]
    rec = NanRecorder({}, mode=mode, defer=defer, raise_on_birth=raising, replay=True)  # type: ignore[arg-type]
    assert rec.options.replay is replays
