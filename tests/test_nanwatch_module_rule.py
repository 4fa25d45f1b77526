"""Module mode's one rule (``modules/rule.py``) on hand-built facts: no tensors, no recorder, as ``judge``
is tested at op level. Both module-mode paths (immediate, deferred) call it."""
from __future__ import annotations

from typing import Optional

import pytest

from torch_nbdebug.data.nanwatch import NanEvent
from torch_nbdebug.record.nanwatch.core.log import EventLog
from torch_nbdebug.record.nanwatch.modules.rule import LeftAt, ModuleCall, judge_module_call


def _asked(answer: bool, asked: list[bool]):  # type: ignore[no-untyped-def]
    def params_bad() -> bool:
        asked.append(True)
        return answer
    return params_bad


@pytest.mark.parametrize("in_bad,coming_in,inner,had,params,verdict", [
    ((False,), (True,), False, False, False, "birth"),  # finite inputs and weights: the module made it
    ((False,), (True,), False, False, True, "input"),  # a non-finite weight before any birth
    ((False,), (True,), False, True, True, "propagation"),  # ... after one: an earlier birth poisoned it
    ((True,), (True,), False, False, False, "input"),  # non-finite data coming in
    ((True,), (True,), False, True, False, "propagation"),  # after a birth: it came from there
    ((True,), (False,), False, False, False, "left"),  # made by the enclosing module's own code
    ((True, False), (False, True), False, False, False, "left"),  # the bad one was made inside
    ((True, True), (False, True), False, False, False, "input"),  # one bad input did come in
    ((True,), None, False, False, False, "input"),  # no leaving asked for (replay's module-level fallback)
    ((True,), (False,), False, True, False, "propagation"),  # after a birth nothing is left
    ((True,), (False,), True, False, False, "propagation"),  # a submodule already reported
    ((False,), (True,), True, False, True, "propagation"),
])
def test_judge_module_call(in_bad: tuple, coming_in: Optional[tuple], inner: bool, had: bool, params: bool,
                           verdict: str) -> None:
    asked: list[bool] = []
    assert judge_module_call(ModuleCall(in_bad, coming_in, inner, had, _asked(params, asked))) == verdict
    # the weights are walked only when they decide: finite inputs, no submodule's report
    assert bool(asked) == (not inner and not any(in_bad) and verdict != "left")


def _event(module: str) -> NanEvent:
    return NanEvent(phase="forward", op="aten.div", kind="nan", module=module)


def test_left_at_judges_a_module_as_when_its_submodule_left_it_the_inputs() -> None:
    log, left = EventLog(max_events=10, raise_on_birth=False), LeftAt()
    assert left.seen(log, "model.attn", 0) == (False, False)
    left.leave(log, "model.attn.proj")  # the projection's bad inputs were made by model.attn's own code
    log.add(_event("model.mlp.fc"))  # a later, independent birth in a sibling
    # model.attn is judged as things were when it was left its inputs: nothing reported, no event
    assert left.seen(log, "model.attn", 0) == (False, False)
    # once asked, the mark is gone: now the sibling's event counts
    assert left.seen(log, "model.attn", 0) == (False, True)
    log.add(_event("model.attn.proj"))
    assert left.seen(log, "model.attn", 0) == (True, True)
    assert left.seen(log, "model.attn", 2) == (False, True)  # events before the check's mark are earlier births
