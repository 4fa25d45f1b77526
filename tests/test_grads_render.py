"""Static views and aggregates of a GradTrace built by hand (no model): heatmap, flow picture, flags."""
from __future__ import annotations

import base64
import io
import re
import struct
import time
import zlib

import numpy as np
import pytest

from torch_nbdebug.api.grads import GradReport
from torch_nbdebug.data.grads import FIELD, FIELDS, GradTrace, LayerInfo, ParamInfo
from torch_nbdebug.process.grads import layer_arrays, layer_for_module, norm_heatmap, step_flags
from torch_nbdebug.render import grads as render


def _trace(steps: int, layers: int, bins: int = 8, seed: int = 0) -> GradTrace:
    """Each layer a weight [4, 4] and a bias [4]; norms grow down the layers; finite statistics."""
    rng = np.random.default_rng(seed)
    params, infos = [], []
    for li in range(layers):
        infos.append(LayerInfo(f"m.l{li}", "Linear", (2 * li, 2 * li + 1)))
        params += [ParamInfo(f"m.l{li}.weight", li, (4, 4), "float32", 16, True),
                   ParamInfo(f"m.l{li}.bias", li, (4,), "float32", 4, True)]
    stats = np.zeros((steps, len(params), len(FIELDS)))
    stats[:, :, FIELD["has_grad"]] = 1
    scale = np.repeat(10.0 ** (np.arange(layers) / 10 - 2), 2)
    stats[:, :, FIELD["norm"]] = scale * (1 + 0.1 * rng.random((steps, len(params))))
    stats[:, :, FIELD["mean_abs"]] = stats[:, :, FIELD["norm"]] / 4
    stats[:, :, FIELD["max_abs"]] = stats[:, :, FIELD["norm"]] / 2
    stats[:, :, FIELD["param_norm"]] = 1.0
    stats[:, :, FIELD["update_ratio"]] = 1e-3
    stats[:, :, FIELD["dead_units"]] = np.nan
    hist = rng.integers(0, 5, (steps, len(params), bins)).astype(float)
    hist_range = np.tile(np.array([-1.0, 1.0]), (steps, len(params), 1))
    return GradTrace("m", tuple(params), tuple(infos), tuple(range(steps)), stats,
                     np.ones((steps, len(params)), bool), tuple(range(steps)), hist, hist_range, step_kind="optimizer")


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _figure(html: str, cls: str) -> tuple[bytes, str]:
    """The PNG and alt text of the static view's ``<img class="tnd-figure {cls}">``."""
    found = re.search(rf'<img class="tnd-figure {cls}" src="data:image/png;base64,([A-Za-z0-9+/=]+)" alt="([^"]*)"', html)
    assert found, f"no {cls} picture in the static view"
    return base64.b64decode(found.group(1)), found.group(2)


def _pixels_of(data: bytes, colour: str) -> int:
    """How many pixels of the PNG have exactly this #rrggbb colour."""
    from matplotlib.image import imread

    rgb = (imread(io.BytesIO(data), format="png")[..., :3] * 255).round().astype(int)
    want = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return int((rgb == want).all(axis=-1).sum())


def test_layer_aggregates_combine_parameters() -> None:
    trace = _trace(steps=2, layers=3)
    arrays = layer_arrays(trace)
    w, b = trace.stats[1, 2, FIELD["norm"]], trace.stats[1, 3, FIELD["norm"]]
    assert arrays["norm"][1, 1] == pytest.approx(np.hypot(w, b))
    assert arrays["rms"][1, 1] == pytest.approx(np.hypot(w, b) / np.sqrt(20))
    mean_abs = (trace.stats[1, 2, FIELD["mean_abs"]] * 16 + trace.stats[1, 3, FIELD["mean_abs"]] * 4) / 20
    assert arrays["mean_abs"][1, 1] == pytest.approx(mean_abs)
    assert arrays["update_ratio"][1, 1] == pytest.approx(1e-3)  # every parameter moved by 1e-3 of its norm


def test_growth_over_steps_is_flagged_as_exploding() -> None:
    trace = _trace(steps=6, layers=3)
    trace.stats[5, 4:6, FIELD["norm"]] *= 200  # layer 2 jumps 200-fold at the last step (growth ≥ 100×)
    flags = step_flags(trace, 5)
    assert [(f.kind, f.layer) for f in flags] == [("exploding", 2)]
    assert "its median over earlier steps" in flags[0].reason
    assert step_flags(trace, 4) == ()


def test_heatmap_png_has_one_pixel_per_cell_and_is_downsampled_for_long_runs() -> None:
    trace = _trace(steps=30, layers=5)
    assert _png_size(base64.b64decode(render.heatmap_png(norm_heatmap(trace)))) == (30, 5)
    assert render.heatmap_rgb(norm_heatmap(trace))[0].shape == (5, 30, 3)
    _, alt = _figure(render.html(trace, ()), "tnd-heatmap")
    assert "5 layers" in alt and "by 30 steps" in alt
    start = time.perf_counter()
    long = _trace(steps=1000, layers=40, bins=4)
    report = GradReport(long)
    page, view, text = report.html(), report.widget(), report.text()
    assert time.perf_counter() - start < 30  # seconds, on a busy shared machine: minutes would be a bug
    assert render.heatmap_rgb(norm_heatmap(long))[0].shape == (40, 400, 3)  # buckets of steps
    data, alt = _figure(page, "tnd-heatmap")
    assert "40 layers" in alt and "by 1000 steps" in alt and len(data) < 80_000
    assert len(view.flow) == 1000 * 40 * 4 * 4 and "1000 of 1000 optimizer steps" in text


def test_flow_plot_colours_flagged_layers_and_escapes_names() -> None:
    trace = _trace(steps=1, layers=3)
    trace.stats[0, 2:4, FIELD["norm"]] = 1e4  # layer 1: exploding
    trace = GradTrace(**{**trace.__dict__, "layers": (trace.layers[0], LayerInfo("m.<l1>", "Linear", (2, 3)),
                                                      trace.layers[2])})
    report = GradReport(trace)
    assert report.start_layer == 1
    colour = render.FLAG_COLOURS["exploding"]
    assert _pixels_of(render.flow_png(trace, 0, report.flags), colour) > 100  # its bar, in the flag's colour
    assert _pixels_of(render.flow_png(trace, 0, ()), colour) == 0  # unflagged: the usual blue only
    assert "#1 m.<l1> (exploding)" in render.flow_alt(trace, 0, report.flags)  # the picture says it in words
    page = render.html(trace, report.flags)
    _, alt = _figure(page, "tnd-flow")
    assert "#1 m.&lt;l1&gt; (exploding)" in alt and "<l1>" not in page


def test_png_rows_decode_to_the_colour_scale() -> None:
    grid = np.array([[1.0, 10.0, 100.0], [np.nan, 0.0, 1.0]])
    data = base64.b64decode(render.heatmap_png(grid))
    raw = zlib.decompress(data[data.index(b"IDAT") + 4:data.index(b"IEND") - 8])
    rows = [raw[i * 10 + 1:(i + 1) * 10] for i in range(2)]
    assert rows[0][:3] == bytes([68, 1, 84]) and rows[0][6:9] == bytes([253, 231, 37])  # low → high
    assert rows[1][:3] == b"\xff\xff\xff" and rows[1][3:6] == b"\xff\xff\xff"  # no gradient / zero: blank


def test_layer_for_module_maps_nanwatch_paths() -> None:
    trace = _trace(steps=1, layers=3)
    assert layer_for_module(trace, "m.l2") == 2
    assert layer_for_module(trace, "m.l1.act") == 1
    assert layer_for_module(trace, "m") == 0
    assert layer_for_module(trace, "other.l1") is None and layer_for_module(trace, None) is None


def test_the_text_table_shows_whole_layer_class_names() -> None:
    """``MultiheadAttention`` was cut to ``MultiheadAtt`` (a 12-character column)."""
    import torch
    from torch import nn

    from torch_nbdebug.api.grads import grads

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.attention(x, x, x)[0])

    block = Block()
    block(torch.randn(2, 3, 8)).sum().backward()
    text = grads(block, name="block").text()
    assert "MultiheadAttention " in text and "MultiheadAtt " not in text


def test_static_view_names_a_layer_as_the_widget_does() -> None:
    trace = _trace(steps=3, layers=3)
    page = render.html(trace, ())
    assert "Layer #" in page and re.search(r"Layer #\d \(\d/3\): <code>m\.l\d</code>", page), \
        "the static layer heading: layer #i (k/N), as the widget's panel and slider"


def test_numbers_are_written_as_the_statistics_write_them() -> None:
    """One rule in every view (issue 26, item 4): plain from 1e-3 up to 1e5, an exponent outside.
    %%grads wrote 1024 as 1.02e+03 in text and static HTML but 1.5e20 as 150000000000000000000 in the widget."""
    from torch_nbdebug.data.stats import fmt_number

    for v in (1024.0, 12345.6, 99999.0, 1.5e20, -5.136e21, 0.00123, 0.000123, 3e-9, 0.0, float("inf")):
        assert render.fmt(v) == fmt_number(v), v
    assert render.fmt(1024.0) == "1024" and render.fmt(1.5e20) == "1.5e+20" and render.fmt(2.5e-4) == "2.5e-04"
    assert render.fmt(None) == "—" and render.fmt(float("nan")) == "—" and render.fmt(3e5, approx=True) == "≈3e+05"
    trace = _trace(steps=2, layers=3)
    trace.stats[:, :, FIELD["max_abs"]] = 8.125e19
    trace.stats[:, :, FIELD["update_ratio"]] = 123456.0
    text = render.text(trace, ())
    assert "8.125e+19" in text and "1.235e+05" in text and "81250000000000000000" not in text
    row = text.splitlines()[2]  # the columns line up under their headings however long the number
    head = text.splitlines()[1]
    assert row.index("8.125e+19") + len("8.125e+19") == head.index("max|g|") + len("max|g|")
    page = render.html(trace, ())
    assert "8.125e+19" in page and "1.235e+05" in page
    # the wide tables scroll in their own box, so the pictures and headings stay put in a ~500 px panel
    assert page.count('<div class="scroll"><table') == 2 and '<div class="scroll"><table class="tnd-grads-layers"' in page
