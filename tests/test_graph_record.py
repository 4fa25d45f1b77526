"""%graph recorder: node-set parity with torchviz, naming, module nesting on recorded forwards."""
from __future__ import annotations

import gc
import re
import weakref
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchviz import make_dot

from torch_nbdebug.api.graph import graph, record_graph
from torch_nbdebug.errors import InputError
from torch_nbdebug.record.graph import walk

pytestmark = pytest.mark.filterwarnings("ignore:distutils Version classes:DeprecationWarning")  # torchviz


def _dot_nodes(dot) -> dict[str, str]:
    """``{node id: label}`` of a torchviz Digraph."""
    out = {}
    for line in dot.body:
        m = re.match(r'\s*(\d+) \[label=(".*?"|\S+)(?: fillcolor=(\S+))?\]', line, re.S)
        if m:
            out[m.group(1)] = m.group(3) or "function"
    return out


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class ResBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class ResNetLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.layer1 = nn.Sequential(ResBlock(4), ResBlock(4))
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layer1(self.stem(x)).mean((2, 3)))


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        return x * 3

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return g * 3


class WithFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Scale.apply(self.fc(x))


@pytest.mark.parametrize("make", [
    lambda: Tiny()(torch.randn(2, 4)).sum(),
    lambda: ResNetLike()(torch.randn(1, 3, 5, 5)).sum(),
    lambda: nn.LSTM(3, 4)(torch.randn(2, 1, 3))[0].sum(),
    lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)(torch.randn(3, 1, 8)).sum(),
    lambda: WithFunction()(torch.randn(2, 3)).sum(),
])
def test_node_set_matches_make_dot(make) -> None:
    out = make()
    order, _, truncated = walk([out.grad_fn])  # holding the wrappers keeps their ids stable
    dot = _dot_nodes(make_dot(out))
    functions = {k for k, kind in dot.items() if kind == "function"}
    leaves = {k for k, kind in dot.items() if kind == "lightblue"}
    assert not truncated
    assert {str(id(n)) for n in order} == functions
    assert len(order) == len(set(map(id, order)))  # each node exactly once
    assert {str(id(n.variable)) for n in order if hasattr(n, "variable")} == leaves
    data = graph(out).data
    assert Counter(n.op for n in data.nodes if n.kind != "output") == Counter(
        n.name().rsplit("::", 1)[-1] for n in order)
    dot_edges = sum(1 for line in make_dot(out).body if "->" in line and "dir=none" not in line)
    # make_dot has one edge per next_function, one per leaf variable and one to the output (plus
    # undirected ones to a custom Function's saved tensors, left out above).
    leaf_edges = sum(1 for n in order if hasattr(n, "variable"))
    assert len(data.edges) == dot_edges - leaf_edges


def test_five_thousand_layer_chain_has_no_recursion_error() -> None:
    x = torch.randn(3, requires_grad=True)
    y = x
    for _ in range(5000):
        y = y * 1.0001
    with pytest.raises(RecursionError):
        make_dot(y)
    g = graph(y, names={"x": x, "y": y})
    assert len(g.data.ops()) == 5000
    assert [n.label for n in g.data.nodes if n.kind == "input"] == ["x"]
    assert len(g.shown()) <= 60 and "y" in g.text()


def test_parameters_named_by_qualified_name_and_ops_carry_shape() -> None:
    model = Tiny()
    x = torch.randn(2, 4, requires_grad=True)
    loss = model(x).pow(2).mean()
    data = graph(loss, names={"model": model, "x": x, "loss": loss}).data
    assert sorted(p.label for p in data.params()) == ["model.fc1.bias", "model.fc1.weight",
                                                      "model.fc2.bias", "model.fc2.weight"]
    assert {n.label for n in data.nodes if n.kind == "input"} == {"x"}
    out = [n for n in data.nodes if n.kind == "output"]
    assert [(n.label, n.shape) for n in out] == [("loss", ())]
    addmm = [n for n in data.ops() if n.op == "AddmmBackward0"]
    assert sorted(n.shape for n in addmm) == [(2, 3), (2, 8)] and all(n.dtype == "float32" for n in addmm)
    # Bare tensor: modules inferred from the parameters (relu sits between fc1 and fc2 of `model`).
    relu = [n for n in data.ops() if n.label == "relu"][0]
    assert relu.module == "model"
    assert {n.module for n in addmm} == {"model.fc1", "model.fc2"}
    assert {n.module for n in data.ops() if n.label in ("pow", "mean")} == {None}  # the loss: outside


def _modules_by_op(data, op: str) -> list[str]:
    return [n.module for n in data.ops() if n.label == op]


def test_recorded_forward_nests_resnet_nodes_by_module() -> None:
    net = ResNetLike().eval()
    with record_graph(names={"net": net}) as rec:
        out = net(torch.randn(1, 3, 5, 5)).sum()
    data = rec.graph(out).data
    assert data.source == "recorded"
    convs = _modules_by_op(data, "convolution")
    assert convs == ["net.stem", "net.layer1.0.conv1", "net.layer1.0.conv2", "net.layer1.1.conv1",
                     "net.layer1.1.conv2"]
    adds = _modules_by_op(data, "add")
    assert sorted(adds) == ["net.layer1.0", "net.layer1.1"]  # the residual adds
    assert set(_modules_by_op(data, "sum")) == {None}  # made outside any module
    paths = {m.path: m.type_name for m in data.modules}
    assert paths["net.layer1"] == "Sequential" and paths["net.layer1.0"] == "ResBlock"


def test_recorded_transformer_lstm_and_custom_function() -> None:
    enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)
    lstm = nn.LSTM(8, 4)
    fn = WithFunction()
    with record_graph(names={"enc": enc, "lstm": lstm, "fn": fn}) as rec:
        h = enc(torch.randn(3, 1, 8))
        out, _ = lstm(h)
        z = fn(out[..., :3]).sum()
    data = rec.graph(z).data
    mods = {n.module for n in data.ops()}
    assert {"enc.self_attn", "enc.linear1", "enc.norm1", "lstm", "fn.fc", "fn"} <= mods
    assert _modules_by_op(data, "Scale") == ["fn"]  # the custom autograd.Function
    rnn = [n for n in data.ops() if "rnn" in n.label.lower() or "lstm" in n.label.lower()]
    assert rnn and all(n.module == "lstm" for n in rnn)


def test_shared_parameters_appear_once_with_first_name() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.head(self.emb(idx))

    model = Tied()
    with record_graph(names={"model": model}) as rec:
        logits = model(torch.tensor([1, 2]))
    data = rec.graph(logits).data
    assert [p.label for p in data.params()] == ["model.emb.weight"]
    param = data.params()[0]
    users = {data.node(e.dst).module for e in data.edges if e.src == param.id}
    assert users == {"model.emb", "model.head"}


def test_multiple_outputs_and_top_level_outputs() -> None:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 2)
            self.b = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor):
            return self.a(x), self.b(x)

    two = Two()
    with record_graph(names={"two": two}) as rec:
        ya, yb = two(torch.randn(1, 3))
    data = rec.graph().data  # no outputs named: the top-level module's outputs
    assert len([n for n in data.nodes if n.kind == "output"]) == 2
    assert {n.module for n in data.ops() if n.label == "addmm"} == {"two.a", "two.b"}
    both = graph((ya, yb), names={"ya": ya, "yb": yb, "two": two}).data
    assert sorted(n.label for n in both.nodes if n.kind == "output") == ["ya", "yb"]


def test_saved_tensors_are_shapes_only_and_graph_keeps_no_tensor() -> None:
    x = torch.randn(3, 4, requires_grad=True)
    y = (x.exp() * 2).sum()
    data = graph(y, saved=True, names={}).data
    exp = [n for n in data.ops() if n.label == "exp"][0]
    assert [(s.name, s.shape, s.dtype) for s in exp.saved] == [("result", (3, 4), "float32")]
    ref = weakref.ref(x)
    del x, y
    gc.collect()
    assert ref() is None


def test_gradient_norms_after_backward() -> None:
    model = Tiny()
    loss = model(torch.randn(2, 4)).sum()
    kept = model(torch.randn(2, 4)).mean()
    kept.retain_grad()
    kept.backward()
    assert graph(kept, names={}).data.nodes[-1].grad.norm == pytest.approx(1.0)
    loss.backward(retain_graph=True)
    data = graph(loss, names={"model": model}).data
    grads = {p.label: p.grad for p in data.params()}
    assert [n.grad for n in data.nodes if n.kind == "output"] == [None]  # no retain_grad: not read
    expected = float(model.fc2.bias.grad.norm())
    assert grads["model.fc2.bias"].norm == pytest.approx(expected)
    assert grads["model.fc1.weight"].min <= grads["model.fc1.weight"].max


def test_model_with_inputs_records_modules_and_keeps_user_tensors_untouched() -> None:
    model = ResNetLike()
    model.eval()
    x = torch.randn(1, 3, 5, 5)
    g = graph(model, x, names={"model": model, "x": x})
    assert not x.requires_grad and not model.training
    assert [n.label for n in g.data.nodes if n.kind == "input"] == ["x"]
    shown = g.shown()
    assert "m:model.layer1" in shown  # module level: the two identical blocks are one repeated box
    assert g.hierarchy.groups["m:model.layer1"].repeat == "0..1 ×2 ResBlock"
    shown = g.expand("model.layer1").shown()
    assert "m:model.layer1.0.conv1" in shown  # opened: its blocks at module level, leaf modules as boxes
    assert "m:model.layer1" not in shown


def test_bad_input_messages() -> None:
    with pytest.raises(InputError, match="a int"):
        graph(3)
    with pytest.raises(InputError, match="does not require grad"):
        graph(torch.ones(2))
    with pytest.raises(InputError, match="leaf tensor"):
        graph(torch.ones(2, requires_grad=True))

    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("shape mismatch in layer 3")

    with pytest.raises(InputError, match="raised RuntimeError: shape mismatch in layer 3"):
        graph(Broken(), torch.ones(2))
    with pytest.raises(InputError, match="needs example inputs"):
        graph(Tiny())


def test_nan_birth_from_last_nanwatch_is_marked_by_sequence_number(monkeypatch) -> None:
    from types import SimpleNamespace

    import torch_nbdebug.api.nanwatch as nw

    x = torch.randn(3, requires_grad=True)
    y = (x * 2).exp().sum()
    mul = y.grad_fn.next_functions[0][0].next_functions[0][0]
    event = SimpleNamespace(sequence_nr=mul._sequence_nr(), node_name="MulBackward0", module=None, op="")
    monkeypatch.setattr(nw, "last_report", lambda: SimpleNamespace(first=event))
    g = graph(y, names={})
    assert [n.label for n in g.data.nodes if n.nan] == ["mul"]
    assert "first NaN/Inf born at mul" in g.text()
    assert "#cf222e" in g.svg()


def test_nan_birth_marked_from_a_real_nanwatch() -> None:
    from torch_nbdebug.api.nanwatch import nanwatch

    class Logs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(self.fc(x))

    model = Logs()
    ns = {"model": model}
    with torch.no_grad():
        model.fc.bias.fill_(-100.0)  # log of negative numbers: NaN born in model's forward
    with nanwatch(namespace=ns, backward=False) as report:
        out = model(torch.randn(2, 3)).sum()
    assert report.first is not None
    g = graph(out, names=ns)
    assert [n.label for n in g.data.nodes if n.nan] == ["log"]


def test_missing_nanwatch_is_tolerated(monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "torch_nbdebug.api.nanwatch", None)  # import raises ImportError
    x = torch.randn(2, requires_grad=True)
    assert not any(n.nan for n in graph((x * 2).sum(), names={}).data.nodes)


def test_record_graph_in_a_function_names_locals_made_later() -> None:
    def step() -> list[str]:
        model = Tiny()
        with record_graph() as rec:
            loss = model(torch.randn(2, 4)).sum()
        data = rec.graph(loss).data
        return [n.label for n in data.nodes if n.kind in ("output", "param")]

    labels = step()
    assert "loss" in labels and "model.fc1.weight" in labels


def test_recording_is_removed_on_keyboard_interrupt_and_keeps_no_tensor() -> None:
    model = Tiny()
    kept: list[weakref.ref] = []
    with pytest.raises(KeyboardInterrupt):
        with record_graph(names={"model": model}):
            out = model(torch.randn(2, 4))
            kept.append(weakref.ref(out))
            raise KeyboardInterrupt
    # the autouse no_leftovers fixture checks the hooks and the function mode are gone
    del out
    gc.collect()
    assert kept[0]() is None


def test_graph_of_a_training_model_leaves_its_buffers_and_the_rng_alone() -> None:
    """Drawing the graph runs the forward; a train-mode BatchNorm must not learn from it and Dropout
    must not shift the user's random numbers."""
    from torch_nbdebug.api.graph import graph

    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    model.train()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    x = torch.randn(8, 4)
    rng = torch.get_rng_state()
    graph(model, x, names={"model": model, "x": x})
    assert torch.equal(torch.get_rng_state(), rng)
    for name, buf in model.named_buffers():
        assert torch.equal(buf, buffers[name]), name
    assert model.training


def test_record_graph_in_a_function_keeps_no_local_alive() -> None:
    import gc
    import weakref

    from torch_nbdebug.api.graph import record_graph

    def train_step() -> tuple:
        model = nn.Linear(3, 1)
        batch = torch.randn(4, 3)
        with record_graph() as rec:
            model(batch).sum()
        return rec, weakref.ref(batch)

    rec, batch_ref = train_step()
    gc.collect()
    assert batch_ref() is None, "the recording kept the function's batch alive"
    assert rec is not None


def test_op_names_with_a_dimension_read_as_torch_spells_them() -> None:
    """``MaxPool2DWithIndicesBackward0`` is ``max_pool2d_with_indices`` (was ``max_pool2_dwith_indices``)."""
    from torch_nbdebug.record.graph import op_label

    x = torch.randn(1, 2, 8, 8, requires_grad=True)
    found = {fn.name(): op_label(fn) for fn in (F.max_pool2d(x, 2).grad_fn, F.avg_pool2d(x, 2).grad_fn,
                                                 F.adaptive_avg_pool2d(x, 3).grad_fn,
                                                 F.interpolate(x, scale_factor=2, mode="bilinear").grad_fn)}
    assert found == {"MaxPool2DWithIndicesBackward0": "max_pool2d_with_indices", "AvgPool2DBackward0": "avg_pool2d",
                     "AdaptiveAvgPool2DBackward0": "adaptive_avg_pool2d",
                     "UpsampleBilinear2DBackward0": "upsample_bilinear2d"}


def test_nan_birth_is_marked_only_on_the_watched_model_and_says_where_from() -> None:
    from torch_nbdebug.api.nanwatch import nanwatch

    class Normalize(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x / x.norm(dim=-1, keepdim=True)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = Normalize()
            self.fc = nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(self.norm(x))

    x = torch.randn(4, 3)
    x[-1] = 0.0
    model = Net()
    with nanwatch(namespace={"model": model, "x": x}, backward=False) as report:
        model(x).sum()
    assert report.first is not None and report.first.module == "model.norm"
    again = graph(model, x, names={"model": model, "x": x})  # the very model, run again: marked
    assert [n.module for n in again.data.nodes if n.nan] == ["model.norm"]
    assert again.data.nan_from.startswith("%%nanwatch")
    assert "from %%nanwatch" in again.text()
    marked = next(n for n in again.data.nodes if n.nan)
    assert again.details(marked.id)["nan"].startswith("from %%nanwatch")
    assert any("from %%nanwatch" in note for note in again.widget().notes)
    repaired = Net()  # a new model with the same module paths: its graph is not red
    fixed = graph(repaired, x, names={"model": repaired, "x": x})
    assert not any(n.nan for n in fixed.data.nodes)
    assert "#cf222e" not in fixed.svg()


def test_nan_mark_names_the_cell_it_came_from(monkeypatch) -> None:
    import torch_nbdebug.api.graph as api_graph
    from types import SimpleNamespace

    monkeypatch.setattr(api_graph, "cell_number", lambda filename: 4 if filename == "/tmp/ipykernel_1/9.py" else None)
    report = SimpleNamespace(summary=SimpleNamespace(cell_filename="/tmp/ipykernel_1/9.py"))
    assert api_graph._origin(report) == "%%nanwatch, In [4]"
    report = SimpleNamespace(summary=SimpleNamespace(cell_filename="/home/me/train.py"))
    assert api_graph._origin(report) == "%%nanwatch, train.py"
