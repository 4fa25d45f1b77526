"""%graph: repeated blocks fold by structure (not by name), a tied embedding sits where it is used,
the first view is small enough to read, and edges keep clear of open groups' titles."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from torch_nbdebug.api.graph import graph
from torch_nbdebug.data.graph import GraphData, GraphEdge, GraphNode, ModuleInfo
from torch_nbdebug.process import graph as pg
from torch_nbdebug.process.graph_details import group_label
from torch_nbdebug.process.graph_layout import TITLE, layout


class Block(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.norm(h))


class NamedLayers(nn.Module):
    """Siblings named ``<stem><i>`` as attributes of the model itself, between an embed and a head."""

    def __init__(self, stem: str, n: int = 12, d: int = 8) -> None:
        super().__init__()
        self.stem, self.n = stem, n
        self.embed = nn.Linear(4, d)
        for i in range(n):
            self.add_module(f"{stem}{i}", Block(d))
        self.head = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for i in range(self.n):
            h = getattr(self, f"{self.stem}{i}")(h)
        return self.head(h)


class ViTLike(nn.Module):
    """torchvision's ViT naming: ``encoder.layers.encoder_layer_0..11`` in a Sequential."""

    def __init__(self, n: int = 12, d: int = 8) -> None:
        super().__init__()
        self.conv_proj = nn.Linear(4, d)
        self.encoder = nn.Module()
        self.encoder.layers = nn.Sequential()
        for i in range(n):
            self.encoder.layers.add_module(f"encoder_layer_{i}", Block(d))
        self.encoder.ln = nn.LayerNorm(d)
        self.heads = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.heads(self.encoder.ln(self.encoder.layers(self.conv_proj(x))))


class Stage(nn.Module):
    def __init__(self, c_in: int, c_out: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(c_in, c_out), *[nn.Linear(c_out, c_out) for _ in range(blocks - 1)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.blocks(x))


class ResNetStages(nn.Module):
    """ResNet's ``layer1..layer4``: one class, different widths and depths: four different things."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = Stage(4, 4, 2)
        self.layer2 = Stage(4, 8, 2)
        self.layer3 = Stage(8, 16, 3)
        self.layer4 = Stage(16, 16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer4(self.layer3(self.layer2(self.layer1(x))))


def _closed_groups(g) -> list[str]:
    return [i for i in g.shown() if i in g.hierarchy.groups]


@pytest.mark.parametrize("stem", ["layer", "h_", "block"])
def test_named_siblings_of_one_structure_fold_into_one_box(stem: str) -> None:
    model = NamedLayers(stem)
    g = graph(model, torch.randn(2, 4), names={"model": model})
    hier = g.hierarchy
    runs = [gid for gid, grp in hier.groups.items() if grp.kind == "repeat"]
    assert len(runs) == 1
    assert group_label(hier, runs[0]) == f"{stem}0..11 ×12 Block"
    assert [hier.groups[m].path for m in hier.items[runs[0]]] == [f"model.{stem}{i}" for i in range(12)]
    shown = g.shown()
    assert runs[0] in shown and not any(s.startswith(f"m:model.{stem}") for s in shown)
    assert len(shown) <= 8  # input, embed, the run, head, output
    vg, _ = g.expand(runs[0]).view()  # opens in place: the twelve blocks, already open at module level
    assert vg.items[runs[0]] == [f"m:model.{stem}{i}" for i in range(12)]
    assert f"m:model.{stem}5.mlp" in vg.items


def test_vit_encoder_layers_fold_whatever_their_naming() -> None:
    model = ViTLike()
    g = graph(model, torch.randn(2, 4), names={"model": model})
    layers = g.hierarchy.groups["m:model.encoder.layers"]
    assert layers.repeat == "encoder_layer_0..11 ×12 Block"
    assert group_label(g.hierarchy, "m:model.encoder.layers") == "layers.encoder_layer_0..11 ×12 Block"
    assert "m:model.encoder.layers" in g.shown() and len(g.shown()) <= 10
    _, lay = g.view()
    assert lay.height < 600 and lay.width < 900  # not a 957 x 22,618 px picture


def test_blocks_that_differ_in_structure_stay_apart() -> None:
    model = ResNetStages()
    g = graph(model, torch.randn(2, 4), names={"model": model})
    assert not any(grp.repeat for gid, grp in g.hierarchy.groups.items() if gid.count(".") <= 1)
    assert [gid for gid, grp in g.hierarchy.groups.items() if grp.kind == "repeat"] == []
    shapes = pg.structures(g.data, g.hierarchy)
    assert len({shapes[f"m:model.layer{i}"] for i in range(1, 5)}) == 4  # one class, four structures
    vg, _ = g.view()  # module level: the four stages open one after another, none folded away
    assert vg.items["m:model"] == [f"m:model.layer{i}" for i in range(1, 5)]
    assert all(f"m:model.layer{i}" in vg.items for i in range(1, 5))


def test_structure_not_names_decides_a_repeat() -> None:
    def block_nodes(b: int, width: int) -> list[GraphNode]:
        base = 3 * b
        return [GraphNode(id=f"n{base}", kind="param", label=f"m.blk{b}.fc.weight", op="AccumulateGrad",
                          shape=(width, 4), module=f"m.blk{b}.fc", topo=base),
                GraphNode(id=f"n{base + 1}", kind="op", label="mm", op="MmBackward0", module=f"m.blk{b}.fc",
                          topo=base + 1),
                GraphNode(id=f"n{base + 2}", kind="op", label="relu", op="ReluBackward0", module=f"m.blk{b}",
                          topo=base + 2)]

    def model(widths: list[int]) -> GraphData:
        nodes = [n for b, w in enumerate(widths) for n in block_nodes(b, w)]
        edges = [GraphEdge(f"n{3 * b}", f"n{3 * b + 1}") for b in range(len(widths))]
        edges += [GraphEdge(f"n{3 * b + 1}", f"n{3 * b + 2}") for b in range(len(widths))]
        edges += [GraphEdge(f"n{3 * b + 2}", f"n{3 * b + 4}") for b in range(len(widths) - 1)]
        mods = [ModuleInfo("m", "Net")] + [ModuleInfo(f"m.blk{b}", "Blk", "m") for b in range(len(widths))]
        mods += [ModuleInfo(f"m.blk{b}.fc", "Linear", f"m.blk{b}") for b in range(len(widths))]
        return GraphData(nodes=tuple(nodes), edges=tuple(edges), modules=tuple(mods))

    same = pg.build_hierarchy(model([8, 8, 8]))
    assert same.groups["m:m"].repeat == "blk0..2 ×3 Blk"
    differ = pg.build_hierarchy(model([8, 16, 8]))  # same class and names, another weight shape
    assert not any(g.repeat for g in differ.groups.values())
    run = pg.build_hierarchy(model([16, 8, 8]))  # the last two match: a run inside the container
    assert [g.label for g in run.groups.values() if g.kind == "repeat"] == ["blk1..2 ×2 Blk"]


class Body(nn.Module):
    def __init__(self, vocab: int, d: int, n: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(16, d)
        self.h = nn.ModuleList(Block(d) for _ in range(n))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class TinyGPT(nn.Module):
    """GPT-2's layout: ``lm_head.weight`` *is* ``transformer.wte.weight`` (tied input/output embedding)."""

    def __init__(self, vocab: int = 50, d: int = 8, n: int = 3) -> None:
        super().__init__()
        self.transformer = Body(vocab, d, n)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer(idx))


def test_tied_embedding_lookup_and_projection_belong_to_their_own_modules() -> None:
    torch.manual_seed(0)
    gpt = TinyGPT()
    idx = torch.randint(0, 50, (2, 5))
    loss = gpt(idx).logsumexp(-1).mean()
    g = graph(loss, names={"gpt": gpt, "loss": loss})  # not recorded: modules inferred from parameters
    assert g.data.source == "inferred"
    weight = next(n for n in g.data.nodes if n.kind == "param" and n.label == "gpt.transformer.wte.weight")
    assert weight.aliases == ("gpt.transformer.wte.weight", "gpt.lm_head.weight")
    users = {g.data.node(e.dst).label: g.data.node(e.dst) for e in g.data.edges if e.src == weight.id}
    assert users["embedding"].module == "gpt.transformer.wte"
    assert users["t"].module == "gpt.lm_head"
    mm = next(n for n in g.data.nodes if n.label == "mm")
    assert mm.module == "gpt.lm_head"
    g.expand("gpt.transformer.wte").expand("gpt.lm_head")
    _, lay = g.view()
    assert lay.boxes[users["embedding"].id].y < lay.boxes["m:gpt.transformer.h"].y < lay.boxes[mm.id].y
    assert GraphData.from_json(g.data.to_json()) == g.data  # aliases survive JSON
    assert g.details(weight.id)["aliases"] == ["gpt.lm_head.weight"]  # the panel names the tie


def test_gpt2_from_transformers_tied_embedding() -> None:
    transformers = pytest.importorskip("transformers", reason="needs the transformers package (optional)")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=16)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    idx = torch.randint(0, 64, (1, 6))
    loss = model(idx).logits.logsumexp(-1).mean()
    g = graph(loss, names={"model": model, "loss": loss})
    users = {g.data.node(e.dst).label: g.data.node(e.dst) for e in g.data.edges
             if g.data.node(e.src).label == "model.transformer.wte.weight"}
    assert users["embedding"].module == "model.transformer.wte"
    assert all(u.module == "model.lm_head" for label, u in users.items() if label != "embedding")
    assert g.hierarchy.groups["m:model.transformer.h"].repeat == "0..1 ×2 GPT2Block"


def test_notebook_03_stack_opens_as_one_repeated_box() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(8, 16)
            self.blocks = nn.ModuleList(Block(16) for _ in range(4))
            self.head = nn.Linear(16, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.embed(x)
            for block in self.blocks:
                h = block(h)
            return self.head(h)

    net = Net()
    g = graph(net, torch.randn(2, 5, 8), names={"net": net})
    assert "m:net.blocks" in g.shown()
    assert group_label(g.hierarchy, "m:net.blocks") == "blocks.0..3 ×4 Block"
    _, lay = g.view()
    # small enough to show whole at 100 % in the widget's 560-px port: labels at their full size
    assert lay.height + 16 <= 560 / 0.9 and lay.width + 16 <= 900


def _curve(points: tuple[tuple[float, float], ...], steps: int = 24) -> list[tuple[float, float]]:
    """Sample the drawn edge: cubic segments leaving and entering each point vertically (render's path)."""
    out = []
    for (x1, y1), (x2, y2) in zip(points, points[1:]):
        bend = max(8.0, abs(y2 - y1) / 2)
        c1, c2 = (x1, y1 + bend), (x2, y2 - bend)
        for k in range(steps + 1):
            t = k / steps
            a, b, c, d = (1 - t) ** 3, 3 * (1 - t) ** 2 * t, 3 * (1 - t) * t * t, t ** 3
            out.append((a * x1 + b * c1[0] + c * c2[0] + d * x2, a * y1 + b * c1[1] + c * c2[1] + d * y2))
    return out


def test_edges_do_not_cross_open_group_titles() -> None:
    # input -> [a long-named module holding a short op under its title] -> a nested module -> output
    long = "model.a_module_with_a_rather_long_name"
    nodes = (GraphNode(id="n0", kind="input", label="x", topo=0),
             GraphNode(id="n1", kind="op", label="mm", op="MmBackward0", module=long, topo=1),
             GraphNode(id="n2", kind="op", label="relu", op="ReluBackward0", module=long, topo=2),
             GraphNode(id="n3", kind="op", label="add", op="AddBackward0", module=f"{long}.inner_block", topo=3),
             GraphNode(id="n4", kind="op", label="tanh", op="TanhBackward0", module="model.tail", topo=4),
             GraphNode(id="n5", kind="op", label="sum", op="SumBackward0", module="model.tail.deeper", topo=5),
             GraphNode(id="out0", kind="output", label="loss", topo=6))
    edges = (GraphEdge("n0", "n1"), GraphEdge("n1", "n2"), GraphEdge("n2", "n3"), GraphEdge("n0", "n3"),
             GraphEdge("n3", "n4"), GraphEdge("n4", "n5"), GraphEdge("n3", "n5"), GraphEdge("n5", "out0"))
    data = GraphData(nodes=nodes, edges=edges)
    hier = pg.build_hierarchy(data)
    vg = pg.view(data, hier, pg.expand_all(hier))
    title_w = {gid: 6.8 * len(f"▾ {group_label(hier, gid)}") + 24 for gid in hier.groups}
    lay = layout(vg, lambda i: (60.0, 34.0), lambda gid: title_w[gid])
    frames = [b for b in lay.boxes.values() if b.kind == "cluster"]
    assert len(frames) == 5
    entering = 0
    for route in lay.routes:
        for x, y in _curve(route.points):
            for f in frames:  # the title's text: from x + 8, a line of 11-px text on the baseline y + 15
                text_end = f.x + title_w[f.id] - 16
                assert not (f.x + 6 <= x <= text_end and f.y + 4 <= y <= f.y + TITLE - 2), (route, f)
        entering += any(lay.boxes[route.dst].y > f.y > lay.boxes[route.src].y for f in frames)
    assert entering >= 3  # the check above saw edges that go into groups


def test_magic_on_a_loss_from_an_earlier_cell_infers_modules(ipython) -> None:
    # `%graph loss` records while it evaluates `loss`, which makes no node: the modules of the last
    # recorded forward (another model's) do not apply, so they are inferred from the parameters
    ipython.user_ns.update(gpt=TinyGPT(), torch=torch)
    ipython.run_cell("idx = torch.randint(0, 50, (2, 5))")
    ipython.run_line_magic("graph", "-o gpt --input idx")  # a recording of an earlier forward
    ipython.run_cell("loss = gpt(idx).logsumexp(-1).mean()")
    g = ipython.run_line_magic("graph", "-o loss")
    assert g.data.source == "inferred"
    weight = next(n.id for n in g.data.params() if n.label == "gpt.transformer.wte.weight")
    users = {g.data.node(e.dst).label: g.data.node(e.dst).module for e in g.data.edges if e.src == weight}
    assert users == {"embedding": "gpt.transformer.wte", "t": "gpt.lm_head"}
    assert next(n.module for n in g.data.ops() if n.label == "mm") == "gpt.lm_head"
    assert "m:gpt.transformer.h" in g.shown()  # the three blocks: one closed box


def test_a_models_loss_opens_on_its_module_overview_and_counts_say_what_they_count() -> None:
    from torch_nbdebug.render.graph import OPEN_H, OPEN_W

    torch.manual_seed(0)
    gpt = TinyGPT()
    loss = gpt(torch.randint(0, 50, (2, 5))).logsumexp(-1).mean()
    g = graph(loss, names={"gpt": gpt, "loss": loss})
    _, lay = g.view()
    # seen whole at a readable zoom (graph.js: 11-px labels at >= 10 px in a viewport of <= 760 px)
    assert lay.width * 10 / 11 <= 640 and lay.height * 10 / 11 <= 760 - 12, (lay.width, lay.height)
    assert lay.width <= OPEN_W and lay.height <= OPEN_H
    # the structure, not the last few ops: the transformer is open, its blocks one closed box
    assert "m:gpt.transformer" in g.expanded and "m:gpt.transformer.h" in g.shown()
    assert any(g.data.node(i).kind == "output" for i in g.shown() if i not in g.hierarchy.groups)
    # a box counts what the header counts: autograd nodes
    inside = sum(1 for n in g.data.ops() if (n.module or "").startswith("gpt.transformer.h."))
    assert g.label("m:gpt.transformer.h")[1] == f"ModuleList · {inside} autograd nodes"
    assert f"{len(g.data.ops())} autograd nodes" in g.data.summary()
    assert g.details("m:gpt.transformer.h")["size"] == inside
