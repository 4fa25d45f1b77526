"""Across ranks: which rank a NaN was born on first, who sent it into which collective and who only
received it, which ranks are missing from a collective (a hang) or died, and memory per rank.

Everything here reads the plain documents of :mod:`torch_nbdebug.data.ranks`; nothing talks to another
process. "First" is by (step, phase, op order within the step), never by wall-clock time: ranks run the
same program, so the autograd sequence number of an op (or the birth's place in its rank's list) orders it.
"""
from __future__ import annotations

from typing import Any, Optional

PHASE_ORDER = {"input": 0, "forward": 0, "backward": 1, "optimizer": 2}
UNEVEN = ("rank {rank} had finished: it ran fewer collectives than the others (uneven batches per rank are the "
          "usual cause: wrap the training loop in `with model.join():` (DDP.join) or give every rank the same "
          "number of batches, e.g. DistributedSampler(drop_last=True))")
ONE_RANK = ("rank {rank} was in {where}: a collective called by some ranks only (a collective under "
            "`if rank == 0:`, e.g. a metric all_reduce or a barrier inside logging code) makes the others wait "
            "in a different one; every rank must call the same collectives in the same order")
BEHIND = ("rank {rank} had not reached it ({where}): it is slower, or stuck outside torch.distributed (its "
          "stack below says where)")


def birth_key(birth: dict[str, Any], rank: int) -> tuple[Any, ...]:
    event = birth["event"]
    seq = event.get("sequence_nr")
    return (birth["step"], PHASE_ORDER.get(event.get("phase"), 3),
            -seq if seq is not None and event.get("phase") == "backward" else 0, birth["order"], rank)


def findings(doc: dict[str, Any]) -> dict[str, Any]:
    """What the ranks of ``doc`` say together (see :mod:`torch_nbdebug.data.ranks` for the document)."""
    ranks = doc["ranks"]
    world = doc.get("world_size", len(ranks))
    sent = _sent(ranks, world)
    received = {r: s for s in sent for r in s["receivers"]}
    births = []
    for part in ranks:
        first_received = received.get(part["rank"])
        for birth in part.get("births") or ():
            if first_received is not None and birth["step"] >= first_received["step"]:
                continue  # its NaN came in through a collective: a receiver, not a birth
            births.append((birth_key(birth, part["rank"]), part["rank"], birth))
    births.sort(key=lambda b: b[0])
    first = None
    if births:
        _, rank, birth = births[0]
        first = {"rank": rank, "step": birth["step"], "event": birth["event"]}
    receivers = sorted({r for s in sent for r in s["receivers"]} - {s["rank"] for s in sent})
    return {"world_size": world, "first": first, "sent": sent, "receivers": receivers,
            "died": _died(ranks, world), "hang": _hang(ranks, world), "memory": _memory(ranks)}


def _sent(ranks: list[dict[str, Any]], world: int) -> list[dict[str, Any]]:
    """Each collective a rank sent non-finite values into, with the ranks that received them (everyone
    else in it: all_reduce, all_gather and broadcast give every rank the result)."""
    by_rank = {p["rank"]: p for p in ranks}
    out = []
    for part in ranks:
        for entry in part.get("sent") or ():
            senders = sorted(r for r, p in by_rank.items()
                             if any(e["seq"] == entry["seq"] and e["sent_nonfinite"] for e in p.get("sent") or ()))
            if senders[0] != part["rank"]:
                continue  # listed once, under its lowest sender
            out.append(dict(entry, rank=part["rank"], senders=senders,
                            receivers=[r for r in range(world) if r not in senders]))
    out.sort(key=lambda s: (s["step"], s["seq"]))
    # a rank that sent or received non-finite values before only passes them on: keep where they came from
    origins: list[dict[str, Any]] = []
    seen: set[int] = set()
    for s in out:
        if any(r not in seen for r in s["senders"]):
            origins.append(s)
        seen.update(s["senders"], s["receivers"])
    return origins


def _died(ranks: list[dict[str, Any]], world: int) -> list[dict[str, Any]]:
    have = {p["rank"] for p in ranks}
    died = [{"rank": r, "why": "it wrote no rank file (it died before its first write, or ran elsewhere)"}
            for r in range(world) if r not in have]
    for part in ranks:
        if part["status"] == "running":
            last = (part.get("collectives") or [None])[-1]
            where = (f"its last write was before collective #{last['seq']} ({last['op']}) at step {last['step']}"
                     if last else f"its last write was at step {part.get('steps', 0)}")
            died.append({"rank": part["rank"], "why": f"no report; {where}"})
        elif part["status"] == "terminated":
            died.append({"rank": part["rank"], "why": part.get("error") or "it was terminated by a signal"})
    return sorted(died, key=lambda d: d["rank"])


def _hang(ranks: list[dict[str, Any]], world: int) -> Optional[dict[str, Any]]:
    """Which ranks wait in which collective, which are missing from it, and the usual reason."""
    waiting = [p for p in ranks if p.get("hang")]
    if not waiting:  # a collective that failed (gloo's timeout, a peer that went away) is a wait that ended
        waiting = [dict(p, hang=p["collectives"][-1]) for p in ranks
                   if p["status"] == "raised" and p.get("collectives") and _from_distributed(p.get("error") or "")]
    if not waiting:
        return None
    hang = min((p["hang"] for p in waiting), key=lambda h: h["seq"])
    seq, op = hang["seq"], hang["op"]
    in_it = sorted(p["rank"] for p in waiting if p["hang"]["seq"] == seq and p["hang"]["op"] == op)
    missing = []
    by_rank = {p["rank"]: p for p in ranks}
    for r in range(world):
        if r in in_it:
            continue
        part = by_rank.get(r)
        if part is None:
            missing.append({"rank": r, "why": "it wrote no rank file"})
            continue
        other = part.get("hang")
        if other is not None:
            where = f"collective #{other['seq']} ({other['op']}, line {other.get('line')})"
            missing.append({"rank": r, "why": ONE_RANK.format(rank=r, where=where)})
        elif part["status"] in ("finished", "raised"):
            missing.append({"rank": r, "why": UNEVEN.format(rank=r)})
        else:
            done = part.get("collectives_total", 0)
            missing.append({"rank": r, "why": BEHIND.format(rank=r, where=f"{done} collectives done, "
                                                                     f"status {part['status']}")})
    return {"seq": seq, "op": op, "step": hang["step"], "bucket": hang.get("bucket"), "file": hang.get("file"),
            "line": hang.get("line"),
            "shapes": hang.get("shapes"), "waited_s": hang.get("waited_s"), "waiting": in_it, "missing": missing,
            "flight_recorder": hang.get("flight_recorder")}


def _from_distributed(error: str) -> bool:
    return any(word in error for word in ("gloo", "NCCL", "nccl", "Connection", "Timed out", "DistBackendError"))


def _memory(ranks: list[dict[str, Any]]) -> Optional[dict[str, Any]]:
    peaks = {p["rank"]: p["report"]["peak_bytes"] for p in ranks
             if isinstance(p.get("report"), dict) and "peak_bytes" in p["report"]}
    if not peaks:
        return None
    high, low = max(peaks.values()), min(peaks.values())
    return {"peaks": {str(r): b for r, b in sorted(peaks.items())}, "max_rank": max(peaks, key=lambda r: peaks[r]),
            "min_rank": min(peaks, key=lambda r: peaks[r]), "imbalance_bytes": high - low,
            "imbalance_ratio": (high / low) if low else None}
