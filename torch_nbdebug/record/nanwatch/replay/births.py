"""Replay, after a backward: a backward birth of an op run inside a model's forward (no per-op watch there)
knows only its module; that forward is replayed under the per-op watch (same arguments, weights, RNG) to name
its forward op and line, as the always-on watch does."""
from __future__ import annotations

from typing import Any

import torch

from torch_nbdebug.record import compat
from torch_nbdebug.record.nanwatch.context import ReplayHost
from torch_nbdebug.record.nanwatch.core.events import Place
from torch_nbdebug.record.nanwatch.replay.forward import relocated, replay_call, user_line, why_not_replayable, \
    with_forward


def name_backward_births(host: ReplayHost) -> None:
    """Give the backward births of the model calls run since the last check their forward op and line."""
    calls = host.model_calls
    try:
        log = host.log
        events = log.events
        todo = [i for i, e in enumerate(events)
                if e.phase == "backward" and e.forward_op is None and e.sequence_nr is not None]
        for module, call, end, where in calls.calls if todo else []:
            mine = [i for i in todo if call.seq <= events[i].sequence_nr < end]  # type: ignore[operator]
            if mine and not why_not_replayable(call, module, host.own_hook_ids()):
                places = _replayed_places(host, module, call, where)
                for i in mine:
                    place = places.get(events[i].sequence_nr)  # type: ignore[arg-type]
                    if place is not None:
                        log.rewrite(i, with_forward(events[i], place))
    except Exception as exc:  # noqa: BLE001 - the module-level answer stands
        host.internal_error("the replay of a forward", exc)
    finally:
        calls.clear()


def _replayed_places(host: ReplayHost, module: torch.nn.Module, call: Any, where: Place) -> dict[int, Place]:
    """The forward places of a replayed call, by the original call's sequence numbers; the line the
    replay ran from becomes the line of the original call (``where``)."""
    log = host.log
    probe, start = user_line(), compat.next_sequence_nr()
    with host.isolated(carry=False) as (replayed, found):  # its births are known already
        replay_call(module, call, lambda: host.watched(host.clock.iteration))
    # Forward births the replay saw thrown away (where/masked_fill) are what the always-on watch
    # lists as absorbed: the backward birth's hint (the where trap) depends on them.
    for i in sorted(replayed.absorbed):
        log.add_absorbed(relocated(replayed.events[i], probe, where, call.seq - start))
    return {seq + call.seq - start: place if (place.filename, place.lineno) != probe else
            where._replace(op=place.op, module=place.module) for seq, place in found.items()}
