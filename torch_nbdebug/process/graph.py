"""Collapse and expand: the module hierarchy of a graph, and what a view with some groups open shows.

Groups are the modules on the nodes' paths plus, where a container would hold too many items to
read, chunks of consecutive items (``model.0..124 ×125 Linear``, ``ops 1..500``), nested as deep as
needed so that no container shows more than ``MAX_ITEMS`` things. Siblings of identical structure
(same module class tree and parameter shapes, whatever their names: ``h.0..11``, ``layer0..layer11``,
``encoder_layer_0..11``) are one repeated group: their container when they fill it, else a run group
around them. A view is the set of expanded groups: every node is shown as itself when all its groups
are open, else as its outermost closed group; edges between the shown items are merged with a count.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from torch_nbdebug.data.graph import GraphData

ROOT = ""
MAX_ITEMS = 48  # most items a container shows before its items are chunked
AUTO_BUDGET = 40  # most items the first view shows
_NUMBER = re.compile(r"^\d+$")
_TAIL = re.compile(r"^(.*?)(\d+)$")
MIN_RUN = 2  # identical sibling blocks (modules with sub-modules) folded into one run group
MIN_LEAF_RUN = 3  # identical leaf modules (``Linear``, ``Linear``, ``Linear``) folded into one run group


@dataclass(frozen=True)
class Group:
    """A module (``m:model.blocks``) or a chunk of a container's items (``c:...``)."""

    id: str
    label: str
    kind: str  # "module", "chunk", or "repeat" (a run of identical sibling modules inside a container)
    parent: str  # ROOT for top level
    path: Optional[str] = None
    type_name: str = ""
    size: int = 0  # autograd nodes (ops) inside, at any depth: the unit of the graph's summary
    repeat: Optional[str] = None  # "0..11 ×12 Block": the group is a run of identical siblings


@dataclass
class Hierarchy:
    """Groups, the items of every container, and each item's container."""

    groups: dict[str, Group]
    items: dict[str, list[str]]  # container id -> node ids and group ids, in forward order
    parent: dict[str, str]  # item id -> container id
    first: dict[str, int] = field(default_factory=dict)  # item id -> forward position (last topo inside)

    def chain(self, item: str) -> list[str]:
        """The groups containing ``item``, outermost first."""
        out = []
        cur = self.parent.get(item, ROOT)
        while cur != ROOT:
            out.append(cur)
            cur = self.parent[cur]
        out.reverse()
        return out


def module_group_id(path: str) -> str:
    return f"m:{path}"


def build_hierarchy(data: GraphData, max_items: int = MAX_ITEMS) -> Hierarchy:
    """Module groups from the nodes' module paths, chunked so no container exceeds ``max_items``."""
    types = {m.path: m.type_name for m in data.modules}
    groups: dict[str, Group] = {}
    parent: dict[str, str] = {}
    first: dict[str, int] = {}
    for node in data.nodes:
        _add_module(node.module, groups, parent, types)
        parent[node.id] = module_group_id(node.module) if node.module else ROOT
        first[node.id] = node.topo
    items: dict[str, list[str]] = {ROOT: []}
    for gid in groups:
        items[gid] = []
    for item, container in parent.items():
        items[container].append(item)
    _fill_first(groups, parent, first)
    for container in list(items):
        items[container].sort(key=lambda i: first.get(i, 0))
    hier = Hierarchy(groups, items, parent, first)
    shapes = structures(data, hier)
    repeats: dict[str, str] = {}
    for container in list(items):
        repeats.update(_fold_runs(hier, container, shapes))
    for container in list(hier.items):
        _chunk(hier, container, max_items)
    sizes = _sizes(data, hier.parent)
    for gid, g in list(hier.groups.items()):
        hier.groups[gid] = Group(g.id, g.label, g.kind, hier.parent[gid], g.path, g.type_name, sizes.get(gid, 0),
                                 repeats.get(gid))
    return hier


Structure = tuple[str, tuple[tuple[str, tuple[int, ...]], ...], tuple["Structure", ...]]


def structures(data: GraphData, hier: Hierarchy) -> dict[str, Structure]:
    """Each module group's structure: its class, its own parameters' shapes (by name inside the module)
    and its sub-modules' structures in forward order. Names of the modules themselves do not count, so
    ``layer0`` and ``layer1`` match when they hold the same layers, and ResNet's ``layer1`` and
    ``layer2`` differ by their channel counts."""
    params: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for node in data.nodes:
        owner = hier.parent.get(node.id, ROOT)
        while owner in hier.groups and hier.groups[owner].kind != "module":  # a chunk of a module's items
            owner = hier.parent[owner]
        if node.kind == "param" and owner in hier.groups:
            params.setdefault(owner, []).append((node.label.rpartition(".")[2], tuple(node.shape or ())))
    out: dict[str, Structure] = {}

    def of(gid: str) -> Structure:  # modules nest a few levels deep: recursion is fine here
        if gid not in out:
            subs = tuple(of(m) for m in _modules_in(hier, gid))
            out[gid] = (hier.groups[gid].type_name, tuple(sorted(params.get(gid, ()))), subs)
        return out[gid]

    for gid, g in hier.groups.items():
        if g.kind == "module":
            of(gid)
    return out


def _modules_in(hier: Hierarchy, gid: str) -> list[str]:
    """The sub-modules of a group in forward order, looking through chunk and run groups."""
    found: list[str] = []
    for item in hier.items.get(gid, ()):
        group = hier.groups.get(item)
        if group is not None:
            found.extend([item] if group.kind == "module" else _modules_in(hier, item))
    return found


def _fold_runs(hier: Hierarchy, container: str, shapes: dict[str, Structure]) -> dict[str, str]:
    """Mark a container whose items are all one repeated structure, or wrap each run of identical
    sibling modules in a run group. Returns ``{group id: "0..11 ×12 Block"}``."""
    members = hier.items[container]
    runs = [run for run in _runs(members, shapes) if len(run) >= (MIN_RUN if shapes[run[0]][2] else MIN_LEAF_RUN)]
    if container != ROOT and len(runs) == 1 and len(runs[0]) == len(members):
        return {container: _repeat_label([hier.groups[m] for m in members])}
    out: dict[str, str] = {}
    for run in runs:
        mods = [hier.groups[m] for m in run]
        rid = f"r:{container}:{run[0]}"
        label = _repeat_label(mods)
        hier.groups[rid] = Group(rid, label, "repeat", container, None, mods[0].type_name)
        hier.items[rid] = list(run)
        hier.first[rid] = max(hier.first.get(m, 0) for m in run)
        hier.parent[rid] = container
        for m in run:
            hier.parent[m] = rid
        at = members.index(run[0])
        members[at:at + len(run)] = [rid]
        out[rid] = label
    return out


def _runs(members: list[str], shapes: dict[str, Structure]) -> list[list[str]]:
    """Maximal runs (two or more) of consecutive module items of one structure."""
    runs: list[list[str]] = []
    cur: list[str] = []
    for item in members + [""]:
        if cur and item in shapes and shapes[item] == shapes[cur[0]]:
            cur.append(item)
            continue
        if len(cur) >= 2:
            runs.append(cur)
        cur = [item] if item in shapes else []
    return runs


def _repeat_label(mods: list[Group]) -> str:
    """``0..11 ×12 Block``; ``layer0..11``, ``encoder_layer_0..11`` for named siblings of one stem."""
    names = [(m.path or m.label).rpartition(".")[2] for m in mods]
    first, last = names[0], names[-1]
    a, b = _TAIL.match(first), _TAIL.match(last)
    if a and b and a.group(1) == b.group(1):
        last = b.group(2)
    return f"{first}..{last} ×{len(mods)} {mods[0].type_name}".rstrip()


def _add_module(path: Optional[str], groups: dict[str, Group], parent: dict[str, str], types: dict[str, str]) -> None:
    while path and module_group_id(path) not in groups:
        up = path.rpartition(".")[0]
        gid = module_group_id(path)
        groups[gid] = Group(gid, path, "module", module_group_id(up) if up else ROOT, path, types.get(path, ""))
        parent[gid] = groups[gid].parent
        path = up


def _fill_first(groups: dict[str, Group], parent: dict[str, str], first: dict[str, int]) -> None:
    """A group sorts where its last node is in forward order.

    Not its first: a post-order walk from the output finishes leaves such as a late block's weights
    early, while a block's last op always comes after every op of the blocks before it.
    """
    for item in list(first):
        topo = first[item]
        cur = parent.get(item, ROOT)
        while cur != ROOT and first.get(cur, -1) < topo:
            first[cur] = topo
            cur = parent[cur]
    for gid in groups:
        first.setdefault(gid, 0)


def _sizes(data: GraphData, parent: dict[str, str]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for node in data.ops():
        cur = parent.get(node.id, ROOT)
        while cur != ROOT:
            sizes[cur] = sizes.get(cur, 0) + 1
            cur = parent[cur]
    return sizes


def _chunk(hier: Hierarchy, container: str, max_items: int) -> None:
    """Split an over-full container into nested chunks of consecutive items."""
    members = hier.items[container]
    if len(members) <= max_items:
        return
    per = max_items
    while -(-len(members) // per) > max_items:
        per *= max_items
    chunks = [members[i:i + per] for i in range(0, len(members), per)]
    new_items = []
    for k, chunk in enumerate(chunks):
        cid = f"c:{container}:{k}"
        hier.groups[cid] = Group(cid, _chunk_label(hier, chunk), "chunk", container)
        hier.items[cid] = chunk
        hier.first[cid] = max(hier.first.get(i, 0) for i in chunk)
        for item in chunk:
            hier.parent[item] = cid
        hier.parent[cid] = container
        new_items.append(cid)
        _chunk(hier, cid, max_items)
    hier.items[container] = new_items


def _chunk_label(hier: Hierarchy, chunk: list[str]) -> str:
    mods = [hier.groups[i] for i in chunk if i in hier.groups and hier.groups[i].kind == "module"]
    if len(mods) == len(chunk):
        return _run_label(mods) or f"{mods[0].label} … {mods[-1].label}"
    return f"{len(chunk)} items"


def _run_label(mods: list[Group]) -> Optional[str]:
    """``model.blocks.0..11`` when the modules are numbered siblings."""
    names = [m.path.rpartition(".")[2] for m in mods if m.path]
    if len(names) != len(mods) or not all(_NUMBER.match(n) for n in names):
        return None
    stem = mods[0].path.rpartition(".")[0] if mods[0].path else ""
    return f"{stem + '.' if stem else ''}{names[0]}..{names[-1]}"


def auto_expand(hier: Hierarchy, budget: int = AUTO_BUDGET,
                fits: Optional[Callable[[frozenset[str]], bool]] = None) -> frozenset[str]:
    """Open groups breadth-first while the view stays under ``budget`` items (and, given ``fits``,
    while the view still fits the screen at a readable zoom: a model's loss opens on its module
    overview rather than on a long column whose first screen is the last few nodes).

    A repeated group (``blocks.0..3 ×4 Block``) stays closed: it reads best as one box, and opening
    it is one click. It opens only when it would be the one thing shown. With ``fits``, groups holding
    sub-modules open first (the model's structure), then leaf modules (their ops) while there is room.
    """
    expanded: set[str] = set()
    shown = len(hier.items[ROOT])
    for structure_only in ((True, False) if fits is not None else (False,)):
        queue = [i for i in hier.items[ROOT] if i in hier.groups]
        while queue:
            gid = queue.pop(0)
            if gid in expanded:
                queue.extend(i for i in hier.items[gid] if i in hier.groups)
                continue
            cost = len(hier.items[gid]) - 1
            if shown + cost > budget or (hier.groups[gid].repeat and shown > 1):
                continue
            if structure_only and not (hier.groups[gid].kind == "chunk" or _modules_in(hier, gid)):
                continue
            if fits is not None and shown > 1 and not fits(frozenset(expanded | {gid})):
                continue
            expanded.add(gid)
            shown += cost
            queue.extend(i for i in hier.items[gid] if i in hier.groups)
    return frozenset(expanded)


def expand_modules(hier: Hierarchy) -> frozenset[str]:
    """The module-level view: open every group except leaf modules (those without sub-modules).

    A repeated group (``h.0..47 ×48 Block``) stays one box unless it is the only top-level item; its
    blocks are already open at module level when the user opens it.
    """
    alone = len(hier.items[ROOT]) == 1
    out = set()
    for gid, g in hier.groups.items():
        if g.repeat and not (alone and g.parent == ROOT):
            continue
        # (looking through chunks: a leaf module whose many nodes were chunked, an LSTM's steps, stays closed)
        if g.kind == "chunk" or _modules_in(hier, gid):
            out.add(gid)
    return frozenset(out)


def expand_all(hier: Hierarchy) -> frozenset[str]:
    return frozenset(hier.groups)


def toggle(expanded: Iterable[str], hier: Hierarchy, gid: str) -> frozenset[str]:
    """Open a closed group, or close an open one (and everything inside it)."""
    current = set(expanded)
    if gid not in hier.groups:
        raise KeyError(gid)
    if gid in current:
        current -= {g for g in current if g == gid or gid in hier.chain(g)}
    else:
        current.add(gid)
        current.update(hier.chain(gid))
    return frozenset(current)


def reveal(expanded: Iterable[str], hier: Hierarchy, item: str) -> frozenset[str]:
    """Open every group around ``item`` so it is shown as itself."""
    return frozenset(set(expanded) | set(hier.chain(item)))


@dataclass(frozen=True)
class ViewGraph:
    """What a view shows: items by container (open groups are containers) and merged edges."""

    expanded: frozenset[str]
    items: dict[str, list[str]]  # container (ROOT or an open group) -> shown items and open groups
    edges: dict[tuple[str, str], int]  # (shown src, shown dst) -> how many graph edges it stands for
    rep: dict[str, str]  # graph node id -> shown item id


def _closed_ancestor(hier: Hierarchy, opened: frozenset[str]) -> dict[str, Optional[str]]:
    """For every container: its outermost closed group (itself included), or None when all are open."""
    out: dict[str, Optional[str]] = {ROOT: None}
    for gid in hier.groups:
        if gid in out:
            continue
        path = []
        cur = gid
        while cur not in out:
            path.append(cur)
            cur = hier.parent[cur]
        above = out[cur]
        for g in reversed(path):
            above = above if above is not None else (None if g in opened else g)
            out[g] = above
    return out


def view(data: GraphData, hier: Hierarchy, expanded: Iterable[str]) -> ViewGraph:
    """The items and merged edges shown with the groups in ``expanded`` open."""
    opened = frozenset(g for g in expanded if g in hier.groups and all(c in expanded for c in hier.chain(g)))
    items: dict[str, list[str]] = {}
    stack = [ROOT]
    while stack:
        container = stack.pop()
        items[container] = list(hier.items[container])
        stack.extend(i for i in hier.items[container] if i in opened)
    closed = _closed_ancestor(hier, opened)
    rep = {}
    for n in data.nodes:
        container = hier.parent.get(n.id, ROOT)
        rep[n.id] = closed[container] or n.id
    edges: dict[tuple[str, str], int] = {}
    for e in data.edges:
        a, b = rep[e.src], rep[e.dst]
        if a != b:
            edges[(a, b)] = edges.get((a, b), 0) + 1
    return ViewGraph(opened, items, edges, rep)
