"""What a person sees in the static views: honest empty states, folded long cells, round axis ticks,
NaN/Inf cells that stand out, counts as whole numbers, and the shared stylesheet in every widget."""
from __future__ import annotations

import re

import base64
import zlib

import numpy as np

from torch_nbdebug.data.nanwatch import LayerStats, NanEvent, NanSummary
from torch_nbdebug.render import grads as grads_render
from torch_nbdebug.render.grads import GradsView, fmt_count, heatmap_png
from torch_nbdebug.render.graph import GraphWidget
from torch_nbdebug.render.html import static_text
from torch_nbdebug.render.memory import StateView, TimelineView, nice_ticks
from torch_nbdebug.render.nanwatch import NanView, report_html, report_text, source_window
from torch_nbdebug.render.widget import compact_css, unpack


def test_clean_report_is_green_only_when_the_data_supports_it() -> None:
    assert 'class="card ok"' in report_html(NanSummary(ops_checked=5))
    unchecked = report_html(NanSummary(ops_checked=0, notes=("could not check aten.mm",)))
    assert 'class="card caution"' in unchecked and "no op or module output was checked" in unchecked
    # Replay and module mode check a model's ops through its module calls: that is not "nothing checked".
    by_modules = NanSummary(ops_checked=0, layers=(LayerStats("model.fc", 2, fwd_finite=True),
                                                   LayerStats("model", 2, fwd_finite=True)))
    assert 'class="card ok"' in report_html(by_modules) and "0 ops and 4 module calls checked" in report_html(by_modules)
    assert report_text(by_modules) == "nanwatch: no NaN/Inf born (0 ops and 4 module calls checked, mode=op)"
    leaked = NanSummary(ops_checked=9, layers=(LayerStats("model.fc", 1, fwd_finite=False),))
    assert 'class="card ok"' not in report_html(leaked) and "not caught" in report_text(leaked)


def test_long_cell_is_folded_around_the_birth_line() -> None:
    assert source_window(10, 1, 5) == (0, 10)  # short cells stay whole
    lo, hi = source_window(100, 1, 50)
    assert (lo, hi) == (43, 56)  # CONTEXT_LINES either side of line 50
    src = "\n".join(f"x{i} = {i}" for i in range(1, 101))
    event = NanEvent(phase="forward", op="aten.log.default", kind="nan", filename="<cell>", lineno=50, line="x50 = 50")
    html = report_html(NanSummary(events=(event,), cell_source=src, source_first_line=1, ops_checked=1))
    assert "… 43 lines above" in html and "… 44 lines below" in html and "x1 = 1" not in html
    # the birth line is marked by ▶ and bold, and lines are separated by real line breaks, so the
    # listing reads the same where no stylesheet applies (an untrusted notebook, nbconvert)
    pre = re.search(r'<pre class="cell nw-source">(.*?)</pre>', html, re.S)
    assert pre is not None
    lines = re.sub(r"<[^>]+>", "", pre.group(1)).split("\n")
    assert lines[0] == "… 43 lines above" and lines[-1] == "… 44 lines below"
    assert lines[1:-1] == [(f"▶{i:>3}" if i == 50 else f" {i:>3}") + f"  x{i} = {i}" for i in range(44, 57)]
    assert re.search(r'<b class="line hl"[^>]*>▶ 50  x50 = 50</b>', html)


def test_memory_ticks_are_round_byte_values() -> None:
    assert nice_ticks(292 * 1024) == [0, 100 * 1024, 200 * 1024]
    assert nice_ticks(3.5 * 2 ** 30) == [k * 2 ** 30 for k in range(4)]
    assert nice_ticks(0) == [0.0]


def test_heatmap_marks_nan_and_inf_cells_red() -> None:
    grid = np.array([[1.0, np.nan, np.inf]])
    data = base64.b64decode(heatmap_png(grid, bad=np.array([[False, True, False]])))
    raw = zlib.decompress(data[data.index(b"IDAT") + 4:data.index(b"IEND") - 8])
    assert raw[4:7] == bytes([207, 34, 46]) and raw[7:10] == bytes([207, 34, 46])


def test_counts_are_whole_numbers() -> None:
    assert fmt_count(1024.0) == "1,024" and fmt_count(3.0, approx=True) == "≈3" and fmt_count(None) == "—"
    # statistics as data/stats.py writes them (issue 26 item 4: an exponent from 1e5 up or below 1e-3)
    assert grads_render.fmt(1024.0) == "1024"


def test_every_widget_loads_the_shared_stylesheet() -> None:
    shared = static_text("base.css")
    for view in (NanView, GradsView, GraphWidget, TimelineView, StateView):
        # the same rules as the static view, compacted, sent inside the packed module (issue 26 item 10)
        assert unpack(view._esm)[1] == compact_css(shared), view
