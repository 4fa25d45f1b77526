"""Two profiles side by side: which category, module and line got slower or faster, and the verdicts."""
from __future__ import annotations

from torch_nbdebug.data.profile import CATEGORIES, Change, Comparison, LineRow, ProfileData
from torch_nbdebug.data.source import is_cell_file

MAX_CHANGES = 10


def line_key(row: LineRow) -> str:
    """How a line is matched across runs: a cell's text (its cell number changes when it is rerun), a
    file's place."""
    line = row.line
    if is_cell_file(line.filename) or line.cell is not None:
        return f"{line.text}  ({line.function})" if line.function != "<module>" else line.text
    return f"{line.filename}:{line.lineno}: {line.text}"


def compare(before: ProfileData, after: ProfileData) -> Comparison:
    categories = tuple(Change("category", c, before.mean(c), after.mean(c)) for c in CATEGORIES)
    modules = _changes("module", {m.path: m.ms for m in before.modules}, {m.path: m.ms for m in after.modules})
    lines = _changes("line", _line_ms(before), _line_ms(after))
    return Comparison(before.step_ms, after.step_ms, before.verdict.kind, after.verdict.kind, categories, modules,
                      lines)


def _line_ms(data: ProfileData) -> dict[str, float]:
    out: dict[str, float] = {}
    for row in data.lines:
        key = line_key(row)
        out[key] = out.get(key, 0.0) + row.ms
    return out


def _changes(kind: str, before: dict[str, float], after: dict[str, float]) -> tuple[Change, ...]:
    names = list(dict.fromkeys([*before, *after]))
    rows = [Change(kind, n, before.get(n, 0.0), after.get(n, 0.0)) for n in names]
    rows.sort(key=lambda c: -abs(c.delta_ms))
    return tuple(rows[:MAX_CHANGES])
