"""The tour shows every magic, and its "Where next" names every notebook."""
from __future__ import annotations

import re
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
TOUR = (NOTEBOOKS / "src" / "00_tour.py").read_text()
MAGICS = ("%%nanwatch", "%graph", "%%grads", "%%cudamem", "%%explain", "%%repro", "%%monitor", "%%profile")


def _code_cells(text: str) -> list[str]:
    return [c for c in re.split(r"^# %%.*$", text, flags=re.M) if c.strip() and not c.lstrip().startswith("#")]


def test_the_tour_runs_every_magic() -> None:
    firsts = [cell.strip().splitlines()[0] for cell in _code_cells(TOUR)]
    missing = [m for m in MAGICS if not any(line.split()[0] == m for line in firsts if line.split())]
    assert not missing, f"the tour runs no cell with {missing}"


def test_where_next_lists_every_notebook() -> None:
    where_next = TOUR[TOUR.index("## Where next"):TOUR.index("## Exercise")]
    numbers = sorted(p.name[:2] for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb") if not p.name.startswith("00"))
    assert numbers, "no notebooks found"
    unlisted = [n for n in numbers if f"**{n} · " not in where_next]
    assert not unlisted, f"'Where next' does not list notebooks {unlisted}"
