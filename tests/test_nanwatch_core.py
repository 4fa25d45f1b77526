"""The core's one helper per question: a tensor held weakly with its version (``LiveRef``), whether a tensor
is finite (``ops.finite``), whether a reading ``[min, max, mean]`` is (``nonfinite_reading``)."""
from __future__ import annotations

import gc
import math

import torch

from torch_nbdebug.record.nanwatch.core import ops
from torch_nbdebug.record.nanwatch.core.layers import nonfinite_reading
from torch_nbdebug.record.nanwatch.core.live import LiveRef


def test_a_live_ref_gives_the_tensor_back_only_while_alive_and_unchanged() -> None:
    t = torch.ones(3)
    ref = LiveRef(t)
    assert ref.get() is t and ref.alive() is t
    t.mul_(2)  # written in place: the values it had are gone
    assert ref.get() is None and ref.alive() is t
    del t
    gc.collect()
    assert ref.alive() is None and ref.get() is None  # and the reference kept nothing alive


def test_a_live_ref_of_an_inference_tensor_cannot_tell_a_change() -> None:
    with torch.inference_mode():
        t = torch.ones(2)
    assert LiveRef.of(t) is None
    assert LiveRef.of(torch.ones(2)) is not None


def test_finite_confirms_an_overflowing_sum_and_skips_what_it_cannot_read() -> None:
    huge = torch.full((4,), 3e38)  # the sum overflows, every value is finite
    assert ops.finite(huge) and not ops.finite(torch.tensor([1.0, math.inf]))
    assert not ops.finite(torch.tensor([math.nan]))
    assert ops.finite(torch.empty(0)) and ops.finite(torch.tensor([1, 2])) and ops.finite(None)
    assert ops.finite(torch.empty(3, device="meta"))


def test_a_reading_is_non_finite_when_any_of_min_max_mean_is() -> None:
    assert not nonfinite_reading(None)  # not read yet
    assert not nonfinite_reading([-1.0, 2.0, 0.5])
    assert nonfinite_reading([-1.0, math.inf, math.inf]) and nonfinite_reading([0.0, 1.0, math.nan])
    assert nonfinite_reading([-math.inf, 0.0, -math.inf])
