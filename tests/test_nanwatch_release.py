"""A finished watch is freed as soon as it is dropped: the helpers its hooks called point back at the recorder,
and are let go of when it stops (reference cycles waited for the garbage collector, which then ran every other
watched step of a small model). A stopped watch entered again watches again."""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from torch_nbdebug import nanwatch


@pytest.mark.parametrize("options", [{}, {"replay": False}, {"mode": "module"}, {"backward": False}])
def test_a_finished_watch_is_freed_without_the_garbage_collector(options: dict) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gc.collect()
    gc.disable()
    try:
        watch = nanwatch(namespace={"model": model, "opt": opt}, **options)
        with watch as report:
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
        recorder = weakref.ref(watch._recorder)
        del watch
        assert recorder() is None  # freed by its reference count alone
        assert report.first is None and report.layers  # the report keeps what it needs
    finally:
        gc.enable()


def test_a_stopped_watch_entered_again_watches_again() -> None:
    model = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    watch = nanwatch(namespace={"model": model})
    with watch as first:
        model(x).sum().backward()
    assert first.first is None
    with watch as again:
        out = model(x)
        (out.exp() * 1e38).sum().backward()  # overflows to inf: a birth
    assert again.first is not None
