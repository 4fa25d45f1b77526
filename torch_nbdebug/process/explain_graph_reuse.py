"""The cause and the fix for "Trying to backward through the graph a second time": the user's line that
carried a tensor into the next step, the same loss run twice, or two losses of one forward."""
from __future__ import annotations

import re
from typing import Optional

from torch_nbdebug.data.explain import FailureFacts, OpSite, Recording
from torch_nbdebug.process.explain_hints import Fields, _where, culprit_fields


def graph_reuse(m: "re.Match[str]", facts: FailureFacts, rec: Optional[Recording]) -> Fields:
    old = facts.freed_nodes[0] if facts.freed_nodes else None
    site = rec.site_of(old[1]) if rec is not None and old is not None else None
    root = f"`{facts.backward_of}`" if facts.backward_of else "the tensor"
    fix = ("Detach the tensor where it is carried over (e.g. `h = h.detach()` before the next iteration), or "
           "compute it inside the loop. `retain_graph=True` only hides this, and keeps every old graph alive.")
    if facts.freed_root and rec is not None and len(rec.backwards) == 2 and not rec.repeated_root:
        return _two_losses(rec.backwards[0], root)
    if facts.freed_root:  # ``loss.backward(); loss.backward()``: nothing was carried over
        made = f" (made by `{site.op}` at {_where(site)})" if site is not None else ""
        return {**(culprit_fields(site) if site is not None else {}),
                "summary": f"backward() ran a second time through the same graph of {root}",
                "hint": f"{root}{made} had its graph freed by the previous backward(). Call backward() once per "
                        "forward pass: compute the loss again (run the forward again) before the next backward(), "
                        "or pass `retain_graph=True` to the first backward() when two backward passes really must "
                        "share one graph (two losses on one forward)."}
    carrier = _carrier(rec, site, old[1] if old is not None else -1, facts.freed_users[0] if facts.freed_users else -1)
    if carrier is None:
        return {"summary": f"{root} reaches a graph that an earlier backward() already freed",
                "suggest_record": True,
                "hint": f"backward() ran through a graph the previous backward() freed. If it was called twice "
                        f"on the same loss, compute the loss again before the next backward() (or pass "
                        f"`retain_graph=True` to the first one when two backward passes must share a graph). "
                        f"Otherwise a tensor computed before the previous backward() (a hidden state, a running "
                        f"sum, features computed once outside the loop) is used again, so {root}'s graph runs "
                        f"into the old, freed one. {fix}"}
    carried = carried_name(carrier.line)
    held = f" (`{carried}`)" if carried else ""
    made = f" (made by `{site.op}` at {_where(site)})" if site is not None and site != carrier else ""
    if carried:
        fix = fix.replace("`h = h.detach()`", f"`{carried} = {carried}.detach()`")
    return {**culprit_fields(carrier),
            "summary": f"{root} reuses the graph of the tensor{held} carried over at {_where(carrier)}",
            "hint": f"the tensor{held} carried over at {_where(carrier)}{made} was built before the previous "
                    f"backward(), which freed its graph, and {root} depends on it again. {fix}"}


def _carrier(rec: Optional[Recording], site: Optional[OpSite], old: int, user: int) -> Optional[OpSite]:
    """The user's line that carries the old tensor into this step: the line outside every ``forward`` that
    made it, or -- when it was made before the recording began -- the one that used it in this step."""
    if rec is None:
        return None
    if site is not None:
        return rec.outer_of(old) or site
    return rec.outer_of(user) or rec.site_of(user) if user >= 0 else None


def _two_losses(first: OpSite, root: str) -> Fields:
    """``loss1.backward(); loss2.backward()`` where both losses come from one forward: the first freed it."""
    match = re.search(r"([\w.\[\]'\"]+)\s*\.backward\(", first.line)
    both = f"`({match.group(1)} + {root.strip('`')}).backward()`" if match and root.startswith("`") else \
        "one backward() of their sum"
    return {**culprit_fields(first),
            "summary": f"{root} shares its graph with the loss of the backward() at {_where(first)}, which freed it",
            "hint": f"{root} and the loss of the backward() at {_where(first)} come from the same forward pass, "
                    f"and that first backward() freed the graph they share. Sum the losses and call backward() "
                    f"once ({both}), or pass `retain_graph=True` to every backward() but the last."}


def carried_name(line: str) -> str:
    """The variable a line carries into the next iteration: one it assigns and also reads
    (``prediction, h = rnn(x, h)`` -> ``h``), else the one it assigns ('' when none)."""
    match = re.match(r"\s*([A-Za-z_][\w.]*(?:\s*,\s*[A-Za-z_][\w.]*)*)\s*(?:=|\+=|-=|\*=)(?!=)(.*)", line)
    if match is None:
        return ""
    targets = [t.strip() for t in match.group(1).split(",")]
    read = set(re.findall(r"[A-Za-z_][\w.]*", match.group(2)))
    return next((t for t in targets if t in read), targets[0] if len(targets) == 1 else "")
