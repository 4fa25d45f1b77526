"""%graph processing on hand-built data: hierarchy, collapse/expand, chunking, inference, layout."""
from __future__ import annotations

import json

import pytest

from torch_nbdebug.data.graph import GradInfo, GraphData, GraphEdge, GraphNode, ModuleInfo, SavedInfo
from torch_nbdebug.process import graph as pg
from torch_nbdebug.process.graph_details import details, group_label, search
from torch_nbdebug.process.graph_infer import common_prefix, infer_modules
from torch_nbdebug.process.graph_layout import layout


def _op(i: int, module: str | None, label: str = "op") -> GraphNode:
    return GraphNode(id=f"n{i}", kind="op", label=label, op=f"{label}Backward0", shape=(2, 3), dtype="float32",
                     module=module, topo=i)


def _blocks(n: int = 12) -> GraphData:
    """``model.embed`` -> ``model.blocks.0..n-1`` (2 ops each: attn, mlp) -> ``model.head``: a chain."""
    nodes = [_op(0, "model.embed", "embedding")]
    for b in range(n):
        nodes.append(_op(len(nodes), f"model.blocks.{b}.attn", "bmm"))
        nodes.append(_op(len(nodes), f"model.blocks.{b}.mlp", "gelu"))
    nodes.append(_op(len(nodes), "model.head", "addmm"))
    edges = tuple(GraphEdge(f"n{i}", f"n{i + 1}") for i in range(len(nodes) - 1))
    mods = [ModuleInfo("model", "GPT"), ModuleInfo("model.blocks", "ModuleList", "model")]
    mods += [ModuleInfo(f"model.blocks.{b}", "Block", "model.blocks") for b in range(n)]
    return GraphData(nodes=tuple(nodes), edges=edges, modules=tuple(mods), title="gpt")


def _shown(data: GraphData, hier: pg.Hierarchy, expanded) -> set[str]:
    vg = pg.view(data, hier, expanded)
    return {i for items in vg.items.values() for i in items if i not in vg.items}


def test_repeated_blocks_open_collapsed_and_labelled() -> None:
    data = _blocks(12)
    hier = pg.build_hierarchy(data)
    assert hier.groups["m:model.blocks"].repeat == "0..11 ×12 Block"
    assert group_label(hier, "m:model.blocks") == "blocks.0..11 ×12 Block"
    opened = pg.auto_expand(hier, budget=8)
    assert "m:model" in opened and "m:model.blocks" not in opened
    # one-node modules open for free (embed, head); the 24-node repeated container stays one box
    assert _shown(data, hier, opened) == {"n0", "m:model.blocks", "n25"}


def test_expand_in_place_then_collapse_again() -> None:
    data = _blocks(3)
    hier = pg.build_hierarchy(data)
    opened = frozenset({"m:model"})
    before = _shown(data, hier, opened)
    opened = pg.toggle(opened, hier, "m:model.blocks")
    after = _shown(data, hier, opened)
    assert after == (before - {"m:model.blocks"}) | {"m:model.blocks.0", "m:model.blocks.1", "m:model.blocks.2"}
    opened = pg.toggle(opened, hier, "m:model.blocks.1")
    assert {"m:model.blocks.1.attn", "m:model.blocks.1.mlp"} <= _shown(data, hier, opened)
    closed = pg.toggle(opened, hier, "m:model.blocks")  # closing closes everything inside too
    assert _shown(data, hier, closed) == before and "m:model.blocks.1" not in closed


def test_edges_between_shown_items_are_merged_with_counts() -> None:
    data = _blocks(2)
    hier = pg.build_hierarchy(data)
    vg = pg.view(data, hier, {"m:model"})
    assert vg.edges == {("m:model.embed", "m:model.blocks"): 1, ("m:model.blocks", "m:model.head"): 1}
    inner = pg.view(data, hier, {"m:model", "m:model.blocks", "m:model.blocks.0"})
    assert inner.edges[("m:model.blocks.0.attn", "m:model.blocks.0.mlp")] == 1
    assert inner.rep["n1"] == "m:model.blocks.0.attn" and inner.rep["n3"] == "m:model.blocks.1"


def test_reveal_opens_every_group_around_a_node() -> None:
    data = _blocks(4)
    hier = pg.build_hierarchy(data)
    opened = pg.reveal(frozenset(), hier, "n5")  # model.blocks.2.attn's bmm
    assert "n5" in _shown(data, hier, opened)


def test_large_flat_graph_is_chunked_and_opens_small() -> None:
    n = 5000
    nodes = tuple(_op(i, None) for i in range(n))
    edges = tuple(GraphEdge(f"n{i}", f"n{i + 1}") for i in range(n - 1))
    data = GraphData(nodes=nodes, edges=edges)
    hier = pg.build_hierarchy(data)
    assert all(len(items) <= pg.MAX_ITEMS for items in hier.items.values())
    opened = pg.auto_expand(hier)
    shown = _shown(data, hier, opened)
    assert len(shown) <= pg.AUTO_BUDGET
    # every node is represented by exactly one shown item
    vg = pg.view(data, hier, opened)
    assert set(vg.rep.values()) <= shown and len(vg.rep) == n
    lay = layout(vg, lambda i: (80.0, 30.0))
    assert set(lay.boxes) >= shown


def test_layout_places_items_in_forward_order_without_overlap() -> None:
    data = _blocks(3)
    hier = pg.build_hierarchy(data)
    opened = pg.expand_all(hier)
    vg = pg.view(data, hier, opened)
    lay = layout(vg, lambda i: (90.0, 30.0))
    items = [b for b in lay.boxes.values() if b.kind == "item"]
    for a in items:
        for b in items:
            if a.id < b.id:
                assert a.x + a.w <= b.x + 1e-6 or b.x + b.w <= a.x + 1e-6 or a.y + a.h <= b.y + 1e-6 \
                    or b.y + b.h <= a.y + 1e-6, (a, b)
    ys = [lay.boxes[f"n{i}"].y for i in range(len(data.nodes))]
    assert ys == sorted(ys)  # a chain flows downwards
    for item in items:  # every item sits inside the frame of each open group around it
        for gid in hier.chain(item.id):
            frame = lay.boxes[gid]
            assert frame.x <= item.x and item.x + item.w <= frame.x + frame.w + 1e-6
            assert frame.y <= item.y and item.y + item.h <= frame.y + frame.h + 1e-6


def test_cycles_from_collapsing_do_not_break_layout() -> None:
    # a -> b -> c with a, c in module m and b outside: collapsing m makes m -> b -> m.
    nodes = (_op(0, "m"), _op(1, None), _op(2, "m"))
    data = GraphData(nodes=nodes, edges=(GraphEdge("n0", "n1"), GraphEdge("n1", "n2")))
    hier = pg.build_hierarchy(data)
    vg = pg.view(data, hier, frozenset())
    assert set(vg.edges) == {("m:m", "n1"), ("n1", "m:m")}
    lay = layout(vg, lambda i: (60.0, 30.0))
    assert {"m:m", "n1"} <= set(lay.boxes)


def test_infer_modules_from_parameters() -> None:
    def param(i: int, name: str) -> GraphNode:
        return GraphNode(id=f"n{i}", kind="param", label=name, op="AccumulateGrad", module=name.rpartition(".")[0],
                         topo=i)

    nodes = (param(0, "m.fc1.weight"), _op(1, None, "t"), _op(2, None, "mm"), _op(3, None, "relu"),
             param(4, "m.fc2.weight"), _op(5, None, "t"), _op(6, None, "mm"))
    edges = (GraphEdge("n0", "n1"), GraphEdge("n1", "n2"), GraphEdge("n2", "n3"), GraphEdge("n3", "n6"),
             GraphEdge("n4", "n5"), GraphEdge("n5", "n6"))
    data = infer_modules(GraphData(nodes=nodes, edges=edges))
    assert [n.module for n in data.nodes] == ["m.fc1", "m.fc1", "m.fc1", "m", "m.fc2", "m.fc2", "m.fc2"]
    assert data.source == "inferred" and "inferred" in data.notes[-1]
    assert common_prefix("a.b.c", "a.b.d") == "a.b" and common_prefix("x", "y") is None


def test_details_and_search() -> None:
    nodes = (GraphNode(id="n0", kind="param", label="model.fc.weight", op="AccumulateGrad", shape=(3, 4),
                       dtype="float32", module="model.fc", grad=GradInfo(norm=2.0, min=-1, max=1), topo=0),
             GraphNode(id="n1", kind="op", label="addmm", op="AddmmBackward0", shape=(2, 3), dtype="float32",
                       module="model.fc", saved=(SavedInfo("mat1", (2, 4), "float32"),), seq=7, topo=1))
    data = GraphData(nodes=nodes, edges=(GraphEdge("n0", "n1"),), modules=(ModuleInfo("model.fc", "Linear"),))
    hier = pg.build_hierarchy(data)
    d = details(data, hier, "n1")
    assert d["op"] == "AddmmBackward0" and d["shape"] == "[2, 3] float32" and d["module"] == "model.fc"
    assert d["saved"] == ["mat1: [2, 4] float32"] and d["inputs"] == ["model.fc.weight"]
    g = details(data, hier, "m:model.fc")
    assert g["params"] == 1 and g["numel"] == 12 and "2" in g["grad"]
    found = search(data, hier, "fc.weight")
    assert found[0]["id"] == "n0"
    assert search(data, hier, "model.fc")[0]["id"] == "m:model.fc"


def test_graph_data_round_trips_through_json() -> None:
    data = _blocks(2)
    again = GraphData.from_json(json.dumps(json.loads(data.to_json())))
    assert again == data
    with pytest.raises(KeyError):
        data.node("nope")


def test_module_level_view_keeps_repeats_closed() -> None:
    data = _blocks(12)
    hier = pg.build_hierarchy(data)
    opened = pg.expand_modules(hier)
    assert "m:model" in opened and "m:model.blocks" not in opened
    assert "m:model.blocks.3" in opened  # already open at module level once the user opens blocks
    short = pg.build_hierarchy(_blocks(3))  # a short repeat too: one `blocks.0..2 ×3 Block` box to open
    assert "m:model.blocks" not in pg.expand_modules(short)
    assert _shown(_blocks(3), short, pg.expand_modules(short)) == {"m:model.embed", "m:model.blocks", "m:model.head"}


def test_long_edges_run_in_their_own_lane() -> None:
    # a -> b -> c -> d plus the skip a -> d (a residual): the skip must not cut through b or c.
    nodes = tuple(_op(i, None) for i in range(4))
    edges = (GraphEdge("n0", "n1"), GraphEdge("n1", "n2"), GraphEdge("n2", "n3"), GraphEdge("n0", "n3"))
    data = GraphData(nodes=nodes, edges=edges)
    hier = pg.build_hierarchy(data)
    lay = layout(pg.view(data, hier, frozenset()), lambda i: (80.0, 30.0))
    skip = next(r for r in lay.routes if (r.src, r.dst) == ("n0", "n3"))
    assert len(skip.points) == 4  # start, one lane point per skipped rank, end
    for (x, y), mid in zip(skip.points[1:3], ("n1", "n2")):
        box = lay.boxes[mid]
        assert not box.x <= x <= box.x + box.w and box.y <= y <= box.y + box.h



def test_module_level_view_keeps_a_leaf_module_with_many_nodes_closed_and_opens_a_wide_container() -> None:
    """An LSTM's unrolled steps are many nodes of one leaf module, cut into chunks: the module-level view
    opened it as if the chunks were sub-modules. A container of many sub-modules, chunked, still opens."""
    nodes = [_op(i, "model.lstm", "lstm_step") for i in range(120)] + [_op(120, "model.head", "addmm")]
    edges = tuple(GraphEdge(f"n{i}", f"n{i + 1}") for i in range(len(nodes) - 1))
    mods = (ModuleInfo("model", "Net"), ModuleInfo("model.lstm", "LSTM", "model"),
            ModuleInfo("model.head", "Linear", "model"))
    data = GraphData(nodes=tuple(nodes), edges=edges, modules=mods, title="rnn")
    hier = pg.build_hierarchy(data)
    assert any(g.kind == "chunk" and g.parent == "m:model.lstm" for g in hier.groups.values())
    opened = pg.expand_modules(hier)
    assert "m:model" in opened and "m:model.lstm" not in opened
    assert _shown(data, hier, opened) == {"m:model.lstm", "m:model.head"}
    wide = [_op(i, f"model.layers.{i}", "addmm") for i in range(120)]
    wide_mods = (ModuleInfo("model", "Net"), ModuleInfo("model.layers", "Sequential", "model"),
                 *(ModuleInfo(f"model.layers.{i}", "Linear" if i % 2 else "ReLU", "model.layers") for i in range(120)))
    wide_data = GraphData(nodes=tuple(wide), edges=tuple(GraphEdge(f"n{i}", f"n{i + 1}") for i in range(119)),
                          modules=wide_mods, title="wide")
    wide_hier = pg.build_hierarchy(wide_data)
    assert "m:model.layers" in pg.expand_modules(wide_hier)


def test_a_nanwatch_birth_is_marked_by_sequence_number_else_only_on_the_very_model() -> None:
    from torch_nbdebug.data.nanwatch import NanEvent
    from torch_nbdebug.process.graph_nanwatch import birth_origin, mark_nan_birth

    nodes = (GraphNode(id="n0", kind="op", label="mm", op="MmBackward0", module="model.fc", seq=7),
             GraphNode(id="n1", kind="op", label="log", op="LogBackward0", module="model.head", seq=8),
             GraphNode(id="n2", kind="param", label="model.fc.weight", module="model.fc"))
    data = GraphData(nodes=nodes, edges=(GraphEdge("n0", "n1"),))
    by_seq = NanEvent(phase="backward", op="LogBackward0", kind="nan", sequence_nr=8, node_name="LogBackward0")
    marked = mark_nan_birth(data, by_seq, same_model=False, origin="%%nanwatch, In [4]")
    assert [n.id for n in marked.nodes if n.nan] == ["n1"] and marked.nan_from == "%%nanwatch, In [4]"
    assert marked.edges == data.edges and not any(n.nan for n in data.nodes)  # a new graph; the old one as it was
    by_module = NanEvent(phase="forward", op="aten.log.default", kind="inf", module="model.head")
    assert mark_nan_birth(data, by_module, same_model=False, origin="x") is data  # another model: never marked
    again = mark_nan_birth(data, by_module, same_model=True, origin="x")  # the very model, run again
    assert [n.id for n in again.nodes if n.nan] == ["n1"]
    assert birth_origin("/tmp/ipykernel_1/9.py", None) == "%%nanwatch, a notebook cell"
    assert birth_origin("/home/me/train.py", None) == "%%nanwatch, train.py"
    assert birth_origin("", 3) == "%%nanwatch, In [3]"
