"""What the details panel and the search box show: plain dicts built from a graph and its hierarchy."""
from __future__ import annotations

from typing import Any, Optional

from torch_nbdebug.data.graph import GraphData, GraphNode
from torch_nbdebug.data.stats import fmt_number
from torch_nbdebug.process.graph import Hierarchy


def short_module(path: Optional[str], within: Optional[str]) -> str:
    """``model.blocks.3.attn`` shown inside ``model.blocks.3`` reads ``attn``."""
    if not path:
        return ""
    if within and path.startswith(within + "."):
        return path[len(within) + 1:]
    return path


def group_label(hier: Hierarchy, gid: str) -> str:
    """A group's name relative to the module around it, with its repetition: ``blocks.0..11 ×12 Block``."""
    g = hier.groups[gid]
    if g.kind in ("chunk", "repeat"):  # a run group's label is its repetition: ``layer0..11 ×12 Block``
        return g.label
    outer = _enclosing_module(hier, g.parent)
    name = short_module(g.path, outer)
    return f"{name}.{g.repeat}" if g.repeat else name


def _enclosing_module(hier: Hierarchy, gid: str) -> Optional[str]:
    while gid and gid in hier.groups:
        if hier.groups[gid].kind == "module":
            return hier.groups[gid].path
        gid = hier.groups[gid].parent
    return None


def node_label(hier: Hierarchy, node: GraphNode) -> str:
    """Ops by op name; parameters by their name inside the module around them."""
    if node.kind != "param":
        return node.label
    outer = _enclosing_module(hier, hier.parent.get(node.id, ""))
    return short_module(node.label, outer) if outer else node.label


def shape_text(shape: Optional[tuple[int, ...]], dtype: Optional[str]) -> str:
    if shape is None:
        return dtype or ""
    return f"[{', '.join(str(s) for s in shape)}] {dtype or ''}".rstrip()


def details(data: GraphData, hier: Hierarchy, item: str) -> dict[str, Any]:
    """Everything the panel shows about a node or a group."""
    if item in hier.groups:
        return _group_details(data, hier, item)
    node = data.node(item)
    out: dict[str, Any] = {
        "id": node.id, "kind": node.kind, "label": node.label, "op": node.op,
        "shape": shape_text(node.shape, node.dtype), "module": node.module or "",
        "outputs": [shape_text(s, d) for s, d in node.outputs],
        "saved": [s.brief() for s in node.saved], "seq": node.seq,
        "grad": node.grad.brief() if node.grad else "", "nan": _nan_from(data) if node.nan else "",
        "aliases": [a for a in node.aliases if a != node.label],  # a tied weight's other names
    }
    preds = [e.src for e in data.edges if e.dst == item]
    succs = [e.dst for e in data.edges if e.src == item]
    out["inputs"] = [data.node(p).label for p in preds[:20]]
    out["users"] = [data.node(s).label for s in succs[:20]]
    return out


def _group_details(data: GraphData, hier: Hierarchy, gid: str) -> dict[str, Any]:
    g = hier.groups[gid]
    inside = _nodes_inside(hier, gid)
    params = [data.node(n) for n in inside if data.node(n).kind == "param"]
    numel = 0
    for p in params:
        count = 1
        for s in p.shape or ():
            count *= s
        numel += count
    norms = [p.grad.norm for p in params if p.grad is not None]
    return {
        "id": gid, "kind": "group", "label": g.label, "module": g.path or "", "type": g.type_name,
        "repeat": g.repeat or "", "size": g.size, "params": len(params), "numel": numel,
        "grad": f"‖grad‖={fmt_number(sum(n * n for n in norms) ** 0.5)} over {len(norms)} parameters" if norms else "",
        "nan": _nan_from(data) if any(data.node(n).nan for n in inside) else "",
    }


def _nan_from(data: GraphData) -> str:
    """Where a marked birth was found, for the panel: ``from %%nanwatch, In [4]``."""
    return f"from {data.nan_from or '%%nanwatch'}"


def _nodes_inside(hier: Hierarchy, gid: str) -> list[str]:
    out = []
    stack = list(hier.items.get(gid, ()))
    while stack:
        item = stack.pop()
        if item in hier.groups:
            stack.extend(hier.items[item])
        else:
            out.append(item)
    return out


def search(data: GraphData, hier: Hierarchy, text: str, limit: int = 20) -> list[dict[str, str]]:
    """Nodes and modules matching ``text``: ``[{id, label, where}]``, modules first."""
    needle = text.strip().lower()
    if not needle:
        return []
    found = [{"id": gid, "label": g.path or g.label, "where": g.type_name or g.kind}
             for gid, g in hier.groups.items() if g.kind == "module" and needle in (g.path or "").lower()]
    for node in data.find(text, limit):
        found.append({"id": node.id, "label": node.label, "where": node.module or node.kind})
    return found[:limit]
