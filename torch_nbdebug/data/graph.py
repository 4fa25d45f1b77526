"""The computation graph as plain data: nodes, edges and the module tree (no live tensors).

A :class:`GraphData` is what the recorder hands to the processors and renderers: every autograd
node exactly once, with its op, output shape/dtype, module path and (after a backward) gradient
statistics; parameters and inputs as leaf nodes named the way the user writes them. It is frozen,
holds only strings and numbers, and round-trips through ``to_dict``/``from_dict`` and JSON.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Optional

from torch_nbdebug.data.stats import fmt_number

# Node kinds. "op" is an autograd Node (``AddmmBackward0``); "param" is a parameter's
# AccumulateGrad leaf; "input" any other leaf that requires grad; "output" the tensor graphed.
NODE_KINDS = ("op", "param", "input", "output")


@dataclass(frozen=True)
class SavedInfo:
    """One tensor (or value) an autograd node saved for backward: its shape/dtype, never the tensor."""

    name: str
    shape: Optional[tuple[int, ...]] = None
    dtype: Optional[str] = None
    value: Optional[str] = None  # non-tensor attributes (``dim=1``), already shortened

    def brief(self) -> str:
        if self.shape is not None:
            return f"{self.name}: {list(self.shape)} {self.dtype or ''}".rstrip()
        return f"{self.name} = {self.value}"


@dataclass(frozen=True)
class GradInfo:
    """Gradient statistics of a parameter (or node) after a backward."""

    norm: float
    min: Optional[float] = None
    max: Optional[float] = None
    mean: Optional[float] = None
    nonfinite: int = 0

    def brief(self) -> str:
        text = f"‖grad‖={fmt_number(self.norm)}"
        if self.min is not None and self.max is not None:
            text += f" [{fmt_number(self.min, 3)}, {fmt_number(self.max, 3)}]"
        if self.nonfinite:
            text += f" {self.nonfinite} non-finite"
        return text


@dataclass(frozen=True)
class GraphNode:
    """One node of the graph. ``id`` is stable within a GraphData (``n0``, ``n1``, ... by visit order)."""

    id: str
    kind: str
    label: str  # what the picture shows: op name, ``model.fc.weight``, ``x``
    op: str = ""  # the autograd class name (``AddmmBackward0``), ``AccumulateGrad`` or ""
    shape: Optional[tuple[int, ...]] = None
    dtype: Optional[str] = None
    module: Optional[str] = None  # qualified path of the module that created it, when known
    seq: Optional[int] = None  # autograd ``_sequence_nr()``: links to %%nanwatch events
    outputs: tuple[tuple[tuple[int, ...], str], ...] = ()  # every forward output (shape, dtype)
    saved: tuple[SavedInfo, ...] = ()
    grad: Optional[GradInfo] = None
    nan: bool = False  # the last %%nanwatch found the first NaN/Inf born here
    topo: int = 0  # position in a forward (data-flow) topological order
    aliases: tuple[str, ...] = ()  # every name of a tied parameter (``wte.weight``, ``lm_head.weight``)


@dataclass(frozen=True)
class GraphEdge:
    """Data flows from ``src`` to ``dst`` in the forward pass (the reverse of ``next_functions``)."""

    src: str
    dst: str


@dataclass(frozen=True)
class ModuleInfo:
    """A module on the path of some node: ``model.blocks.3`` with class ``Block``."""

    path: str
    type_name: str = ""
    parent: Optional[str] = None


@dataclass(frozen=True)
class GraphData:
    """The whole graph: plain, frozen, serialisable."""

    nodes: tuple[GraphNode, ...]
    edges: tuple[GraphEdge, ...]
    modules: tuple[ModuleInfo, ...] = ()
    title: str = "graph"
    source: str = "autograd"  # "recorded" when a forward ran under the recorder, "inferred" otherwise
    notes: tuple[str, ...] = ()
    truncated: bool = False
    nan_from: str = ""  # where the marked birth was found: "%%nanwatch, In [4]"
    _index: dict[str, GraphNode] = field(default_factory=dict, init=False, repr=False, compare=False)

    def node(self, node_id: str) -> GraphNode:
        """The node with this id (KeyError when absent)."""
        if not self._index:
            self._index.update((n.id, n) for n in self.nodes)
        return self._index[node_id]

    def ops(self) -> list[GraphNode]:
        return [n for n in self.nodes if n.kind == "op"]

    def params(self) -> list[GraphNode]:
        return [n for n in self.nodes if n.kind == "param"]

    def find(self, text: str, limit: int = 20) -> list[GraphNode]:
        """Nodes whose label, op or module contains ``text`` (case-insensitive), best matches first."""
        needle = text.strip().lower()
        if not needle:
            return []
        exact = [n for n in self.nodes if n.label.lower() == needle]
        rest = [n for n in self.nodes if n not in exact and (needle in n.label.lower() or needle in n.op.lower()
                                                              or needle in (n.module or "").lower())]
        return (exact + rest)[:limit]

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for n in self.nodes:
            counts[n.kind] = counts.get(n.kind, 0) + 1
        parts = [f"{counts.get('op', 0):,} autograd nodes", f"{counts.get('param', 0):,} parameters"]
        if counts.get("input"):
            parts.append(f"{counts['input']:,} inputs")
        parts.append(f"{len(self.edges):,} edges")
        if self.modules:
            parts.append(f"{len(self.modules):,} modules")
        return f"{self.title}: " + ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "title": self.title, "source": self.source, "notes": list(self.notes), "truncated": self.truncated,
            "nan_from": self.nan_from, "nodes": [_node_dict(n) for n in self.nodes],
            "edges": [[e.src, e.dst] for e in self.edges],
            "modules": [asdict(m) for m in self.modules],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GraphData":
        return cls(
            nodes=tuple(_node_from(d) for d in data["nodes"]),
            edges=tuple(GraphEdge(s, d) for s, d in data["edges"]),
            modules=tuple(ModuleInfo(**m) for m in data.get("modules", ())),
            title=data.get("title", "graph"), source=data.get("source", "autograd"),
            notes=tuple(data.get("notes", ())), truncated=bool(data.get("truncated", False)),
            nan_from=str(data.get("nan_from", "")),
        )

    @classmethod
    def from_json(cls, text: str) -> "GraphData":
        return cls.from_dict(json.loads(text))


def _node_dict(node: GraphNode) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(GraphNode):
        value = getattr(node, f.name)
        if f.name == "saved":
            value = [asdict(s) for s in value]
        elif f.name == "grad":
            value = asdict(value) if value is not None else None
        elif f.name == "shape" and value is not None:
            value = list(value)
        elif f.name == "outputs":
            value = [[list(s), d] for s, d in value]
        elif f.name == "aliases":
            value = list(value)
        out[f.name] = value
    return out


def _node_from(d: dict[str, Any]) -> GraphNode:
    d = dict(d)
    d["shape"] = tuple(d["shape"]) if d.get("shape") is not None else None
    d["outputs"] = tuple((tuple(s), t) for s, t in d.get("outputs", ()))
    d["saved"] = tuple(SavedInfo(**{**s, "shape": tuple(s["shape"]) if s.get("shape") is not None else None})
                       for s in d.get("saved", ()))
    d["grad"] = GradInfo(**d["grad"]) if d.get("grad") else None
    d["aliases"] = tuple(d.get("aliases", ()))
    return GraphNode(**d)
