"""The graph explorer: static PNG, SVG and DOT of the current view, text summary, and the live widget.

:class:`GraphExplorer` holds a :class:`GraphData`, its hierarchy and the set of open groups. The
kernel lays out each view (``process.graph_layout``) and draws it as SVG with every user string
escaped (and, for the static view saved in notebooks, as a PNG picture from the same layout); the
widget shows that SVG, pans and zooms it in the browser and sends clicks back
(``toggle``/``select``/``search``/``dot``), so the browser never needs Graphviz or a layout engine.
"""
from __future__ import annotations

from typing import Any, Optional

import traitlets

from torch_nbdebug.data.graph import GraphData
from torch_nbdebug.data.stats import fmt_number
from torch_nbdebug.errors import InputError
from torch_nbdebug.process import graph as pg
from torch_nbdebug.process.graph_details import details, group_label, node_label, search, shape_text
from torch_nbdebug.process.graph_layout import Layout, layout
from torch_nbdebug.render.bundle import Displayable
from torch_nbdebug.render.html import bad, esc, muted, swatch, table
from torch_nbdebug.render.widget import View, esm_path

CHAR_W = 6.8
# The first view fits the widget's viewport (at most 760 px high, ~640 px wide beside the details panel
# in a 900 px output area) at graph.js's readable zoom (labels of 11 px drawn at >= 10 px).
READABLE = 10 / 11
OPEN_W, OPEN_H = 640 / READABLE, (760 - 12) / READABLE
NODE_H = 34.0
GROUP_H = 42.0
COLORS = {  # fill, stroke: presentation attributes so the SVG looks right with no CSS
    "op": ("#eef0f3", "#8c959f"), "param": ("#cfe8fc", "#218bff"), "input": ("#dafbe1", "#2da44e"),
    "output": ("#a6e3a1", "#1a7f37"), "group": ("#fff8e1", "#bf8700"), "chunk": ("#f6f0ff", "#8250df"),
    "nan": ("#ffebe9", "#cf222e"),
}


LEGEND = (("input", "input"), ("param", "parameter"), ("op", "op"), ("output", "output"),
          ("group", "module (closed)"), ("chunk", "chunk of ops"), ("nan", "first NaN/Inf"))


def legend_html() -> str:
    """What the box colours mean: a swatch next to each label (the label alone says it without styles)."""
    keys = " ".join(f"{swatch(COLORS[k][1])}{esc(label)}" for k, label in LEGEND)
    return f'<p class="tnd-graph-legend">{muted("Boxes: " + keys + " · ‖g‖ = gradient norm")}</p>'


STATIC_NOTE = ("Static picture of the groups open now (▸ closed, ▾ open). With a running kernel the widget opens "
               "groups on click, searches, pans/zooms and exports SVG/PNG/DOT.")
STATIC_MAX_W, STATIC_MAX_H = 1000.0, 1600.0  # a bigger view shrinks to fit (its text with it) ...
STATIC_MIN_SCALE = 0.5  # ... but never below half size, where 11-px labels become unreadable
ITEMS_SHOWN = 80  # rows of the static item table; the rest are counted


def graph_alt(ex: "GraphExplorer", vg: pg.ViewGraph) -> str:
    """What the picture shows, in words: the summary and the boxes in drawing order."""
    names = [ex.label(i)[0] for i in ex.shown()]
    listed = ", ".join(names[:24]) + (f", … {len(names) - 24} more" if len(names) > 24 else "")
    marked = [n for n in ex.data.nodes if n.nan]
    origin = f" (from {ex.data.nan_from})" if ex.data.nan_from else ""
    nan = f"; first NaN/Inf at {marked[0].label}{origin}" if marked else ""
    return f"computation graph ({ex.data.summary()}); boxes shown: {listed}{nan}"


def nan_note(data: GraphData) -> list[str]:
    """The note naming where the red birth mark comes from (none when nothing is marked)."""
    marked = next((n for n in data.nodes if n.nan), None)
    if marked is None:
        return []
    return [f"red: the first NaN/Inf was born at {marked.label} ({marked.module or 'no module'}), "
            f"from {data.nan_from or '%%nanwatch'}"]


def items_html(ex: "GraphExplorer", vg: pg.ViewGraph) -> str:
    """The boxes of the picture as a table (inside ``<details>``): searchable text for every view."""
    rows = []
    for item in ex.shown()[:ITEMS_SHOWN]:
        main, sub = ex.label(item)
        if item in ex.hierarchy.groups:
            g = ex.hierarchy.groups[item]
            kind, where = "module (closed)" if g.kind != "chunk" else "chunk of ops", g.path or g.label
        else:
            node = ex.data.node(item)
            kind, where = dict(LEGEND).get(node.kind, node.kind), node.module or ""
        nan = item in ex.nan_groups() or (item not in ex.hierarchy.groups and ex.data.node(item).nan)
        rows.append((f"<code>{esc(main)}</code>" + (f" {bad('first NaN/Inf')}" if nan else ""), esc(kind),
                     f"<code>{esc(sub)}</code>", f"<code>{esc(where)}</code>" if where else ""))
    more = len(ex.shown()) - len(rows)
    rest = f"<p>{muted(f'… {more:,} more')}</p>" if more > 0 else ""
    return (f"<details><summary>The {len(ex.shown()):,} boxes of this picture, as a table</summary>"
            f"{table(['box', 'kind', 'shape / size', 'module'], rows)}{rest}</details>")


def render_png(ex: "GraphExplorer", lay: Layout) -> tuple[bytes, int, int]:
    """The view drawn with matplotlib from the kernel-side layout; returns PNG bytes and CSS size."""
    from torch_nbdebug.render.figures import png

    m = 8.0
    w, h = lay.width + 2 * m, lay.height + 2 * m
    # Fit the width, and the height where that keeps the text legible; a huge view stays tall.
    scale = max(min(1.0, STATIC_MAX_W / w, STATIC_MAX_H / h), min(1.0, STATIC_MAX_W / w, STATIC_MIN_SCALE))
    width, height = round(max(w * scale, 40.0)), round(max(h * scale, 30.0))
    return png(lambda fig: _draw_graph(fig, ex, lay, m, scale), width, height), width, height


def _draw_graph(fig: Any, ex: "GraphExplorer", lay: Layout, m: float, scale: float) -> None:
    from matplotlib.patches import FancyBboxPatch, PathPatch, Polygon
    from matplotlib.path import Path

    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_axis_off()
    ax.set_xlim(-m, lay.width + m)
    ax.set_ylim(lay.height + m, -m)  # y grows downwards, as in the layout
    pt = 0.72 * scale  # layout px -> font points at 100 DPI
    mono = "DejaVu Sans Mono"
    for box in lay.boxes.values():
        if box.kind == "cluster":
            g = ex.hierarchy.groups[box.id]
            ax.add_patch(FancyBboxPatch((box.x, box.y), box.w, box.h, boxstyle="round,pad=0,rounding_size=6",
                                        facecolor="#fbfbfc", edgecolor="#8c959f", linestyle=(0, (4, 3)), linewidth=0.8))
            ax.text(box.x + 8, box.y + 15, f"▾ {group_label(ex.hierarchy, box.id)} {g.type_name}", fontsize=11 * pt,
                    fontweight="bold", color="#57606a", family=mono, va="baseline", clip_on=True)
    for r in lay.routes:
        verts, codes = _curve(r.points)
        ax.add_patch(PathPatch(Path(verts, codes), facecolor="none", edgecolor="#8c959f",
                               linewidth=(1.0 + min(3.0, r.count / 4)) * scale))
        x, y = r.points[-1]
        ax.add_patch(Polygon([(x - 3.5, y - 7), (x + 3.5, y - 7), (x, y)], closed=True, color="#57606a"))
    for box in lay.boxes.values():
        if box.kind != "cluster":
            _draw_item(ax, ex, box, pt, mono)


def _curve(points: tuple[tuple[float, float], ...]) -> tuple[list[tuple[float, float]], list[int]]:
    """The same smooth route as the SVG's ``_path_d``, as matplotlib path vertices and codes."""
    from matplotlib.path import Path

    verts, codes = [points[0]], [int(Path.MOVETO)]
    last = len(points) - 1
    for k in range(1, len(points)):
        (x1, y1), (x2, y2) = points[k - 1], points[k]
        y2 = y2 - 6 if k == last else y2  # room for the arrow head
        bend = max(8.0, abs(y2 - y1) / 2)
        verts += [(x1, y1 + bend), (x2, y2 - bend), (x2, y2)]
        codes += [int(Path.CURVE4)] * 3
    return verts, codes


def _draw_item(ax: Any, ex: "GraphExplorer", box: Any, pt: float, mono: str) -> None:
    from matplotlib.patches import FancyBboxPatch

    main, sub = ex.label(box.id)
    if box.id in ex.hierarchy.groups:
        group = ex.hierarchy.groups[box.id]
        kind, nan = (group.kind if group.kind == "chunk" else "group"), box.id in ex.nan_groups()
        main = "▸ " + main
    else:
        node = ex.data.node(box.id)
        kind, nan = node.kind, node.nan
    fill, stroke = COLORS["nan"] if nan else COLORS[kind]
    wide = 2.5 if nan or box.id == ex.selected else 1.0
    style = "round,pad=0,rounding_size=5"
    if box.id in ex.hierarchy.groups:  # a second frame reads as "there is more inside"
        ax.add_patch(FancyBboxPatch((box.x + 3, box.y + 3), box.w, box.h, boxstyle=style, facecolor=fill,
                                    edgecolor=stroke, linewidth=0.8))
    ax.add_patch(FancyBboxPatch((box.x, box.y), box.w, box.h, boxstyle=style, facecolor=fill, edgecolor=stroke,
                                linewidth=wide))
    ax.text(box.x + box.w / 2, box.y + 14, _clip(main, box.w), ha="center", va="baseline", fontsize=11 * pt,
            color="#1f2328", family=mono)
    ax.text(box.x + box.w / 2, box.y + 27, _clip(sub, box.w), ha="center", va="baseline", fontsize=10 * pt,
            color="#57606a", family=mono)


class GraphExplorer(Displayable):
    """A graph with a current view: ``expand``/``collapse``/``toggle`` groups, ``svg()``, ``dot()``."""

    def __init__(self, data: GraphData, expand: Any = "auto") -> None:
        self.data = data
        self.hierarchy = pg.build_hierarchy(data)
        self.expanded = self._initial(expand)
        self.selected: Optional[str] = None
        self._layout: Optional[tuple[frozenset[str], pg.ViewGraph, Layout]] = None
        self._widget: Optional[GraphWidget] = None
        self._nan_groups: Optional[frozenset[str]] = None
        self._svg: Optional[tuple[frozenset[str], Optional[str], str]] = None

    def _initial(self, expand: Any) -> frozenset[str]:
        if expand == "all":
            return pg.expand_all(self.hierarchy)
        if expand == "modules":
            return pg.expand_modules(self.hierarchy)
        if expand is None or expand == "auto":
            return pg.auto_expand(self.hierarchy, fits=self._fits)
        if isinstance(expand, (set, frozenset, list, tuple)):
            opened: set[str] = set()
            for name in expand:
                gid = self._known_group(str(name))
                opened.update([gid, *self.hierarchy.chain(gid)])  # opening a group opens its parents
            return frozenset(opened)
        raise InputError(f"expand must be 'auto', 'modules', 'all' or a list of module paths, not {expand!r}")

    def _fits(self, expanded: frozenset[str]) -> bool:
        """Whether the view with these groups open is seen whole at a readable zoom."""
        lay = layout(pg.view(self.data, self.hierarchy, expanded), self._size, self._title_width)
        return lay.width <= OPEN_W and lay.height <= OPEN_H

    def _known_group(self, name: str) -> str:
        try:
            return self.group_id(name)
        except KeyError:
            tops = [g.path or g.label for gid, g in self.hierarchy.groups.items() if g.parent == pg.ROOT]
            raise InputError(f"expand: no module {name!r} in this graph; its top-level groups are "
                             f"{', '.join(tops[:8]) or '(none)'}") from None

    # --- view state -------------------------------------------------------------------------
    def group_id(self, name: str) -> str:
        """Accept a group id (``m:model.fc``) or a module path (``model.fc``)."""
        if name in self.hierarchy.groups:
            return name
        gid = pg.module_group_id(name)
        if gid not in self.hierarchy.groups:
            raise KeyError(f"no group or module {name!r} in this graph")
        return gid

    def toggle(self, name: str) -> "GraphExplorer":
        self.expanded = pg.toggle(self.expanded, self.hierarchy, self.group_id(name))
        return self

    def expand(self, name: str) -> "GraphExplorer":
        gid = self.group_id(name)
        if gid not in self.expanded:
            self.toggle(gid)
        return self

    def collapse(self, name: str) -> "GraphExplorer":
        gid = self.group_id(name)
        if gid in self.expanded:
            self.toggle(gid)
        return self

    def reveal(self, item: str) -> "GraphExplorer":
        self.expanded = pg.reveal(self.expanded, self.hierarchy, item)
        self.selected = item
        return self

    def view(self) -> tuple[pg.ViewGraph, Layout]:
        """The current view and its layout (cached until the open groups change)."""
        if self._layout is None or self._layout[0] != self.expanded:
            vg = pg.view(self.data, self.hierarchy, self.expanded)
            self._layout = (self.expanded, vg, layout(vg, self._size, self._title_width))
        return self._layout[1], self._layout[2]

    def shown(self) -> list[str]:
        """Ids of the items the current view shows (nodes and closed groups)."""
        vg, _ = self.view()
        return [i for items in vg.items.values() for i in items if i not in vg.items]

    def nan_groups(self) -> frozenset[str]:
        """Groups holding the node marked as the first NaN/Inf birth (drawn red when closed)."""
        if self._nan_groups is None:
            marked = [n.id for n in self.data.nodes if n.nan]
            self._nan_groups = frozenset(g for n in marked for g in self.hierarchy.chain(n))
        return self._nan_groups

    def details(self, item: str) -> dict[str, Any]:
        return details(self.data, self.hierarchy, item)

    def search(self, text: str) -> list[dict[str, str]]:
        return search(self.data, self.hierarchy, text)

    # --- labels -----------------------------------------------------------------------------
    def label(self, item: str) -> tuple[str, str]:
        """Main line and second line of an item's box."""
        if item in self.hierarchy.groups:
            g = self.hierarchy.groups[item]
            count = f"{g.size:,} autograd node{'' if g.size == 1 else 's'}"
            sub = f"{g.type_name} · {count}" if g.type_name else count
            return group_label(self.hierarchy, item), sub
        node = self.data.node(item)
        sub = shape_text(node.shape, node.dtype)
        if node.grad is not None:
            sub += f" ‖g‖={fmt_number(node.grad.norm, 3)}"
        return node_label(self.hierarchy, node), sub

    def _size(self, item: str) -> tuple[float, float]:
        main, sub = self.label(item)
        marker = 2 if item in self.hierarchy.groups else 0  # the "▸ " before a closed group's name
        width = min(300.0, max(64.0, CHAR_W * max(len(main) + marker, len(sub)) + 18))
        return width, GROUP_H if item in self.hierarchy.groups else NODE_H

    def _title_width(self, gid: str) -> float:
        text = f"▾ {group_label(self.hierarchy, gid)} {self.hierarchy.groups[gid].type_name}"
        return CHAR_W * len(text) + 24

    # --- output -----------------------------------------------------------------------------
    def svg(self) -> str:
        key = (self.expanded, self.selected)
        if self._svg is None or self._svg[:2] != key:
            vg, lay = self.view()
            self._svg = (self.expanded, self.selected, render_svg(self, vg, lay))
        return self._svg[2]

    def dot(self) -> str:
        vg, _ = self.view()
        return render_dot(self, vg)

    def text(self) -> str:
        vg, _ = self.view()
        shown = sum(1 for items in vg.items.values() for i in items if i not in vg.items)
        closed = sum(1 for items in vg.items.values() for i in items if i in self.hierarchy.groups and i not in vg.items)
        lines = [self.data.summary(), f"view: {shown} items shown, {closed} groups closed"]
        lines += [f"note: {n}" for n in self.data.notes]
        marked = [n for n in self.data.nodes if n.nan]
        if marked:
            origin = f", from {self.data.nan_from}" if self.data.nan_from else ""
            lines.append(f"first NaN/Inf born at {marked[0].label} ({marked[0].module or 'no module'}){origin}")
        return "\n".join(lines)

    def html(self) -> str:
        from torch_nbdebug.render.figures import img_tag

        notes = "".join(f"<p>{muted(esc(n))}</p>" for n in self.data.notes + tuple(nan_note(self.data)))
        vg, lay = self.view()
        data, width, height = render_png(self, lay)
        return (f"<div class='tnd tnd-graph'><h3>{esc(self.data.summary())}</h3>{notes}{legend_html()}"
                f"<div>{img_tag(data, graph_alt(self, vg), width, height, 'tnd-figure tnd-graph-figure')}</div>"
                f"<p>{muted(STATIC_NOTE)}</p>"
                f"{items_html(self, vg)}</div>")

    def to_dict(self) -> dict[str, Any]:
        """The plain graph plus the current view's open groups (JSON-able)."""
        return {**self.data.to_dict(), "expanded": sorted(self.expanded)}

    def widget(self) -> "GraphWidget":
        if self._widget is None or self._widget.comm is None:  # a closed one (its cell re-ran) is not reused
            self._widget = GraphWidget(self)
        return self._widget


def _n(value: float) -> str:
    """A coordinate to a tenth of a pixel, without a trailing ``.0``."""
    text = f"{value:.1f}"
    return text[:-2] if text.endswith(".0") else text


def _path_d(points: tuple[tuple[float, float], ...]) -> str:
    """A smooth curve through the route's points, leaving and entering each vertically."""
    (x0, y0) = points[0]
    parts = [f"M{_n(x0)},{_n(y0)}"]
    last = len(points) - 1
    for k in range(1, len(points)):
        (x1, y1), (x2, y2) = points[k - 1], points[k]
        y2 = y2 - 4 if k == last else y2  # room for the arrow head
        bend = max(8.0, abs(y2 - y1) / 2)
        parts.append(f"C{_n(x1)},{_n(y1 + bend)} {_n(x2)},{_n(y2 - bend)} {_n(x2)},{_n(y2)}")
    return " ".join(parts)


def render_svg(ex: GraphExplorer, vg: pg.ViewGraph, lay: Layout) -> str:
    """The view as one self-contained SVG; ``data-id`` on every clickable element. What all edges or
    all boxes share is said once, on a ``<g>`` around them (inherited): the SVG is saved in notebooks."""
    m = 8.0
    w, h = lay.width + 2 * m, lay.height + 2 * m
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' class='tnd-graph-svg' width='{w:.0f}' height='{h:.0f}' "
           f"viewBox='{-m:.0f} {-m:.0f} {w:.0f} {h:.0f}' font-family='ui-monospace, Menlo, monospace' font-size='11'>",
           "<defs><marker id='tnd-arrow' viewBox='0 0 8 8' refX='7' refY='4' markerWidth='7' markerHeight='7' "
           "orient='auto'><path d='M0,0 L8,4 L0,8 z' fill='#57606a'/></marker></defs>"]
    for box in lay.boxes.values():
        if box.kind == "cluster":
            title = group_label(ex.hierarchy, box.id)
            g = ex.hierarchy.groups[box.id]
            out.append(f"<g class='cluster' data-id='{esc(box.id)}'><rect x='{_n(box.x)}' y='{_n(box.y)}' "
                       f"width='{_n(box.w)}' height='{_n(box.h)}' rx='6' fill='#fbfbfc' fill-opacity='0.6' "
                       f"stroke='#8c959f' stroke-dasharray='4 3'/><text class='title' x='{_n(box.x + 8)}' "
                       f"y='{_n(box.y + 15)}' font-weight='600' fill='#57606a'>▾ {esc(title)}"
                       f"<tspan fill='#8c959f' font-weight='400'> {esc(g.type_name)}</tspan></text></g>")
    out.append("<g fill='none' stroke='#8c959f' marker-end='url(#tnd-arrow)'>")
    for r in lay.routes:
        width = 1.0 + min(3.0, r.count / 4)
        out.append(f"<path class='edge' data-src='{esc(r.src)}' data-dst='{esc(r.dst)}' d='{_path_d(r.points)}' "
                   f"stroke-width='{_n(width)}'/>")
    out.append("</g><g text-anchor='middle' fill='#1f2328' style='cursor:pointer'>")
    for box in lay.boxes.values():
        if box.kind != "cluster":
            out.append(_item_svg(ex, box.id, box.x, box.y, box.w, box.h))
    out.append("</g></svg>")
    return "".join(out)


def _item_svg(ex: GraphExplorer, item: str, x: float, y: float, w: float, h: float) -> str:
    main, sub = ex.label(item)
    if item in ex.hierarchy.groups:
        group = ex.hierarchy.groups[item]
        kind, cls, tip = group.kind if group.kind == "chunk" else "group", "group", group.path or group.label
        nan = item in ex.nan_groups()
    else:
        node = ex.data.node(item)
        kind, cls, tip, nan = node.kind, f"node {node.kind}", node.label, node.nan
    fill, stroke = COLORS["nan"] if nan else COLORS[kind]
    selected = " selected" if item == ex.selected else ""
    extra = ""
    if cls == "group":  # a second frame reads as "there is more inside"
        extra = (f"<rect x='{_n(x + 3)}' y='{_n(y + 3)}' width='{_n(w)}' height='{_n(h)}' rx='5' fill='{fill}' "
                 f"stroke='{stroke}'/>")
        main = "▸ " + main
    wide = " stroke-width='2.5'" if nan or selected else ""
    # text-anchor, the first line's fill and the pointer come from the <g> around all boxes (render_svg)
    return (f"<g class='{cls}{' nan' if nan else ''}{selected}' data-id='{esc(item)}'>"
            f"<title>{esc(tip)}</title>{extra}<rect x='{_n(x)}' y='{_n(y)}' width='{_n(w)}' height='{_n(h)}' rx='5' "
            f"fill='{fill}' stroke='{stroke}'{wide}/>"
            f"<text x='{_n(x + w / 2)}' y='{_n(y + 14)}'>{esc(_clip(main, w))}</text>"
            f"<text x='{_n(x + w / 2)}' y='{_n(y + 27)}' fill='#57606a' font-size='10'>{esc(_clip(sub, w))}</text></g>")


def _clip(text: str, width: float) -> str:
    room = max(4, int((width - 10) / CHAR_W))
    return text if len(text) <= room else text[:room - 1] + "…"


def _dot_str(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def render_dot(ex: GraphExplorer, vg: pg.ViewGraph) -> str:
    """The current view in Graphviz DOT: open groups as clusters, closed groups as boxes."""
    lines = ["digraph graph_view {", "  node [shape=box style=filled fontname=monospace fontsize=10];"]

    def emit(container: str, indent: str) -> None:
        for item in vg.items[container]:
            if item in vg.items:
                lines.append(f"{indent}subgraph {_dot_str('cluster_' + item)} {{")
                lines.append(f"{indent}  label={_dot_str(group_label(ex.hierarchy, item))};")
                emit(item, indent + "  ")
                lines.append(f"{indent}}}")
            else:
                main, sub = ex.label(item)
                kind = "group" if item in ex.hierarchy.groups else ex.data.node(item).kind
                fill = COLORS["chunk" if ex.hierarchy.groups.get(item, None) and ex.hierarchy.groups[item].kind == "chunk"
                              else kind][0]
                lines.append(f"{indent}{_dot_str(item)} [label={_dot_str(main + chr(10) + sub)} fillcolor={_dot_str(fill)}];")

    emit(pg.ROOT, "  ")
    for (a, b), n in vg.edges.items():
        lines.append(f"  {_dot_str(a)} -> {_dot_str(b)}" + (f" [label={_dot_str(str(n))}];" if n > 1 else ";"))
    lines.append("}")
    return "\n".join(lines)


class GraphWidget(View):
    """The live view: the kernel sends SVG, the browser pans/zooms and sends clicks back."""

    _esm = esm_path("graph.js")
    _css = esm_path("base.css")  # the shared look, also in the live view
    svg = traitlets.Unicode("").tag(sync=True)
    summary = traitlets.Unicode("").tag(sync=True)
    notes = traitlets.List(traitlets.Unicode()).tag(sync=True)
    details = traitlets.Dict().tag(sync=True)
    matches: traitlets.List[Any] = traitlets.List().tag(sync=True)
    selected = traitlets.Unicode("").tag(sync=True)

    def __init__(self, explorer: GraphExplorer) -> None:
        super().__init__()
        self._explorer = explorer
        self.summary = explorer.data.summary()
        self.notes = list(explorer.data.notes) + nan_note(explorer.data)
        self.refresh()
        self.on_msg(self._on_message)

    def refresh(self) -> None:
        self.svg = self._explorer.svg()
        self.selected = self._explorer.selected or ""

    def _on_message(self, _widget: Any, content: Any, _buffers: Any) -> None:
        if not isinstance(content, dict):
            return
        kind, item = content.get("type"), str(content.get("id", ""))
        ex = self._explorer
        if kind == "toggle" and item in ex.hierarchy.groups:
            ex.toggle(item)
            self.details = ex.details(item)
            self.refresh()
        elif kind == "select" and (item in ex.hierarchy.groups or _has(ex, item)):
            ex.selected = item
            self.details = ex.details(item)
            self.refresh()
        elif kind == "reveal" and (item in ex.hierarchy.groups or _has(ex, item)):
            ex.reveal(item)
            self.details = ex.details(item)
            self.refresh()
        elif kind == "search":
            self.matches = ex.search(str(content.get("q", "")))
        elif kind == "dot":
            self.send({"type": "dot", "text": ex.dot()})


def _has(ex: GraphExplorer, item: str) -> bool:
    try:
        ex.data.node(item)
        return True
    except KeyError:
        return False
