"""memory_timeline's cost beyond the step: no host synchronisation (counted on the CPU by wrapping the
methods that wait for the device), and the timeline still built."""
from __future__ import annotations

from host_syncs import counting_host_syncs, plain_syncs, setup, step
from torch_nbdebug.api.memory import memory_timeline


def test_memory_timeline_adds_no_host_synchronisation() -> None:
    model, opt, idx = setup()
    baseline = plain_syncs(model, opt, idx, 1)
    ns = {"model": model, "opt": opt, "idx": idx}
    with counting_host_syncs() as counted:
        with memory_timeline(ns, device="cpu") as tl:
            step(model, opt, idx)
    assert counted.count == baseline, counted.calls
    assert tl.peak_bytes > 0
