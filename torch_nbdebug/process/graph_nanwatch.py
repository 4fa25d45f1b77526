"""Cross-feature: the first NaN/Inf birth a ``%%nanwatch`` found, marked on a graph (``%graph`` draws its
node red and says where the birth was found).

Pure: the caller hands over the birth (the last report's first event), whether the graph is of the very
model the watch saw, and the place the watch ran; nothing here reads another tool's state.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

from torch_nbdebug.data.graph import GraphData
from torch_nbdebug.data.nanwatch import NanEvent
from torch_nbdebug.data.source import is_cell_file

__all__ = ["birth_node", "birth_origin", "mark_nan_birth"]


def birth_origin(filename: str, cell: Optional[int]) -> str:
    """``%%nanwatch, In [4]`` (or the file's name): where the marked birth was found."""
    where = f"In [{cell}]" if cell is not None else \
        "a notebook cell" if is_cell_file(filename) else os.path.basename(filename)
    return "%%nanwatch" + (f", {where}" if where else "")


def birth_node(data: GraphData, event: NanEvent, same_model: bool) -> Optional[str]:
    """The op node the birth happened at: by its autograd sequence number (this graph is of the run
    the watch saw), else, for the very model run again (``same_model``), by its module and op."""
    seq, name = event.sequence_nr, event.node_name or ""
    module, op = event.module, str(event.op or "")
    ops = data.ops()
    if seq is not None:
        for n in ops:
            if n.seq == seq and (not name or n.op == name.rsplit("::", 1)[-1]):
                return n.id
    if not same_model:  # another run of another model: its module paths may match, its birth is not here
        return None
    short = op.split(".")[1] if op.startswith("aten.") and "." in op[5:] else op.split(".")[-1]
    for n in ops:
        if module and n.module == module and ((name and n.op == name) or (short and n.label == short)):
            return n.id
    return None


def mark_nan_birth(data: GraphData, event: NanEvent, same_model: bool, origin: str) -> GraphData:
    """``data`` with the birth's node marked (``nan``) and ``nan_from`` set to ``origin``; unchanged when
    the birth is not in this graph (a graph of another or a repaired model is not marked)."""
    target = birth_node(data, event, same_model)
    if target is None:
        return data
    nodes = tuple(dataclasses.replace(n, nan=True) if n.id == target else n for n in data.nodes)
    return dataclasses.replace(data, nodes=nodes, nan_from=origin)
