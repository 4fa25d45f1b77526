"""What a saved notebook holds for one output: the static view and the widget state, each once and
compact (issue 26, item 10). Executed by nbclient in a real kernel, which saves widget state as
JupyterLab does; measured as the bytes the output and its widget models add to the file nbformat writes
(indented JSON, as JupyterLab saves it)."""
from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import nbformat
import pytest

from torch_nbdebug.render.bundle import WIDGET_MIME

SETUP = """
import torch
from torch import nn
import torch.nn.functional as F
%load_ext torch_nbdebug
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.003)
x, y = torch.randn(32, 4), torch.randn(32, 1)
"""
MONITOR = """%%monitor loss, opt.param_groups[0]["lr"]
for step in range(30):
    loss = nn.functional.mse_loss(net(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
"""
TOUR_MODEL = """
class Classifier(nn.Module):  # the tour's model
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        return self.head(self.encoder(x / x.norm(dim=-1, keepdim=True)))


torch.manual_seed(0)
xs, ys = torch.randn(32, 16), torch.randint(0, 4, (32,))
model = Classifier()
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
loss = F.cross_entropy(model(xs), ys)
"""
GRAPH = "%graph loss"
CUDAMEM = """%%cudamem
for step in range(3):
    loss = F.cross_entropy(model(xs), ys)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""
TOUR_MONITOR = """%%monitor loss, optimizer.param_groups[0]["lr"]
for step in range(30):
    loss = F.cross_entropy(model(xs), ys)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""
CELLS = {"graph": GRAPH, "cudamem": CUDAMEM, "tour monitor": TOUR_MONITOR, "monitor": MONITOR}  # in this order
LIMIT = 40_000  # bytes of the saved file for one output with the widget state it needs


def widget_models(nb: nbformat.NotebookNode, cell: nbformat.NotebookNode) -> dict[str, Any]:
    """The saved widget models the cell's outputs show (and those models refer to)."""
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    todo = [out["data"][WIDGET_MIME]["model_id"] for out in cell.outputs if WIDGET_MIME in out.get("data", {})]
    models: dict[str, Any] = {}
    while todo:
        model = todo.pop()
        if model in models or model not in state:
            continue
        models[model] = state[model]
        todo += [v[len("IPY_MODEL_"):] for v in state[model]["state"].values()
                 if isinstance(v, str) and v.startswith("IPY_MODEL_")]
    return models


def saved_bytes(nb: nbformat.NotebookNode, cell: nbformat.NotebookNode) -> int:
    """What the cell's outputs and their widget models add to the notebook file, as nbformat writes it."""
    models = widget_models(nb, cell)
    assert models, "the output shows no saved widget"
    empty = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell.source)])
    empty.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json":
                                 {"state": {}, "version_major": 2, "version_minor": 0}}
    full = copy.deepcopy(empty)
    full.cells[0].outputs = cell.outputs
    full.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"] = models
    return len(nbformat.writes(full).encode("utf-8")) - len(nbformat.writes(empty).encode("utf-8"))


@pytest.fixture(scope="module")
def executed() -> dict[str, tuple[nbformat.NotebookNode, nbformat.NotebookNode]]:
    from nbclient import NotebookClient

    cells = [nbformat.v4.new_code_cell(SETUP), nbformat.v4.new_code_cell(TOUR_MODEL)]
    cells += [nbformat.v4.new_code_cell(source) for source in CELLS.values()]
    nb = nbformat.v4.new_notebook(cells=cells)
    NotebookClient(nb, timeout=240, kernel_name="python3", store_widget_state=True).execute()
    return {name: (nb, cell) for name, cell in zip(CELLS, nb.cells[2:])}


def _static_html(cell: nbformat.NotebookNode) -> str:
    return "".join(out["data"]["text/html"] for out in cell.outputs if "text/html" in out.get("data", {}))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(CELLS))
def test_a_saved_output_stays_under_40_kb(executed, name: str) -> None:  # type: ignore[no-untyped-def]
    nb, cell = executed[name]
    assert not [out for out in cell.outputs if out["output_type"] == "error"], cell.outputs
    assert _static_html(cell).count("data:image/png") == 1  # the static picture once
    size = saved_bytes(nb, cell)
    assert size < LIMIT, f"{cell.source.splitlines()[0]} is saved as {size:,} bytes"


@pytest.mark.timeout(300)
def test_each_thing_is_saved_once(executed) -> None:  # type: ignore[no-untyped-def]
    from torch_nbdebug.render.widget import unpack

    for name, (nb, cell) in executed.items():
        for model in widget_models(nb, cell).values():
            state = model["state"]
            if model["model_name"] != "AnyModel":
                continue
            js, css = unpack(state["_esm"])  # module and stylesheet packed once, no second copy
            assert js and "_css" not in state, name
            text = json.dumps({k: v for k, v in state.items() if k != "_esm"})
            assert "data:image/png" not in text, name  # the static picture lives in the static view only
    graph = executed["graph"][1]
    assert "<svg" not in _static_html(graph)  # the widget's SVG is not in the static view too
    memory = [m["state"] for m in widget_models(*executed["cudamem"]).values() if m["model_name"] == "AnyModel"][0]
    assert "allocations" not in memory["meta"]["peak"]  # the peak's table is in the view, not twice


@pytest.mark.parametrize("name", ["explain", "grads", "graph", "live", "memory", "monitor", "nanwatch"])
def test_compacted_widget_modules_are_still_valid_javascript(name: str, tmp_path: Path) -> None:
    from torch_nbdebug.render.widget import compact_js, esm_path

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    source = esm_path(f"{name}.js").read_text(encoding="utf-8")
    module = tmp_path / f"{name}.mjs"
    module.write_text(compact_js(source), encoding="utf-8")
    check = subprocess.run([node, "--check", str(module)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    assert len(module.read_text(encoding="utf-8")) < 0.95 * len(source)


# Runs a packed loader in node as anywidget runs it in a browser: node has atob, Blob, Response and
# DecompressionStream, but imports no blob: URL, so the module is handed over as a data: URL instead.
LOAD_IN_NODE = """
const fs = await import("node:fs");
class RecordingBlob extends Blob { constructor(parts, opts) { super(parts, opts); this.parts = parts; } }
globalThis.Blob = RecordingBlob;
URL.createObjectURL = (b) => "data:text/javascript;base64," + Buffer.from(b.parts.join("")).toString("base64");
URL.revokeObjectURL = () => {};
const styles = [];
globalThis.document = { getElementById: (id) => styles.find((s) => s.id === id) || null,
  createElement: () => ({}), head: { appendChild: (s) => styles.push(s) } };
const stub = fs.readFileSync(process.argv[2], "utf8");
const loader = await import("data:text/javascript;base64," + Buffer.from(stub).toString("base64"));
const first = await loader.default(), again = await loader.default();
console.log(JSON.stringify({ render: typeof first.render, again: typeof again.render,
                             styles: styles.map((s) => [s.id, s.textContent]) }));
"""


def _views() -> list[type]:
    import importlib

    from torch_nbdebug.render.widget import View

    for name in ("explain", "grads", "graph", "live", "memory", "monitor", "nanwatch", "profile"):
        importlib.import_module(f"torch_nbdebug.render.{name}")
    found, todo = [], list(View.__subclasses__())
    while todo:
        cls = todo.pop()
        # a view class states its module; ipywidgets' add_traits makes subclasses of an instance's class
        # at run time whose `_esm` is a trait, not a module (they send their parent's)
        if isinstance(cls.__dict__.get("_esm"), str):
            found.append(cls)
        todo += cls.__subclasses__()
    return sorted(found, key=lambda cls: cls.__qualname__)


def test_every_view_is_sent_packed_and_its_loader_runs(tmp_path: Path) -> None:
    from torch_nbdebug.render.widget import _compacted, esm_path, unpack

    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    harness = tmp_path / "load.mjs"
    harness.write_text(LOAD_IN_NODE, encoding="utf-8")
    views = _views()
    assert len(views) >= 9
    for cls in views:
        js, css = unpack(cls._esm)
        assert not hasattr(cls, "_css"), cls  # the stylesheet is sent once, inside the module
        assert not css or css.startswith(_compacted(esm_path("base.css"))), cls  # the shared look
        assert len(cls._esm) < 0.7 * (len(js) + len(css)), cls  # deflated: well under the two texts
        stub = tmp_path / f"{cls.__name__}.mjs"
        stub.write_text(cls._esm, encoding="utf-8")
        run = subprocess.run([node, str(harness), str(stub)], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        loaded = json.loads(run.stdout)
        assert loaded["render"] == loaded["again"] == "function", cls
        name = f"{cls.__module__}.{cls.__qualname__}"
        assert loaded["styles"] == ([[name, css]] if css else []), cls  # the stylesheet in the page once
