"""%cudamem views: text, static PNG/HTML (escaped, self-contained), widget state and zoom, magics."""
from __future__ import annotations

import gc
import io
import json
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from torch_nbdebug.api.memory import MemoryTimeline, memory_state, memory_timeline
from torch_nbdebug.data.memory import Allocation, MemoryRecording
from torch_nbdebug.process.memory import build_timeline
from torch_nbdebug.render.bundle import WIDGET_MIME
from torch_nbdebug.render.memory import PHASE_COLORS, StateView, TimelineView, fmt_bytes, timeline_png


def hostile_timeline() -> MemoryTimeline:
    allocs = (Allocation(0, 4096, (1024,), "float32", "activations", "forward", 0, None,
                         module="model.<b>blk</b>", holder="cache['<script>alert(1)</script>']"),
              Allocation(1, 1 << 20, (262144,), "float32", "temporaries", "backward", 1, 2))
    rec = MemoryRecording(device="cpu", allocations=allocs, events=np.array([0, 1, -2]),
                          event_time_ns=np.array([1, 2, 3]), event_phase=np.array([1, 2, 2], np.int8),
                          iteration_starts=(0,))
    return MemoryTimeline.from_data(build_timeline(rec))


def _colours(data: bytes) -> set[str]:
    """The #rrggbb colours of a PNG's pixels."""
    from matplotlib.image import imread

    rgb = (imread(io.BytesIO(data), format="png")[..., :3] * 255).round().astype(int).reshape(-1, 3)
    return {"#%02x%02x%02x" % tuple(c) for c in np.unique(rgb, axis=0)}


def test_fmt_bytes() -> None:
    assert [fmt_bytes(v) for v in (0, 1023, 1536, 5 << 20, 3 << 30)] == ["0 B", "1023 B", "1.5 KiB", "5.0 MiB", "3.0 GiB"]


def test_html_is_escaped_and_self_contained() -> None:
    tl = hostile_timeline()
    html = tl.html()
    assert "<script>alert" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<b>blk" not in html
    assert "<svg" not in html and "<style" not in html and "http://" not in html  # sanitizers strip svg/style
    assert 'alt="memory timeline: ' in html and "peak 1.0 MiB at event" in html  # the picture, in words
    pixels = _colours(timeline_png(tl))
    assert {PHASE_COLORS["forward"], PHASE_COLORS["backward"]} <= pixels  # both phases shaded


def test_mime_bundle_has_text_html_and_widget() -> None:
    tl = hostile_timeline()
    data = tl._repr_mimebundle_()
    assert set(data) == {"text/plain", "text/html", WIDGET_MIME}
    assert data["text/plain"].startswith("memory timeline (cpu): peak 1.0 MiB")


def test_widget_zoom_recomputes_the_visible_window() -> None:
    with memory_timeline({}, device="cpu") as tl:
        for _ in range(200):
            a = torch.ones(100)
            b = a * 2
    view = TimelineView(tl, max_points=50)
    n = len(tl.steps)
    assert view.view["lo"] == 0 and view.view["hi"] == n - 1 and len(ints(view.view["steps"])) <= 52
    json.dumps(view.meta), json.dumps(view.view)  # synced state is plain JSON
    view.x_range = [100, 140]
    assert view.view["lo"] == 100 and view.view["hi"] == 140
    assert ints(view.view["steps"]) == list(range(100, 141))
    assert view.view["local_peak"]["step"] in range(100, 141)
    view.x_range = [-5, 10 ** 9]  # out of range: clamped
    assert view.view["lo"] == 0 and view.view["hi"] == n - 1


def ints(text: str) -> list[int]:
    """What memory.js's ``ints`` reads from a series the kernel sent (differences, ``d*n`` for runs)."""
    out, x = [], 0
    for token in text.split(",") if text else []:
        d, _, n = token.partition("*")
        for _ in range(int(n or 1)):
            x += int(d)
            out.append(x)
    return out


def test_series_are_sent_as_runs_of_differences() -> None:
    from torch_nbdebug.process.memory import window
    from torch_nbdebug.render.memory import deltas

    for values in ([], [7], [5, 5, 5, 5, 9, 9, 2, -3, 1 << 40, 0], list(range(0, 3000, 3))):
        assert ints(deltas(values)) == values
    assert deltas([0, 4096, 4096, 4096, 4096, 0]) == "0,4096,0*3,-4096"
    assert deltas(range(1000)) == "0,1*999"  # a step-shaped series is a few characters
    with memory_timeline({}, device="cpu") as tl:
        for _ in range(50):
            a = torch.ones(100)
            b = a * 2
    view, plain = TimelineView(tl).view, window(tl, 0, len(tl.steps) - 1, 1200)
    assert ints(view["steps"]) == plain["steps"] and [ints(s) for s in view["series"]] == plain["series"]
    assert [t / 1e6 for t in ints(view["time_us"])] == pytest.approx(plain["time_s"], abs=5.1e-5)  # to 0.1 ms
    assert len(json.dumps(view["series"])) < len(json.dumps(plain["series"])) / 4
    assert json.loads(view["phases"]) == plain["phases"]
    shown = json.loads(view["local_peak"]["allocations"])
    assert len(shown) == len(plain["local_peak"]["allocations"]) and all("address" not in a for a in shown)
    assert [a["nbytes"] for a in shown] == [a["nbytes"] for a in plain["local_peak"]["allocations"]]


def test_state_widget_and_text() -> None:
    gc.collect()
    model = nn.Linear(4, 4)
    st = memory_state({"model": model}, device="cpu", top=1000)
    data = st._repr_mimebundle_()
    assert WIDGET_MIME in data and "model.weight" in data["text/plain"] and "model.weight" in data["text/html"]
    assert StateView(st).meta["state"]["top"] == [t.to_dict() for t in st.top]


@pytest.fixture
def shell() -> Any:
    from IPython.testing.globalipapp import get_ipython

    from torch_nbdebug.magics.memory import MAGICS

    ip = get_ipython()
    ip.register_magics(MAGICS)
    ip.user_ns.update({"torch": torch, "nn": nn})
    yield ip
    ip.magics_manager.magics["line"].pop("cudamem", None)
    ip.magics_manager.magics["cell"].pop("cudamem", None)
    for name in ("tl", "st", "losses", "model", "x", "out", "loss"):
        ip.user_ns.pop(name, None)


def test_cell_magic_returns_the_timeline_and_finds_the_leak(shell: Any) -> None:
    shell.user_ns["model"] = nn.Linear(8, 8)
    shell.user_ns["x"] = torch.randn(4, 8)
    tl = shell.run_cell_magic("cudamem", "-o --device cpu",
                              "losses = []\nfor i in range(4):\n    loss = model(x).sum()\n    losses.append(loss)\n")
    assert isinstance(tl, MemoryTimeline)
    assert tl.leaks and tl.leaks[0].holder == "losses" and tl.leaks[0].has_graph
    assert tl.leaks[0].line is not None and tl.leaks[0].line.text == "loss = model(x).sum()"


def test_line_magic_state(shell: Any) -> None:
    shell.user_ns["losses"] = [torch.ones(10) for _ in range(3)]
    st = shell.run_line_magic("cudamem", "-o --device cpu --top 50")
    assert any(t.name == "losses[2]" for t in st.top)


def test_magic_errors_and_export(shell: Any, tmp_path: Any) -> None:
    from IPython.core.error import UsageError

    with pytest.raises(UsageError):
        shell.run_line_magic("cudamem", "--device tpu")
    with pytest.raises(UsageError):
        shell.run_line_magic("cudamem", "--bogus")
    with pytest.raises(UsageError, match="need a cell"):
        shell.run_line_magic("cudamem", "--export x.pickle")
    path = tmp_path / "snap.pickle"
    shell.run_cell_magic("cudamem", f"--device cpu --export {path}", "y = torch.ones(100)\n")
    import pickle

    snap = pickle.loads(path.read_bytes())
    assert snap["device_traces"][0][0]["action"] == "alloc"
    with pytest.raises(UsageError, match="cannot write"):
        shell.run_cell_magic("cudamem", f"--device cpu --export {tmp_path}/no/such/dir/s.pickle", "y = 1\n")


def test_cell_magic_reraises_the_users_error(shell: Any) -> None:
    with pytest.raises(ZeroDivisionError):
        shell.run_cell_magic("cudamem", "--device cpu", "t = torch.ones(5)\n1 / 0\n")


def test_extension_cell_shows_text_html_and_widget(ipython: Any) -> None:
    from IPython.utils.capture import capture_output

    ipython.user_ns.update({"torch": torch})
    with capture_output() as cap:
        result = ipython.run_cell("%%cudamem --device cpu\nkeep = torch.ones(256)\n")
    assert result.success
    shown = [o.data for o in cap.outputs]
    assert len(shown) == 1
    assert {"text/plain", "text/html", WIDGET_MIME} <= set(shown[0])
    assert "1.0 KiB" in shown[0]["text/plain"] and '<img class="tnd-figure tnd-memory-figure"' in shown[0]["text/html"]
    ipython.user_ns.pop("keep", None)
    with capture_output() as cap:
        ipython.run_cell("%cudamem --device cpu --top 3")
    assert cap.outputs and "memory now (cpu)" in cap.outputs[0].data["text/plain"]


def test_notebook_cell_lines_read_as_cell_lines() -> None:
    from torch_nbdebug.data.source import SourceLine
    from torch_nbdebug.render.memory import where

    assert where(SourceLine("/tmp/ipykernel_42/123.py", 3, "<module>", "x = f()")) == "cell line 3: x = f()"
    assert where(SourceLine("train.py", 7, "main", "y = g()")) == "train.py:7 in main(): y = g()"
