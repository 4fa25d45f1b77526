"""A leak is one card: a variable that is also an element of another holder's container is that holder's."""
from __future__ import annotations

import torch

import torch_nbdebug


def test_a_list_kept_in_another_list_is_one_leak_and_a_forward_loop_counts_its_iterations() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    ns: dict = {"model": model}
    with torch_nbdebug.memory_timeline(ns) as timeline:
        epochs: list = []
        ns["epochs"] = epochs
        for _ in range(3):
            batch_losses: list = []
            ns["batch_losses"] = batch_losses
            epochs.append(batch_losses)
            for _ in range(4):
                loss = model(torch.randn(16, 4)).pow(2).mean()
                ns["loss"] = loss
                batch_losses.append(loss)
    assert [leak.holder for leak in timeline.leaks] == ["epochs"]  # batch_losses is epochs[2]: not a second card
    assert timeline.leaks[0].names[0].startswith("epochs[")
    assert timeline.iterations == 12  # forward only: every call of the model is an iteration (was 1)


def test_the_static_view_lists_a_leaks_allocations_first_and_marks_them() -> None:
    from torch_nbdebug.process.memory import leaks_first

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    ns: dict = {"model": model}
    with torch_nbdebug.memory_timeline(ns) as timeline:
        kept: list = []
        ns["kept"] = kept
        big = [torch.randn(256, 256) for _ in range(4)]  # larger than the leak, freed before the end
        for _ in range(3):
            kept.append(model(torch.randn(16, 32)).pow(2).mean())
        del big
    leaked = {i for leak in timeline.leaks for i in leak.allocation_ids}
    peak = timeline.peak_allocations
    assert any(a.id in leaked for a in peak) and peak[0].id not in leaked  # by size, the freed ones lead
    ordered = leaks_first(peak, timeline.leaks)
    flags = [a.id in leaked for a in ordered]
    assert flags == sorted(flags, reverse=True)  # every leaked allocation before the others
    html = timeline.html()
    table = html[html.index("Largest allocations alive at the peak"):]
    assert table.index("leak") < table.index("float32[256, 256]")
