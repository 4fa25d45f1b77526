"""A run's report across ranks: the findings first (first birth, sent/received, hang, ranks that died,
memory per rank), then each rank's own view — the same text, static HTML and widget as in a notebook."""
from __future__ import annotations

from typing import Any, Optional

from torch_nbdebug.render.html import bad, esc, muted, table

__all__ = ["run_text", "run_html", "run_widget", "page", "finding_lines"]


def _mib(n: int) -> str:
    return f"{n / 2 ** 20:.1f} MiB"


def _where(entry: dict[str, Any]) -> str:
    return f"line {entry['line']} of {entry['file']}" if entry.get("line") else "no line of yours"


def _collective(entry: dict[str, Any]) -> str:
    what = f"DDP's all-reduce of gradient bucket {entry['bucket']}" if entry.get("bucket") is not None \
        else f"{entry['op']} #{entry['seq']}"
    return f"{what} at step {entry['step']} ({_where(entry)})"


def finding_lines(doc: dict[str, Any]) -> list[str]:
    """The findings as sentences, most important first (the terminal summary and the report's header)."""
    f = doc["findings"]
    lines = [f"torch_nbdebug {doc['tool']}: {f['world_size']} rank{'s' if f['world_size'] != 1 else ''}"]
    first = f.get("first")
    if first is not None:
        e = first["event"]
        where = f", line {e['lineno']} of {e['filename']}" if e.get("lineno") else ""
        lines.append(f"first NaN/Inf: rank {first['rank']}, step {first['step']}, {e['title']}{where}")
    elif doc["tool"] == "nanwatch" and not f.get("sent"):
        lines.append("no NaN/Inf was born on any rank")
    for s in f.get("sent") or ():
        senders = ", ".join(str(r) for r in s["senders"])
        recv = ", ".join(str(r) for r in s["receivers"]) or "none"
        lines.append(f"rank {senders} sent {s['sent_nonfinite']} non-finite values into {_collective(s)}; "
                     f"rank{'s' if len(s['receivers']) != 1 else ''} {recv} only received them")
    hang = f.get("hang")
    if hang is not None:
        waiting = ", ".join(str(r) for r in hang["waiting"])
        waited = f"waited {hang['waited_s']}s" if hang.get("waited_s") is not None else "failed waiting"
        lines.append(f"hang: rank {waiting} {waited} in collective #{hang['seq']}, {_collective(hang)}, "
                     f"shapes {hang.get('shapes')}")
        fr = hang.get("flight_recorder")
        if fr:
            lines.append(f"  Flight Recorder: {fr['profiling_name']} #{fr['collective_seq_id']} {fr['state']}, "
                         f"inputs {fr.get('input_sizes')}")
        lines.extend(f"  missing: {m['why']}" for m in hang["missing"])
    for d in f.get("died") or ():
        lines.append(f"rank {d['rank']} died: {d['why']}")
    mem = f.get("memory")
    if mem is not None:
        peaks = ", ".join(f"rank {r}: {_mib(b)}" for r, b in mem["peaks"].items())
        ratio = f" ({mem['imbalance_ratio']:.2f}x)" if mem.get("imbalance_ratio") else ""
        lines.append(f"peak memory per rank: {peaks}; imbalance {_mib(mem['imbalance_bytes'])}{ratio}, "
                     f"highest on rank {mem['max_rank']}")
    for part in doc["ranks"]:
        if part["status"] in ("raised", "hung"):
            lines.append(f"rank {part['rank']} {part['status']}: {part.get('error')}")
        lines.extend(f"rank {part['rank']}: {note}" for note in part.get("notes") or ())
    return lines


def _stacks_text(part: dict[str, Any]) -> list[str]:
    out = []
    for stack in part.get("stacks") or ():
        out.append(f"  thread {stack['thread']}:")
        out.extend(f"    {fr['file']}:{fr['line']} in {fr['function']}: {fr['text']}" for fr in stack["frames"][-8:])
    return out


def run_text(doc: dict[str, Any], views: list[Optional[Any]]) -> str:
    lines = finding_lines(doc)
    for part, view in zip(doc["ranks"], views):
        lines.append("")
        lines.append(f"== rank {part['rank']} ({part['status']}, {part['steps']} optimizer steps, "
                     f"{part['collectives_total']} collectives) ==")
        if part.get("stacks"):
            lines.append("Python stacks:")
            lines.extend(_stacks_text(part))
        lines.append(view.text() if view is not None else "(no report: the rank did not finish)")
    return "\n".join(lines)


def run_html(doc: dict[str, Any], views: list[Optional[Any]]) -> str:
    head = "".join(f"<li>{esc(line)}</li>" for line in finding_lines(doc)[1:])
    f = doc["findings"]
    rows = [(esc(p["rank"]), esc(p["status"]) if p["status"] in ("finished",) else bad(esc(p["status"])),
             esc(p["steps"]), esc(p["collectives_total"]), esc(p.get("error") or ""))
            for p in doc["ranks"]]
    parts = [f"<h3>torch_nbdebug {esc(doc['tool'])}: {esc(f['world_size'])} ranks</h3>",
             f"<ul>{head}</ul>" if head else "",
             table(("rank", "status", "optimizer steps", "collectives", "error"), rows, numeric=(0, 2, 3))]
    views_html = []
    for part, view in zip(doc["ranks"], views):
        one = [f"<h3>rank {esc(part['rank'])}</h3>"]
        if part.get("stacks"):
            one.append("<pre>" + esc("\n".join(_stacks_text(part))) + "</pre>")
        one.append(view.html() if view is not None else muted("no report: the rank did not finish"))
        views_html.append("".join(one))
    if doc["tool"] == "cudamem":  # memory timelines side by side, one column per rank
        parts.append('<div style="display:flex;gap:1.5em;overflow-x:auto">'
                     + "".join(f'<div style="flex:0 0 auto">{v}</div>' for v in views_html) + "</div>")
    else:
        parts.extend(views_html)
    return "<div class=\"tnd-ranks\">" + "".join(parts) + "</div>"


def run_widget(doc: dict[str, Any], views: list[Optional[Any]]) -> Any:
    """A tab per rank (each rank's own widget), under the findings."""
    import ipywidgets

    tabs = ipywidgets.Tab(children=[_widget_of(v) for v in views])
    for i, part in enumerate(doc["ranks"]):
        tabs.set_title(i, f"rank {part['rank']}")
    header = ipywidgets.HTML("<ul>" + "".join(f"<li>{esc(x)}</li>" for x in finding_lines(doc)) + "</ul>")
    return ipywidgets.VBox([header, tabs])


def _widget_of(view: Optional[Any]) -> Any:
    import ipywidgets

    if view is None:
        return ipywidgets.HTML(muted("no report: the rank did not finish"))
    try:
        return view.widget()
    except ImportError:
        return ipywidgets.HTML(view.html())


def page(body: str, title: str) -> str:
    """A self-contained HTML page around a static view (no script, no external file)."""
    return (f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>{esc(title)}</title></head>"
            f"<body style=\"font-family:sans-serif\">{body}</body></html>\n")
