"""Group the nodes of a graph whose forward was not recorded, by the parameters they touch.

A parameter names its module (``model.blocks.3.attn.q_proj.weight`` -> ``...q_proj``). An op that
consumes a parameter (directly or through views of it such as the ``t`` of a Linear weight)
belongs to that module. Every other op (activations, residual adds, softmax) gets the common prefix
of the nearest module before it and the nearest module after it: a ReLU between ``mlp.fc1`` and
``mlp.fc2`` lands in ``mlp``, a residual add after ``blocks.3.mlp`` stays in ``blocks.3``. Ops with
no module after them (the loss) stay outside every module.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

from torch_nbdebug.data.graph import GraphData, GraphNode, ModuleInfo


# Ops that only reshape or cast what they get: a parameter passed through them is still "the weight".
_VIEWS = frozenset({"t", "view", "unsafe_view", "reshape", "expand", "transpose", "permute", "unsqueeze",
                    "squeeze", "select", "slice", "alias", "as_strided", "to_copy", "clone", "unbind", "split"})


def common_prefix(a: Optional[str], b: Optional[str]) -> Optional[str]:
    """The longest shared dotted prefix: ``m.a.b``, ``m.a.c`` -> ``m.a``; None when nothing is shared."""
    if a is None or b is None:
        return a if b is None else b
    parts = []
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        parts.append(x)
    return ".".join(parts) or None


def _prefix_all(paths: list[Optional[str]]) -> Optional[str]:
    known = [p for p in paths if p]
    if not known:
        return None
    out: Optional[str] = known[0]
    for p in known[1:]:
        out = common_prefix(out, p)
        if out is None:
            return None
    return out


def _between(up: Optional[str], down: Optional[str]) -> Optional[str]:
    """The module of an op between two known ones: their common prefix, except that an op between
    numbered siblings (``h.3.mlp`` -> ``h.4.ln_1``: the residual add) stays in the earlier one."""
    common = common_prefix(up, down)
    if up and common and up != common:
        rest = up[len(common) + 1:].split(".")
        for k, step in enumerate(rest):
            if step.isdigit():  # stay inside the numbered sibling the data came from
                return ".".join([common, *rest[:k + 1]])
    return common


def infer_modules(data: GraphData) -> GraphData:
    """Fill in the module of nodes that have none, from the parameters around them."""
    if not any(n.kind == "param" and n.module for n in data.nodes):
        return data  # no named parameter: nothing to infer from
    nodes = sorted(data.nodes, key=lambda n: n.topo)
    preds: dict[str, list[str]] = {n.id: [] for n in nodes}
    succs: dict[str, list[str]] = {n.id: [] for n in nodes}
    for e in data.edges:
        preds[e.dst].append(e.src)
        succs[e.src].append(e.dst)
    by_id = {n.id: n for n in nodes}
    direct = _direct_modules(nodes, preds, by_id)
    up: dict[str, Optional[str]] = {}
    for n in nodes:  # forward order: nearest module before
        prev = [up[p] for p in sorted(preds[n.id], key=lambda p: -by_id[p].topo) if up.get(p)]
        up[n.id] = direct.get(n.id) or (prev[0] if prev else None)
    down: dict[str, Optional[str]] = {}
    for n in reversed(nodes):  # backward order: nearest module after
        nxt = [down[s] for s in sorted(succs[n.id], key=lambda s: by_id[s].topo) if down.get(s)]
        down[n.id] = direct.get(n.id) or (nxt[0] if nxt else None)
    out = []
    for n in data.nodes:
        if n.module is None and n.kind == "op":
            # Only between two known modules: an op after the last one (the loss) or before the
            # first one (input preparation) is most often outside the model, so it stays unassigned.
            module = direct.get(n.id) or (_between(up[n.id], down[n.id]) if up[n.id] and down[n.id] else None)
            if module:
                n = replace(n, module=module)
        out.append(n)
    notes = data.notes
    if any(n.module for n in out if n.kind == "op"):
        notes = notes + ("modules inferred from the parameters each op touches; run the forward under "
                         "%%graph (or graph(model, inputs)) for exact modules",)
    return replace(data, nodes=tuple(out), notes=notes, source="inferred")


def _direct_modules(nodes: list[GraphNode], preds: dict[str, list[str]],
                    by_id: dict[str, GraphNode]) -> dict[str, str]:
    """Modules of params, parameter-only ops and the ops that consume them."""
    param_only: dict[str, Optional[str]] = {}
    direct: dict[str, str] = {}
    tied = _tied_uses(nodes, preds, by_id)
    for n in nodes:
        if n.kind == "param":
            param_only[n.id] = n.module
        elif n.kind == "op" and n.label in _VIEWS and len(preds[n.id]) == 1 and preds[n.id][0] in param_only:
            # a view of one parameter (``t``, ``expand``); an op mixing several is real compute
            # (``wte(idx) + wpe(pos)`` depends on parameters only, yet is the model's first activation)
            param_only[n.id] = tied.get((preds[n.id][0], n.id), param_only[preds[n.id][0]])
        if n.kind != "op":
            continue
        if n.module:
            direct[n.id] = n.module
            continue
        # Parameters it reads directly win over parameter-only ops (``t`` of a weight): the first
        # Linear of a model whose input needs no grad is itself parameter-only.
        params = [tied.get((p, n.id), param_only[p]) for p in preds[n.id] if by_id[p].kind == "param"]
        module = _prefix_all(params) or _prefix_all([param_only[p] for p in preds[n.id] if p in param_only])
        if module:
            direct[n.id] = module
    return direct


def _tied_uses(nodes: list[GraphNode], preds: dict[str, list[str]],
               by_id: dict[str, GraphNode]) -> dict[tuple[str, str], str]:
    """``(parameter id, op id) -> module`` for each use of a tied parameter (one weight, several names).

    GPT-2's ``wte.weight`` is also ``lm_head.weight``: the embedding lookup belongs to ``wte`` and the
    output projection to ``lm_head``. Uses in forward order take the names in the order the model
    declares them (the order ``named_parameters`` lists them); a view of the weight (``t``) counts
    where the op that consumes it is.
    """
    succs: dict[str, list[str]] = {}
    for n in nodes:
        for p in preds[n.id]:
            succs.setdefault(p, []).append(n.id)
    out: dict[tuple[str, str], str] = {}
    for n in nodes:
        owners = [a.rpartition(".")[0] for a in n.aliases if "." in a]
        uses = succs.get(n.id, [])
        if n.kind != "param" or len(set(owners)) < 2 or len(uses) < 2:
            continue
        uses = sorted(uses, key=lambda u: _use_position(u, succs, by_id))
        for k, use in enumerate(uses):
            out[(n.id, use)] = owners[round(k * (len(owners) - 1) / (len(uses) - 1))]
    return out


def _use_position(op: str, succs: dict[str, list[str]], by_id: dict[str, GraphNode]) -> int:
    """Forward position of a use of a weight: through its views, the op that computes with it."""
    cur = op
    while by_id[cur].label in _VIEWS and succs.get(cur):
        cur = min(succs[cur], key=lambda s: by_id[s].topo)
    return by_id[cur].topo


def used_modules(data: GraphData) -> GraphData:
    """Keep only the modules some node belongs to, plus their ancestors (with classes where known)."""
    types = {m.path: m.type_name for m in data.modules}
    paths: set[str] = set()
    for n in data.nodes:
        path = n.module
        while path and path not in paths:
            paths.add(path)
            path = path.rpartition(".")[0]
    infos = tuple(ModuleInfo(p, types.get(p, ""), p.rpartition(".")[0] or None) for p in sorted(paths))
    return replace(data, modules=infos)
