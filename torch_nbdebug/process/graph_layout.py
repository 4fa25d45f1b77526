"""A fast layered (Sugiyama-style) layout in pure Python: no Graphviz needed.

Each open group is laid out on its own, bottom-up, and then placed in its parent's layout as one big
box: so groups never overlap and every container is a small graph (``MAX_ITEMS`` at most until the
user opens more). Per container: break cycles (collapsing can make them), rank by longest path,
order each rank by barycentres of its neighbours for a few sweeps (crossing reduction), then place
x at the mean of the neighbours without overlaps. Edges are drawn between the shown items' absolute
positions, and never through an open group's title: the band under a title is left free, and an
edge that would enter straight through the title's text comes in to the right of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from torch_nbdebug.process.graph import ROOT, ViewGraph

GAP_X = 18.0
GAP_Y = 30.0
PAD = 12.0
TITLE = 22.0  # the title's band at the top of an open group (the renderer writes it at y + 15)
HEAD = TITLE + 14.0  # title plus a free band where edges entering the group bend towards their item
SWEEPS = 4
NEAR = 3 * TITLE + 2 * PAD  # an item this close to its group's edge needs no detour along the margin


@dataclass(frozen=True)
class Box:
    """A placed item: a node, a closed group (``group``) or an open group's frame (``cluster``)."""

    id: str
    kind: str
    x: float
    y: float
    w: float
    h: float


@dataclass(frozen=True)
class Route:
    src: str
    dst: str
    count: int
    points: tuple[tuple[float, float], ...]


@dataclass(frozen=True)
class Layout:
    boxes: dict[str, Box]
    routes: tuple[Route, ...]
    width: float
    height: float


def layout(vg: ViewGraph, size: Callable[[str], tuple[float, float]],
           title_width: Optional[Callable[[str], float]] = None) -> Layout:
    """Place every shown item and open group of ``vg``; ``size(item)`` gives a closed item's w, h and
    ``title_width(group)`` the room an open group's title needs."""
    local, lifted, parent = _local_edges(vg)
    rel: dict[str, tuple[float, float]] = {}  # item -> top-left inside its container
    dims: dict[str, tuple[float, float]] = {}
    titles: dict[str, float] = {}  # open group -> the width its title text needs
    bends: dict[str, dict[tuple[str, str], list[tuple[float, float]]]] = {}
    for container in _bottom_up(vg):
        members = vg.items[container]
        for m in members:
            if m not in dims:
                dims[m] = size(m)
        pos, bends[container], w, h = _place(members, local.get(container, []), dims)
        rel.update(pos)
        if container != ROOT:
            need = title_width(container) if title_width else 7.0 * min(len(container), 60) + 40
            titles[container] = need
            dims[container] = (max(w + 2 * PAD, need), h + HEAD + PAD)
        else:
            dims[ROOT] = (w, h)
    boxes: dict[str, Box] = {}
    origin = _absolute(vg, rel, dims, boxes)
    routes = []
    for (a, b), n in vg.edges.items():
        if a in boxes and b in boxes:
            lift = lifted.get((a, b))
            via = _bends(lift, bends, origin)
            if lift is not None:
                frames = _frames(b, lift[2], parent, boxes)
                via = _leave(a, lift[1], boxes) + via + _enter(b, frames, boxes, titles)
            routes.append(_route(a, b, n, boxes, via))
    width, height = dims[ROOT]
    return Layout(boxes, tuple(routes), width, height)


def _leave(item: str, outer: str, boxes: dict[str, Box]) -> list[tuple[float, float]]:
    """An edge from deep inside an open group leaves along the group's inner right margin."""
    if item == outer:
        return []
    s, frame = boxes[item], boxes[outer]
    if frame.y + frame.h - (s.y + s.h) < NEAR:  # on the last rank: straight out is clearer
        return []
    x = frame.x + frame.w - 4
    return [(x, s.y + s.h + GAP_Y / 3), (x, frame.y + frame.h)]


def _frames(item: str, outer: str, parent: dict[str, str], boxes: dict[str, Box]) -> list[Box]:
    """The open groups an edge to ``item`` enters, outermost (``outer``) first."""
    out: list[Box] = []
    cur = parent.get(item, ROOT)
    while item != outer and cur != ROOT:
        out.append(boxes[cur])
        if cur == outer:
            break
        cur = parent.get(cur, ROOT)
    out.reverse()
    return out


def _enter(item: str, frames: list[Box], boxes: dict[str, Box], titles: dict[str, float]) -> list[tuple[float, float]]:
    """An edge to deep inside an open group enters along its inner left margin, not across its boxes;
    one to the group's first rank enters straight, to the right of any title it would cross."""
    if not frames:
        return []
    t, frame = boxes[item], frames[0]
    if t.y - frame.y >= NEAR:
        x = frame.x + 4  # left of the title's text (it starts at x + 8)
        return [(x, frame.y), (x, t.y - GAP_Y / 3)]
    centre = t.x + t.w / 2
    ends = [f.x + titles.get(f.id, 0.0) - 8 for f in frames]
    if not any(f.x <= centre <= end for f, end in zip(frames, ends)):
        return []
    x = min(max(ends) + 4, frame.x + frame.w - 4)
    return [(x, frame.y), (x, frames[-1].y + TITLE)]


def _bends(lift: Optional[tuple[str, str, str]], bends: dict[str, dict[tuple[str, str], list[tuple[float, float]]]],
           origin: dict[str, tuple[float, float]]) -> list[tuple[float, float]]:
    """The absolute points a long edge passes through (its lanes between the ranks it skips)."""
    if lift is None:
        return []
    container, a, b = lift
    ox, oy = origin[container]
    inner = bends.get(container, {})
    points = inner.get((a, b))
    if points is None:
        points = list(reversed(inner.get((b, a), [])))  # the edge was reversed to break a cycle
    return [(x + ox, y + oy) for x, y in points]


def _bottom_up(vg: ViewGraph) -> list[str]:
    """Containers, children before parents."""
    order = []
    stack = [ROOT]
    while stack:
        c = stack.pop()
        order.append(c)
        stack.extend(i for i in vg.items[c] if i in vg.items)
    order.reverse()
    return order


def _local_edges(vg: ViewGraph) -> tuple[dict[str, list[tuple[str, str]]], dict[tuple[str, str], tuple[str, str, str]],
                                         dict[str, str]]:
    """Each shown edge, lifted to the container holding both ends as its two direct items.

    Returns the lifted edges per container, per shown edge ``(container, item, item)``, and each
    shown item's container.
    """
    parent = {i: c for c, items in vg.items.items() for i in items}
    chains: dict[str, list[str]] = {}

    def chain(item: str) -> list[str]:
        if item not in chains:
            out = [item]
            cur = parent.get(item, ROOT)
            while cur != ROOT:
                out.append(cur)
                cur = parent.get(cur, ROOT)
            out.append(ROOT)
            out.reverse()
            chains[item] = out
        return chains[item]

    local: dict[str, list[tuple[str, str]]] = {}
    lifted: dict[tuple[str, str], tuple[str, str, str]] = {}
    for a, b in vg.edges:
        ca, cb = chain(a), chain(b)
        k = 0
        while k < min(len(ca), len(cb)) and ca[k] == cb[k]:
            k += 1
        if k < len(ca) and k < len(cb):
            local.setdefault(ca[k - 1], []).append((ca[k], cb[k]))
            lifted[(a, b)] = (ca[k - 1], ca[k], cb[k])
    return local, lifted, parent


def _place(members: list[str], edges: list[tuple[str, str]], dims: dict[str, tuple[float, float]]
           ) -> tuple[dict[str, tuple[float, float]], dict[tuple[str, str], list[tuple[float, float]]], float, float]:
    """Layered placement of one container's items.

    Returns top-left positions, the bend points of edges that skip ranks (they get a narrow dummy
    item on each rank they cross, so they run in a lane of their own instead of through boxes) and
    the extent.
    """
    if not members:
        return {}, {}, 0.0, 0.0
    index = {m: i for i, m in enumerate(members)}
    succ: list[set[int]] = [set() for _ in members]
    for a, b in edges:
        if a in index and b in index and a != b:
            succ[index[a]].add(index[b])
    succ = _acyclic(succ)
    rank = _ranks(succ)
    widths = [dims[m][0] for m in members]
    heights = [dims[m][1] for m in members]
    lanes = _add_dummies(succ, rank, widths, heights)
    pred: list[list[int]] = [[] for _ in widths]
    for i, after in enumerate(succ):
        for j in after:
            pred[j].append(i)
    layers: list[list[int]] = [[] for _ in range(max(rank) + 1)]
    for i in range(len(widths)):  # items come in forward order: a good first ordering
        layers[rank[i]].append(i)
    _reduce_crossings(layers, pred, [sorted(s) for s in succ])
    xs = _x_positions(layers, pred, [sorted(s) for s in succ], widths)
    left = min(xs[i] - widths[i] / 2 for i in range(len(widths)))
    pos: dict[str, tuple[float, float]] = {}
    mid: dict[int, tuple[float, float]] = {}
    y = 0.0
    for layer in layers:
        height = max(heights[i] for i in layer)
        for i in layer:
            if i < len(members):
                pos[members[i]] = (xs[i] - widths[i] / 2 - left, y + (height - heights[i]) / 2)
            else:
                mid[i] = (xs[i] - left, y + height / 2)
        y += height + GAP_Y
    width = max(xs[i] + widths[i] / 2 - left for i in range(len(widths)))
    bends = {(members[a], members[b]): [mid[d] for d in ds] for (a, b), ds in lanes.items()}
    return pos, bends, width, y - GAP_Y


DUMMY_W = 8.0


def _add_dummies(succ: list[set[int]], rank: list[int], widths: list[float],
                 heights: list[float]) -> dict[tuple[int, int], list[int]]:
    """Split every edge that skips ranks into a chain through one dummy per skipped rank (in place)."""
    lanes: dict[tuple[int, int], list[int]] = {}
    for a in range(len(succ)):
        for b in sorted(succ[a]):
            if b >= len(rank) or rank[b] - rank[a] <= 1:
                continue
            prev, chain = a, []
            for r in range(rank[a] + 1, rank[b]):
                d = len(widths)
                widths.append(DUMMY_W)
                heights.append(0.0)
                rank.append(r)
                succ.append(set())
                succ[prev].add(d)
                chain.append(d)
                prev = d
            succ[prev].add(b)
            succ[a].discard(b)
            lanes[(a, b)] = chain
    return lanes


def _acyclic(succ: list[set[int]]) -> list[set[int]]:
    """Reverse the back edges of an iterative DFS so the graph has no cycle."""
    state = [0] * len(succ)  # 0 new, 1 on stack, 2 done
    out = [set(s) for s in succ]
    for start in range(len(succ)):
        if state[start]:
            continue
        state[start] = 1
        stack = [(start, iter(sorted(succ[start])))]
        while stack:
            node, it = stack[-1]
            for nxt in it:
                if state[nxt] == 1:
                    out[node].discard(nxt)
                    out[nxt].add(node)
                elif state[nxt] == 0:
                    state[nxt] = 1
                    stack.append((nxt, iter(sorted(succ[nxt]))))
                    break
            else:
                state[node] = 2
                stack.pop()
    return out


def _ranks(succ: list[set[int]]) -> list[int]:
    """Longest-path layering (Kahn's order)."""
    indeg = [0] * len(succ)
    for s in succ:
        for b in s:
            indeg[b] += 1
    rank = [0] * len(succ)
    ready = [i for i, d in enumerate(indeg) if d == 0]
    while ready:
        a = ready.pop()
        for b in succ[a]:
            rank[b] = max(rank[b], rank[a] + 1)
            indeg[b] -= 1
            if indeg[b] == 0:
                ready.append(b)
    return rank


def _reduce_crossings(layers: list[list[int]], pred: list[list[int]], succ: list[list[int]]) -> None:
    """Barycentre sweeps down and up; an item without neighbours on that side keeps its place."""
    where = {i: (r, k) for r, layer in enumerate(layers) for k, i in enumerate(layer)}
    for sweep in range(SWEEPS):
        down = sweep % 2 == 0
        order = range(1, len(layers)) if down else range(len(layers) - 2, -1, -1)
        for r in order:
            layer = layers[r]
            keys = {}
            for k, i in enumerate(layer):
                near = pred[i] if down else succ[i]
                spots = [where[j][1] / max(1, len(layers[where[j][0]])) for j in near]
                keys[i] = sum(spots) / len(spots) if spots else k / max(1, len(layer))
            layer.sort(key=lambda i: keys[i])
            for k, i in enumerate(layer):
                where[i] = (r, k)


def _x_positions(layers: list[list[int]], pred: list[list[int]], succ: list[list[int]],
                 widths: list[float]) -> list[float]:
    """Centres: each item under the mean of its neighbours, pushed apart where they would overlap."""
    x = [0.0] * len(widths)
    for layer in layers:
        cur = 0.0
        for i in layer:
            x[i] = cur + widths[i] / 2
            cur += widths[i] + GAP_X
    for sweep in range(SWEEPS):
        down = sweep % 2 == 0
        for layer in (layers if down else list(reversed(layers))):
            want = []
            for i in layer:
                near = pred[i] if down else succ[i]
                want.append(sum(x[j] for j in near) / len(near) if near else x[i])
            placed = list(want)
            for k in range(1, len(layer)):
                lo = placed[k - 1] + (widths[layer[k - 1]] + widths[layer[k]]) / 2 + GAP_X
                placed[k] = max(placed[k], lo)
            shift = sum(w - p for w, p in zip(want, placed)) / len(layer)
            for k, i in enumerate(layer):
                x[i] = placed[k] + shift
    return x


def _absolute(vg: ViewGraph, rel: dict[str, tuple[float, float]], dims: dict[str, tuple[float, float]],
              boxes: dict[str, Box]) -> dict[str, tuple[float, float]]:
    """Absolute boxes of every item and open group; returns each container's inner origin."""
    origin: dict[str, tuple[float, float]] = {ROOT: (0.0, 0.0)}
    stack = [ROOT]
    while stack:
        c = stack.pop()
        cx, cy = origin[c]
        for item in vg.items[c]:
            rx, ry = rel[item]
            ax, ay = cx + rx, cy + ry
            w, h = dims[item]
            if item in vg.items:
                boxes[item] = Box(item, "cluster", ax, ay, w, h)
                origin[item] = (ax + PAD, ay + HEAD)
                stack.append(item)
            else:
                boxes[item] = Box(item, "item", ax, ay, w, h)
    return origin


def _route(a: str, b: str, count: int, boxes: dict[str, Box], via: list[tuple[float, float]]) -> Route:
    """From the bottom middle of ``a`` through its lane points to the top middle of ``b``."""
    s, t = boxes[a], boxes[b]
    return Route(a, b, count, ((s.x + s.w / 2, s.y + s.h), *via, (t.x + t.w / 2, t.y)))
