"""The report document: what crosses processes, as versioned JSON (DESIGN.md section 11).

One schema for a notebook's ``report.to_json()``, a script's ``DIR/report.json`` and each rank's
``DIR/rank-R.json``; :func:`read` loads any of them. Version 1::

    {"schema": "torch_nbdebug.report", "version": 1, "tool": "nanwatch" | "cudamem" | "grads",
     "world_size": N, "ranks": [RANK, ...], "findings": FINDINGS | null}

    RANK = {"rank", "world_size", "host", "pid", "argv",
            "status": "running" | "finished" | "raised" | "hung" | "terminated",
            "exit_code": int | null, "error": str | null (the exception, one line),
            "steps": optimizer steps completed, "updated": unix time of this write,
            "report": the tool's own to_dict() (NanSummary, MemoryTimeline, GradTrace) | null while running,
            "births": [{"step", "order", "event": NanEvent.to_dict()}] (nanwatch; written as they happen),
            "collectives": [COLLECTIVE, ...] (the last 64), "collectives_total": int,
            "sent": [COLLECTIVE, ...] (the first 16 collectives this rank sent non-finite values into),
            "hang": COLLECTIVE + {"waited_s", "flight_recorder": FR | null} | null,
            "stacks": [{"thread", "main", "frames": [...]}] | null,
            "notes": [str]}
    COLLECTIVE = {"seq" (1-based, per rank), "op" ("allreduce"), "aten", "step", "bucket" (DDP bucket index
                  in backward, else null), "shapes", "dtypes", "sent_nonfinite", "file", "line", "function",
                  "state": "waiting" | "issued" | "completed" | "failed", "started", "duration_s"}
                  (with --hang-timeout each Work is polled: "waiting" until it completes; without, "issued")

    FR = Flight Recorder's oldest collective not completed: {"collective_seq_id", "profiling_name" ("gloo:all_reduce"),
          "state", "input_sizes", "input_dtypes", "process_group", "timeout_ms", "is_p2p", "pg_status", "version"}

``findings`` is what :func:`torch_nbdebug.process.ranks.findings` worked out from the ranks (the first birth
across ranks, senders and receivers, missing ranks, ranks that died, memory per rank); it is rebuilt on load.
Writes are atomic (a temporary file in the same directory, then ``os.replace``): a reader sees the old or the
new document, never half of one.
"""
from __future__ import annotations

import json
import os
import pathlib
import tempfile
from typing import Any, Optional, Union

SCHEMA = "torch_nbdebug.report"
VERSION = 1
TOOLS = ("nanwatch", "cudamem", "grads", "profile")
STATUSES = ("running", "finished", "raised", "hung", "terminated")
REPORT_FILE = "report.json"
HTML_FILE = "report.html"


def rank_file(directory: Union[str, os.PathLike], rank: int) -> pathlib.Path:
    return pathlib.Path(directory) / f"rank-{rank}.json"


def rank_part(tool: str, rank: int, world_size: int, **values: Any) -> dict[str, Any]:
    """A rank's document with every key of the schema (``values`` override the defaults)."""
    part: dict[str, Any] = {"rank": rank, "world_size": world_size, "host": "", "pid": 0, "argv": [],
                            "status": "running", "exit_code": None, "error": None, "steps": 0, "updated": 0.0,
                            "report": None, "births": [], "collectives": [], "collectives_total": 0, "sent": [],
                            "hang": None, "stacks": None, "notes": []}
    part.update(values)
    return {"schema": SCHEMA, "version": VERSION, "tool": tool, "world_size": world_size, "ranks": [part],
            "findings": None}


def document(tool: str, ranks: list[dict[str, Any]], findings: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    world = max([r.get("world_size", 1) for r in ranks] + [1])
    return {"schema": SCHEMA, "version": VERSION, "tool": tool, "world_size": world,
            "ranks": sorted(ranks, key=lambda r: r["rank"]), "findings": findings}


def to_json(tool: str, report: dict[str, Any]) -> str:
    """A notebook result's ``to_dict()`` as a one-rank document (what its ``to_json()`` returns)."""
    import time

    doc = rank_part(tool, 0, 1, status="finished", report=report, updated=time.time())
    return json.dumps(doc, allow_nan=False, default=_plain)


def dumps(doc: dict[str, Any], encoded: Optional[dict[str, str]] = None) -> str:
    """``doc`` as JSON; ``encoded`` maps a key of its one rank to that value's JSON, encoded once before (a
    rank rewrites its file before every collective: its births are encoded only when they change)."""
    if not encoded:
        return json.dumps(doc, allow_nan=False, default=_plain)
    part = dict(doc["ranks"][0], **{key: f"\x00{key}\x00" for key in encoded})
    text = json.dumps(dict(doc, ranks=[part]), allow_nan=False, default=_plain)
    for key, value in encoded.items():
        text = text.replace(json.dumps(f"\x00{key}\x00"), value, 1)
    return text


def write_atomic(path: Union[str, os.PathLike], doc: dict[str, Any], encoded: Optional[dict[str, str]] = None) -> None:
    """Write ``doc`` as JSON to ``path`` (see :func:`dumps`): a temporary file beside it, then a rename."""
    path = pathlib.Path(path)
    text = dumps(doc, encoded)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _plain(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return str(value)


def check(doc: Any, source: str) -> dict[str, Any]:
    """``doc`` if it is a report document this version reads, else a ``ValueError`` saying why not."""
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ValueError(f"{source} is not a torch_nbdebug report (no \"schema\": \"{SCHEMA}\")")
    if doc.get("version") != VERSION:
        raise ValueError(f"{source} is a version {doc.get('version')} report; this torch_nbdebug reads version "
                         f"{VERSION}: load it with the torch_nbdebug that wrote it")
    if doc.get("tool") not in TOOLS:
        raise ValueError(f"{source} was written by an unknown tool {doc.get('tool')!r}")
    return doc


def read(path: Union[str, os.PathLike]) -> dict[str, Any]:
    """The document at ``path``: a report file, or a directory whose rank files are gathered (a rank that
    was still writing when it died is read from the last complete write it made)."""
    path = pathlib.Path(path)
    if path.is_dir():
        parts = sorted(path.glob("rank-*.json"))
        if not parts:
            if (path / REPORT_FILE).exists():
                return read(path / REPORT_FILE)
            raise FileNotFoundError(f"{path} holds no torch_nbdebug report (no {REPORT_FILE}, no rank-*.json)")
        docs = [read(p) for p in parts]
        tools = {d["tool"] for d in docs}
        if len(tools) > 1:
            raise ValueError(f"{path} holds rank files of different tools ({', '.join(sorted(tools))})")
        return document(docs[0]["tool"], [r for d in docs for r in d["ranks"]])
    if not path.exists():
        raise FileNotFoundError(f"no such report: {path}")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not a JSON report ({exc.msg} at line {exc.lineno})") from None
    if isinstance(doc, dict) and "schema" not in doc and {"fields", "params", "step_kind"} <= set(doc):
        return rank_part("grads", 0, 1, status="finished", report=doc)  # a bare GradTrace.to_json()
    return check(doc, str(path))
