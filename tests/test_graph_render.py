"""%graph rendering and magics: static PNG in the bundle, SVG for the widget, escaping, DOT, widget messages,
real IPython."""
from __future__ import annotations

import base64
import html as html_lib
import re
import xml.etree.ElementTree as ET
from typing import Any

import pytest
import torch
from torch import nn

from torch_nbdebug.api.graph import GraphExplorer, graph
from torch_nbdebug.data.graph import GraphData, GraphEdge, GraphNode, ModuleInfo
from torch_nbdebug.render.bundle import WIDGET_MIME


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.ReLU()) for _ in range(3))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _svg(html: str) -> ET.Element:
    found = re.search(r"<svg.*</svg>", html, re.S)
    assert found, "no inline SVG in the static view"
    return ET.fromstring(found.group(0))  # well-formed XML: every name was escaped


def _picture(html: str) -> tuple[bytes, str]:
    """The static view's PNG picture and its alt text."""
    found = re.search(r'<img [^>]*src="data:image/png;base64,([^"]+)"[^>]*alt="([^"]*)"', html)
    assert found, "no PNG picture in the static view"
    data = base64.b64decode(found.group(1), validate=True)
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    return data, html_lib.unescape(found.group(2))


def test_bundle_has_text_static_picture_and_widget() -> None:
    net = Net()
    g = graph(net, torch.randn(2, 4), names={"net": net})
    data = g._repr_mimebundle_()
    assert set(data) == {"text/plain", "text/html", WIDGET_MIME}
    assert "autograd nodes" in data["text/plain"]
    assert "<svg" not in data["text/html"] and "<style" not in data["text/html"]  # sanitizers strip both
    _, alt = _picture(data["text/html"])
    assert "blocks" in alt and "head" in alt  # the closed boxes, named in the alt text
    boxes = re.search(r"<details>.*</details>", data["text/html"], re.S)
    assert boxes and "<code>net.blocks</code>" in boxes.group(0) and "net.blocks.0.0" not in boxes.group(0)
    svg = _svg(g.svg())  # the widget's view of the same layout
    ids = {el.get("data-id") for el in svg.iter() if el.get("data-id")}
    # module level: leaf modules as boxes, the three identical blocks as one closed box
    assert {"m:net.blocks", "m:net.head"} <= ids and "m:net.blocks.0.0" not in ids
    assert "m:net.blocks.0.0" in {el.get("data-id") for el in ET.fromstring(g.expand("net.blocks").svg()).iter()}
    assert "<script" not in data["text/html"] and "http://" not in data["text/html"]


def test_user_names_are_escaped_in_svg_html_and_dot() -> None:
    evil = "<b onload=alert(1)>&'\""
    nodes = (GraphNode(id="n0", kind="param", label=f"{evil}.w", op="AccumulateGrad", module=evil, topo=0),
             GraphNode(id="n1", kind="op", label=evil, op="X", module=evil, topo=1))
    data = GraphData(nodes=nodes, edges=(GraphEdge("n0", "n1"),), modules=(ModuleInfo(evil, evil),), title=evil)
    ex = GraphExplorer(data, expand="all")
    html = ex.html()
    assert "<b onload" not in html and "&lt;b onload=alert(1)&gt;" in html
    assert evil in _picture(html)[1]  # the alt text names it, escaped in the attribute
    _svg(ex.svg())
    assert 'label="' in ex.dot() and '\\"' in ex.dot()


def test_toggle_and_select_through_widget_messages() -> None:
    net = Net()
    g = graph(net, torch.randn(2, 4), names={"net": net}, expand=["net"])
    w = g.widget()
    assert 'data-id="m:net.blocks"' in w.svg.replace("'", '"')
    w._on_message(w, {"type": "toggle", "id": "m:net.blocks"}, [])
    assert "m:net.blocks.1" in g.shown() and "m:net.blocks" not in g.shown()
    assert 'data-id="m:net.blocks.1"' in w.svg.replace("'", '"')
    assert w.details["kind"] == "group"
    node = next(n for n in g.data.nodes if n.kind == "output")
    w._on_message(w, {"type": "select", "id": node.id}, [])
    assert w.details["id"] == node.id and w.selected == node.id
    w._on_message(w, {"type": "search", "q": "head.weight"}, [])
    assert w.matches and w.matches[0]["label"] == "net.head.weight"
    w._on_message(w, {"type": "reveal", "id": w.matches[0]["id"]}, [])
    assert w.matches[0]["id"] in g.shown()
    w._on_message(w, {"type": "toggle", "id": "m:net.blocks"}, [])  # click again: closed
    assert "m:net.blocks" in g.shown()


def test_dot_export_has_clusters_for_open_groups() -> None:
    net = Net()
    g = graph(net, torch.randn(2, 4), names={"net": net}, expand=["net", "net.blocks"])
    dot = g.dot()
    assert 'subgraph "cluster_m:net.blocks"' in dot and '"m:net.blocks.2"' in dot
    assert dot.count("->") == len(g.view()[0].edges)


def test_hundred_thousand_nodes_open_collapsed_quickly() -> None:
    import time

    n = 100_000
    nodes = tuple(GraphNode(id=f"n{i}", kind="op", label="mul", op="MulBackward0", topo=i) for i in range(n))
    data = GraphData(nodes=nodes, edges=tuple(GraphEdge(f"n{i}", f"n{i + 1}") for i in range(n - 1)))
    start = time.perf_counter()
    ex = GraphExplorer(data)
    html = ex.html()
    assert time.perf_counter() - start < 10
    assert len(ex.shown()) <= 48 and len(html) < 200_000


# --- magics through a real IPython shell -------------------------------------------------------

@pytest.fixture
def ip() -> Any:
    from IPython.testing.globalipapp import get_ipython

    from torch_nbdebug.magics.graph import MAGICS

    shell = get_ipython()
    shell.register_magics(MAGICS)
    shell.user_ns["torch"] = torch
    shell.user_ns["nn"] = nn
    shell.user_ns["Net"] = Net
    yield shell
    for kind, names in MAGICS.magics.items():
        for name in names:
            shell.magics_manager.magics[kind].pop(name, None)
    for k in ("net", "x", "loss", "g", "out", "y", "Net"):
        shell.user_ns.pop(k, None)


def test_magic_line_expression_records_modules(ip: Any) -> None:
    ip.run_cell("net = Net(); x = torch.randn(2, 4)")
    g = ip.run_line_magic("graph", "-o net(x).sum()")
    assert isinstance(g, GraphExplorer)
    assert {n.module for n in g.data.ops() if n.label == "addmm"} == {
        "net.blocks.0.0", "net.blocks.1.0", "net.blocks.2.0", "net.head"}
    assert g.data.title == "net(x).sum()"


def test_magic_cell_and_model_input(ip: Any) -> None:
    ip.run_cell("net = Net(); x = torch.randn(2, 4)")
    g = ip.run_cell_magic("graph", "-o", "y = net(x)\nloss = y.pow(2).mean()\nloss")
    assert g.data.source == "recorded" and "loss" in g.data.title
    assert {n.module for n in g.data.ops() if n.label == "relu"} == {"net.blocks.0.1", "net.blocks.1.1",
                                                                     "net.blocks.2.1"}
    later = ip.run_line_magic("graph", "-o loss")  # a later %graph knows the recorded modules
    assert later.data.source == "recorded"
    m = ip.run_line_magic("graph", "-o net --input x")
    assert "m:net.head" in m.shown()


@pytest.mark.parametrize("cell", ["loss = net(x).sum()", "y = net(x)\nloss = y.pow(2).mean()"])
def test_magic_cell_that_only_assigns_graphs_its_last_assigned_tensor(ip: Any, cell: str) -> None:
    """The model's output was a temporary (freed) or not the loss: the tensor the cell left in ``loss`` is
    what the user means (was "nothing to graph", or the model's output without the loss)."""
    ip.run_cell("net = Net(); x = torch.randn(2, 4)")
    g = ip.run_cell_magic("graph", "-o", cell)
    assert g.data.title == "graph of loss" and g.data.source == "recorded"
    assert {n.label for n in g.data.ops()} >= {"addmm", "relu", "sum" if "sum" in cell else "mean"}


def test_magic_cell_reraises_user_exception_and_cleans_up(ip: Any) -> None:
    ip.run_cell("net = Net()")
    with pytest.raises(ZeroDivisionError):
        ip.run_cell_magic("graph", "", "net(torch.randn(2, 4))\n1/0")


@pytest.mark.parametrize("line, message", [
    ("undefined_thing", "undefined_thing"),
    ("3 + 4", "needs a tensor with a grad_fn or an nn.Module"),
    ("torch.ones(3)", "has no grad_fn"),
    ("net --input torch.ones(3, 5)", "raised RuntimeError"),
    ("net", "give it example inputs"),
    ("", "needs a tensor expression"),
])
def test_magic_bad_input_is_a_usage_error(ip: Any, line: str, message: str) -> None:
    from IPython.core.error import UsageError

    ip.run_cell("net = Net()")
    with pytest.raises(UsageError, match=re.escape(message)):
        ip.run_line_magic("graph", line)


def test_graph_magic_through_load_ext(ipython: Any) -> None:
    """The same magic as users get it: ``%load_ext torch_nbdebug`` (the conftest ``ipython`` fixture)."""
    ipython.user_ns.update(torch=torch, Net=Net)
    ipython.run_cell("net = Net(); x = torch.randn(2, 4)")
    result = ipython.run_cell("%graph net --input x")
    assert result.success, result.error_in_exec
    g = ipython.run_line_magic("graph", "-o net(x).sum()")
    assert {"m:net.blocks", "m:net.head"} <= {gid for gid in g.hierarchy.groups}
    for name in ("net", "x", "Net"):
        ipython.user_ns.pop(name, None)


def test_expand_option_is_checked_and_opens_parents() -> None:
    from torch_nbdebug.errors import InputError

    net = Net()
    g = graph(net, torch.randn(2, 4), names={"net": net}, expand=["net.blocks.1"])
    assert {"m:net", "m:net.blocks", "m:net.blocks.1"} <= g.expanded
    assert "m:net.blocks.1.0" in g.shown()
    with pytest.raises(InputError, match="no module 'net.nope'.*net"):
        graph(net, torch.randn(2, 4), names={"net": net}, expand=["net.nope"])
    with pytest.raises(InputError, match="expand must be"):
        graph(net, torch.randn(2, 4), names={"net": net}, expand="everything")
    assert g.to_dict()["expanded"] == sorted(g.expanded)
