"""Every view's static HTML survives the sanitizers of notebooks nobody trusted (issue 10, part 1).

Two real policies, read from the installed packages rather than copied:

- JupyterLab's (a notebook opened without trusting it): its allowed tags and ``img``/global attributes
  are read from the installed JupyterLab bundle and applied with bleach; it strips ``<svg>`` and
  ``<style>``. The figures must stay ``<img>`` with a decodable PNG and an alt text, the key text
  (op names, module names, numbers) must stay readable.
- nbconvert's ``--HTMLExporter.sanitize_html=True`` (``nbconvert.filters.strings.clean_html``): it
  escapes every ``<img>`` into text, so committed notebooks split each output with
  ``render.bundle.split_figures``: the HTML pieces through ``clean_html`` keep the key text and
  show no image data or CSS as text; the pictures become ``image/png`` outputs.

The live widget view is not part of this: it needs a kernel. (The browser test
tests/browser/test_untrusted_browser.py opens the same views in JupyterLab and Chromium.)
"""
from __future__ import annotations

import base64
import functools
import html as html_lib
import io
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torch_nbdebug import graph, memory_state, memory_timeline, nanwatch, record_gradients, repro
from torch_nbdebug.api.explain import explain_exception
from torch_nbdebug.render.bundle import FIGURE, WIDGET_MIME, split_figures

bleach = pytest.importorskip("bleach", reason="needs bleach (a dependency of nbconvert)")


class AttentionWithAVeryLongDescriptiveName(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query_key_value_projection = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(torch.relu(self.query_key_value_projection(x)))


def _model() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), AttentionWithAVeryLongDescriptiveName(), nn.Linear(4, 1)), torch.randn(8, 4)


def _deep() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(16, 16), nn.Tanh())], nn.Linear(16, 2))


def _graph() -> Any:
    model, xb = _model()
    return graph(model(xb).sum(), names={"model": model})


def _nanwatch() -> Any:
    model, xb = _model()
    with nanwatch() as report:
        model(xb).sum().backward()  # sqrt's gradient at 0 is infinite: a birth in backward
    return report


def _memory() -> Any:
    deep = _deep()
    opt = torch.optim.SGD(deep.parameters(), lr=0.05)
    kept_losses = []
    with memory_timeline({"kept_losses": kept_losses}, device="cpu") as tl:
        for _ in range(3):
            loss = F.mse_loss(deep(torch.randn(64, 16)), torch.zeros(64, 2))
            opt.zero_grad()
            loss.backward()
            opt.step()
            kept_losses.append(loss)
    return tl


def _state() -> Any:
    big_activation_buffer = torch.ones(4096)
    return memory_state({"big_activation_buffer": big_activation_buffer}, device="cpu")


def _grads() -> Any:
    deep = _deep()
    opt = torch.optim.SGD(deep.parameters(), lr=0.05)
    with record_gradients(deep) as trace:
        for _ in range(4):
            opt.zero_grad()
            F.mse_loss(deep(torch.randn(32, 16)), torch.randn(32, 2)).backward()
            opt.step()
    return trace


def _repro() -> Any:
    return repro(lambda: torch.randn(4) * 2, restore_rng=False)


def _profile() -> Any:
    from torch_nbdebug import profile

    deep = _deep()
    opt = torch.optim.SGD(deep.parameters(), lr=0.05)
    with profile({"deep": deep}, steps=3) as prof:
        for _ in range(4):
            opt.zero_grad()
            F.mse_loss(deep(torch.randn(32, 16)), torch.randn(32, 2)).backward()
            opt.step()
    return prof


def _explain() -> Any:
    fc = nn.Linear(3072, 10)
    try:
        fc(torch.randn(2, 3, 32, 32))
    except RuntimeError as err:
        return explain_exception(err, namespace={"fc": fc})
    raise AssertionError("the shape mismatch did not raise")


# view -> (build the result, texts a reader must find, number of figures)
VIEWS: dict[str, tuple[Any, tuple[str, ...], int]] = {
    "graph": (_graph, ("graph of", "sqrt", "query_key_value_projection", "addmm"), 1),
    "nanwatch": (_nanwatch, ("Inf", "sqrt", "model.1", "Why / fix", "Per-layer activations"), 0),
    "memory_timeline": (_memory, ("peak", "activations saved for backward", "kept_losses", "Memory by category"), 1),
    "memory_state": (_state, ("memory now", "big_activation_buffer", "16.0 KiB"), 1),
    "grads": (_grads, ("Gradient flow", "Linear", "deep.0", "‖Δw‖/‖w‖", ".grad values"), 4),
    "repro": (_repro, ("repro:", "randn"), 0),
    "explain": (_explain, ("Shape mismatch", "fc", "3072"), 0),
    "profile": (_profile, ("Verdict:", "Fix:", "Time per step", "Top lines", "Top modules", "deep"), 1),
}


@functools.lru_cache(maxsize=None)
def _output(view: str) -> dict[str, Any]:
    """The view's MIME bundle as a committed notebook saves it: the widget view dropped."""
    data = VIEWS[view][0]()._repr_mimebundle_()
    assert "text/plain" in data and "text/html" in data
    return {k: v for k, v in data.items() if k != WIDGET_MIME}


def _text(html: str) -> str:
    """What a reader sees: the text of the HTML (tags dropped, entities decoded, spaces collapsed)."""
    return " ".join(html_lib.unescape(re.sub(r"<[^>]*>", " ", html)).split())


def _png_ok(b64: str) -> tuple[int, int]:
    from matplotlib.image import imread

    data = base64.b64decode(b64, validate=True)
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) < 120_000  # tens of KB per figure
    pixels = imread(io.BytesIO(data), format="png")
    assert pixels[..., :3].std() > 0.01  # not a blank picture
    return pixels.shape[1], pixels.shape[0]


@functools.lru_cache(maxsize=None)
def _jupyterlab_policy() -> tuple[list[str], dict[str, list[str]]]:
    """Allowed tags and attributes of JupyterLab's HTML sanitizer, read from the installed bundle."""
    static = Path(sys.prefix) / "share" / "jupyter" / "lab" / "static"
    for path in sorted(static.glob("jlab_core.*.js")):
        source = path.read_text(encoding="utf-8", errors="replace")
        tags = re.search(r'allowedTags:\[("a","abbr"[^\]]*)\]', source)
        attrs = re.search(r'allowedAttributes:\{"\*":\[([^\]]*)\].*?img:\[(.*?)\](?=,\w+:)', source)
        if tags and attrs:
            strings = lambda text: re.findall(r'"([^"]+)"', text)  # noqa: E731
            glob, img = strings(attrs.group(1)), strings(attrs.group(2))
            return strings(tags.group(1)), {"*": glob, "img": glob + img}
    pytest.skip("needs JupyterLab installed (its sanitizer policy is read from its bundle)")


def _jupyterlab_sanitize(html: str) -> str:
    from bleach.css_sanitizer import CSSSanitizer

    tags, attributes = _jupyterlab_policy()
    styles = CSSSanitizer(allowed_css_properties=["color", "background", "background-color", "text-align",
                                                  "border-left", "padding", "margin", "margin-bottom", "font-family",
                                                  "font-size", "line-height", "margin-top", "border-collapse"])
    return bleach.clean(html, tags=tags, attributes=attributes, protocols=["http", "https", "mailto", "data"],
                        strip=True, strip_comments=True, css_sanitizer=styles)


@pytest.mark.parametrize("view", list(VIEWS))
def test_static_view_survives_jupyterlabs_sanitizer(view: str) -> None:
    data = _output(view)
    html = data["text/html"]
    assert "<svg" not in html and "<style" not in html and "<script" not in html and "http" not in html
    clean = _jupyterlab_sanitize(html)
    figures = FIGURE.findall(clean)
    assert len(figures) == VIEWS[view][2], f"{view}: figures kept {len(figures)}"
    for b64, alt, width, height in figures:
        assert (int(width), int(height)) == _png_ok(b64)  # the <img> size is the picture's own (100 DPI)
        assert len(html_lib.unescape(alt)) > 30  # an alt text that says what the picture shows
    seen = _text(clean)
    for text in VIEWS[view][1]:
        assert text in seen, f"{view}: {text!r} lost"
    assert seen == _text(html)  # the sanitizer removed nothing a reader would see


@pytest.mark.parametrize("view", list(VIEWS))
def test_static_view_reads_well_with_no_styles(view: str) -> None:
    """No stylesheet and no style= at all (nbconvert's sanitizer drops both): structure is in the tags."""
    html = re.sub(r'\s(style|class)="[^"]*"', "", _output(view)["text/html"])
    for table in re.findall(r"<table.*?</table>", html, re.S):
        assert "<th" in table or view == "explain", "a table without a header row or row headers"
    if view == "nanwatch":  # the cell listing: real line breaks, the birth line marked without colour
        pre = re.search(r'<pre>(.*?)</pre>', html, re.S)
        assert pre is not None and "\n" in pre.group(1) and "▶" in pre.group(1)


@pytest.mark.parametrize("view", list(VIEWS))
def test_split_output_survives_nbconverts_sanitizer(view: str) -> None:
    from nbconvert.filters.strings import clean_html

    data = _output(view)
    pieces = split_figures({"output_type": "display_data", "data": data, "metadata": {}})
    assert pieces[0]["data"]["text/plain"] == data["text/plain"]
    images = [p for p in pieces if "image/png" in p["data"]]
    assert len(images) == VIEWS[view][2]
    for piece in images:
        meta = piece["metadata"]["image/png"]
        assert (meta["width"], meta["height"]) == _png_ok(piece["data"]["image/png"])
        assert len(piece["data"]["text/plain"]) > 30  # the alt text, for readers of text only
    shown = ""
    for piece in pieces:
        if "text/html" in piece["data"]:
            clean = clean_html(piece["data"]["text/html"])
            assert "base64" not in clean and "&lt;img" not in clean and "&lt;svg" not in clean
            assert "&lt;style" not in clean and "{" not in _text(clean)  # no CSS shown as text
            shown += " " + _text(re.sub(r"&lt;/?\w+[^&]*&gt;", " ", clean))  # escaped tags aside
    for text in VIEWS[view][1]:
        assert text in shown or any(text in p["data"].get("text/plain", "") for p in images), f"{view}: {text!r} lost"


def test_split_keeps_order_type_and_untouched_outputs() -> None:
    png = base64.b64encode(b"\x89PNG\r\n\x1a\nfake").decode()
    img = (f'<img class="tnd-figure tnd-x" src="data:image/png;base64,{png}" alt="a &lt;b&gt; picture" '
           f'title="a &lt;b&gt; picture" width="30" height="20">')
    out = {"output_type": "execute_result", "execution_count": 7, "metadata": {"k": 1},
           "data": {"text/plain": "plain", "text/html": f"<div><h3>head</h3><div>{img}</div><p>tail</p></div>"}}
    pieces = split_figures(out)
    assert [p["output_type"] for p in pieces] == ["execute_result", "display_data", "display_data"]
    assert pieces[0]["execution_count"] == 7 and pieces[0]["metadata"] == {"k": 1}
    assert pieces[0]["data"] == {"text/plain": "plain", "text/html": "<div><h3>head</h3><div></div></div>"}
    assert pieces[1]["data"] == {"image/png": png, "text/plain": "a <b> picture"}
    assert pieces[1]["metadata"] == {"image/png": {"width": 30, "height": 20}}
    assert pieces[2]["data"] == {"text/html": "<div><div></div><p>tail</p></div>"}
    live = {**out, "data": {**out["data"], WIDGET_MIME: {"model_id": "x"}}}
    assert split_figures(live) == [live]  # a live widget view: not a saved static output
    plain = {"output_type": "stream", "name": "stdout", "text": "hi"}
    assert split_figures(plain) == [plain]


def test_figures_leave_the_users_matplotlib_state_alone() -> None:
    import matplotlib

    rc = {k: v for k, v in matplotlib.rcParams.items() if k != "backend"}  # reading "backend" resolves it
    pyplot = "matplotlib.pyplot" in sys.modules
    _output.cache_clear()
    with matplotlib.rc_context({"font.size": 30, "axes.facecolor": "black", "figure.facecolor": "black"}):
        user = matplotlib.rcParams.copy()
        html = _output("grads")["text/html"]
        assert matplotlib.rcParams == user  # the user's style is back after our drawing
    assert {k: v for k, v in matplotlib.rcParams.items() if k != "backend"} == rc
    assert ("matplotlib.pyplot" in sys.modules) == pyplot  # pyplot never imported: no figure, no backend
    b64 = FIGURE.search(html).group(1)  # and our picture ignores the user's black style
    from matplotlib.image import imread

    corner = imread(io.BytesIO(base64.b64decode(b64)), format="png")[0, 0, :3]
    assert corner.min() > 0.95


def test_split_pieces_are_well_formed_on_their_own() -> None:
    """nbconvert pastes outputs one after another: a piece cut inside a <div> must close it (and the
    next piece reopen it), or the following cells end up nested inside."""
    from html.parser import HTMLParser

    from torch_nbdebug.render.bundle import split_figures
    from torch_nbdebug.render.figures import img_tag

    png = b"\x89PNG\r\n\x1a\n" + b"\0" * 32
    html = ('<div class="tnd"><p><b>title</b></p>' + img_tag(png, "a figure", 10, 10) +
            '<table><tr><td>after</td></tr></table></div>')
    pieces = [p["data"]["text/html"] for p in split_figures(
        {"output_type": "display_data", "data": {"text/html": html, "text/plain": "t"}, "metadata": {}})
        if "text/html" in p["data"]]
    assert pieces == ['<div class="tnd"><p><b>title</b></p></div>',
                      '<div class="tnd"><table><tr><td>after</td></tr></table></div>']

    class Depth(HTMLParser):
        depth = 0

        def handle_starttag(self, tag: str, attrs: object) -> None:
            self.depth += tag != "img"

        def handle_endtag(self, tag: str) -> None:
            self.depth -= 1

    for piece in pieces:
        parser = Depth()
        parser.feed(piece)
        assert parser.depth == 0, piece


def test_a_picture_is_freed_once_drawn_and_the_users_frozen_heap_stays_frozen() -> None:
    """A figure is a web of reference cycles: png() frees it before returning (no pile of figures
    waiting for a rare full collection), and only it: the heap is left unfrozen, or as frozen as the
    user left it."""
    import gc
    import weakref

    from torch_nbdebug.render.figures import png

    drawn: list[weakref.ref[Any]] = []

    def draw(fig: Any) -> None:
        drawn.append(weakref.ref(fig))
        fig.add_subplot().plot([1, 2, 3], [3, 1, 2])

    for _ in range(3):
        png(draw, 200, 100)
        assert drawn[-1]() is None, "the figure outlived its picture"
        assert gc.get_freeze_count() == 0 and gc.isenabled()
    kept = [[i] for i in range(1000)]  # a user's heap, frozen by the user (as a fork server does)
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        png(draw, 200, 100)
        assert drawn[-1]() is None
        assert gc.get_freeze_count() > frozen - 100  # still frozen (less the few frozen objects freed meanwhile)
    finally:
        gc.unfreeze()
    assert len(kept) == 1000
