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
