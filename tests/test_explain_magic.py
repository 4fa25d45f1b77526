"""%%explain through a real IPython shell: one test per error kind, asserting kind, op, module, line,
culprit and hint; the user's exception passes through unchanged and the card comes under the traceback."""
from __future__ import annotations

from typing import Any

import pytest
from IPython.utils.capture import capture_output

from torch_nbdebug.api.explain import Diagnosis
from torch_nbdebug.magics import explain as explain_magics

SETUP = """
import torch
import torch.nn.functional as F
from torch import nn

class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.fc = nn.Linear(8 * 4 * 4, 10)
    def forward(self, x):
        h = self.features(x)
        return self.fc(h.flatten(1))

class Gate(nn.Module):
    def __init__(self, inplace_act=False):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=inplace_act)
    def forward(self, x):
        s = torch.sigmoid(self.proj(x))
        return self.act(s)

class Shift(nn.Module):
    def __init__(self):
        super().__init__()
        self.offset = nn.Parameter(torch.zeros(5))
    def forward(self, x):
        return x + self.offset

torch.manual_seed(0)
model = ConvNet()
"""
SETUP_LINES = SETUP.strip("\n").splitlines()


def setup_line(text: str) -> int:
    return SETUP_LINES.index(text) + 1


@pytest.fixture
def ip() -> Any:
    """A real IPython shell with %explain registered and its exception hook installed."""
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.register_magics(explain_magics.MAGICS)
    explain_magics.load(shell)
    shell.run_cell(SETUP)
    yield shell
    explain_magics.unload(shell)
    for kind, names in explain_magics.MAGICS.magics.items():  # leave the shell as %unload_ext would
        for name in names:
            shell.magics_manager.magics[kind].pop(name, None)
    shell.magics_manager.registry.pop(explain_magics.MAGICS.__name__, None)
    for name in list(shell.user_ns):
        if name in {"model", "net", "ConvNet", "Gate", "Shift", "x", "h", "w", "loss", "out", "emb", "tokens",
                    "_explain", "boom", "feats", "a", "b", "logits", "y", "hidden", "cell", "idx", "data"}:
            shell.user_ns.pop(name, None)


def explain_cell(ip: Any, body: str, line: str = "") -> tuple[Diagnosis, BaseException]:
    """Run ``%%explain`` around ``body`` directly (the exception reaches the test) and return both."""
    with capture_output():
        with pytest.raises(Exception) as info:
            ip.run_cell_magic("explain", line, body)
    diagnosis = ip.user_ns["_explain"]
    assert isinstance(diagnosis, Diagnosis), diagnosis
    return diagnosis, info.value


# -- shapes ------------------------------------------------------------------------------------
def test_linear_after_convs_names_the_module_and_the_image_size(ip: Any) -> None:
    d, exc = explain_cell(ip, "x = torch.randn(2, 3, 32, 32)\nout = model(x)\n")
    assert "mat1 and mat2 shapes cannot be multiplied (2x2048 and 128x10)" in str(exc)
    assert (d.kind, d.op, d.module) == ("shape", "aten::linear", "model.fc")
    assert (d.lineno, d.line) == (setup_line("        return self.fc(h.flatten(1))"), "return self.fc(h.flatten(1))")
    assert "expects 128 input features but gets 2048" in d.hint and "in_features=2048" in d.hint
    assert "32×32 inputs" in d.hint and "4× larger" in d.hint and "nn.LazyLinear" in d.hint
    shapes = {o.name: o.shape for o in d.operands}
    assert shapes["model.fc.weight"] == (10, 128) and shapes["h"] == (2, 8, 16, 16)
    assert "model.features.2" in next(o.producer for o in d.operands if o.name == "h")


def test_conv_channel_mismatch(ip: Any) -> None:
    d, _ = explain_cell(ip, "x = torch.randn(2, 1, 8, 8)\nout = model(x)\n")
    assert (d.kind, d.op, d.module) == ("shape", "aten::convolution", "model.features.0")
    assert "expects 3 input channels, the input has 1" in d.hint and "grayscale" in d.hint


def test_cat_view_and_broadcast(ip: Any) -> None:
    d, _ = explain_cell(ip, "a = torch.zeros(2, 4)\nb = torch.zeros(3, 5)\nout = torch.cat([a, b], dim=1)\n")
    assert (d.kind, d.op, d.lineno, d.line) == ("shape", "aten::cat", 3, "out = torch.cat([a, b], dim=1)")
    assert {o.name for o in d.operands} == {"a", "b"}
    d, _ = explain_cell(ip, "a = torch.zeros(5)\nout = a.view(2, 3)\n")
    assert (d.kind, d.op, d.lineno) == ("shape", "aten::view", 2) and "6 elements" in d.hint and "5" in d.hint
    d, _ = explain_cell(ip, "net = Shift()\nout = net(torch.zeros(2, 4))\n")
    assert (d.kind, d.op, d.module, d.line) == ("shape", "aten::add", "net", "return x + self.offset")
    assert {o.name: o.shape for o in d.operands} == {"x": (2, 4), "net.offset": (5,)}


# -- dtypes and devices ------------------------------------------------------------------------
def test_float_class_targets_and_float64_inputs(ip: Any) -> None:
    d, _ = explain_cell(ip, "logits = torch.randn(4, 3)\ny = torch.tensor([0., 1., 2., 1.])\n"
                            "loss = F.cross_entropy(logits, y)\n")
    assert (d.kind, d.op, d.lineno) == ("dtype", "aten::cross_entropy_loss", 3)
    assert "target.long()" in d.hint
    d, _ = explain_cell(ip, "net = Gate()\nout = net(torch.zeros(2, 4, dtype=torch.float64))\n")
    assert (d.kind, d.module) == ("dtype", "net.proj")
    assert "float64" in d.hint and ".float()" in d.hint


def test_device_mismatch_names_each_operands_device(ip: Any) -> None:
    d, _ = explain_cell(ip, "net = Shift().to('meta')\nout = net(torch.zeros(2, 5))\n")
    assert (d.kind, d.module, d.line) == ("device", "net", "return x + self.offset")
    assert "`x` on cpu" in d.hint and "`net.offset` on meta" in d.hint


# -- autograd --------------------------------------------------------------------------------------
def test_inplace_by_a_module_names_saver_and_modifier(ip: Any) -> None:
    d, _ = explain_cell(ip, "net = Gate(inplace_act=True)\nloss = net(torch.randn(3, 4)).sum()\nloss.backward()\n")
    assert (d.kind, d.op, d.lineno) == ("inplace", "backward", 3)
    assert (d.culprit_op, d.culprit_module) == ("relu(inplace=True)", "net.act")
    assert d.culprit_lineno == setup_line("        return self.act(s)")
    assert "`sigmoid` at line " + str(setup_line("        s = torch.sigmoid(self.proj(x))")) in d.hint


def test_inplace_by_a_user_line(ip: Any) -> None:
    d, _ = explain_cell(ip, "w = torch.randn(4, requires_grad=True)\nh = torch.exp(w)\nh += 1\n"
                            "loss = h.sum()\nloss.backward()\n")
    assert (d.kind, d.culprit_op, d.culprit_lineno, d.culprit_line) == ("inplace", "add_", 3, "h += 1")
    assert "`exp` at line 2" in d.hint


def test_graph_reuse_names_the_line_that_made_the_old_graph(ip: Any) -> None:
    body = ("w = torch.randn(3, requires_grad=True)\nfeats = torch.tanh(w * 2)\nfor step in range(3):\n"
            "    loss = (feats * step).sum()\n    loss.backward()\n")
    d, exc = explain_cell(ip, body)
    assert "backward through the graph a second time" in str(exc)
    assert (d.kind, d.lineno, d.culprit_op, d.culprit_lineno) == ("graph_reuse", 5, "tanh", 2)
    assert "`feats = feats.detach()`" in d.hint


def test_graph_reuse_of_a_hidden_state_carried_across_iterations(ip: Any) -> None:
    body = ("cell = nn.Linear(4, 4)\nhidden = torch.zeros(1, 4)\nfor step in range(3):\n"
            "    hidden = torch.tanh(cell(hidden))\n    loss = hidden.sum()\n    loss.backward()\n")
    d, _ = explain_cell(ip, body)
    assert (d.kind, d.culprit_lineno, d.culprit_line) == ("graph_reuse", 4, "hidden = torch.tanh(cell(hidden))")
    assert "`hidden = hidden.detach()`" in d.hint


def test_backward_twice_on_the_same_loss_says_to_compute_it_again_not_to_detach(ip: Any) -> None:
    """Nothing was carried over: detaching ``loss`` (the carried-over advice) would only trade the error for
    another one."""
    d, _ = explain_cell(ip, "w = torch.randn(3, requires_grad=True)\nloss = torch.sigmoid(w).sum()\n"
                            "loss.backward()\nloss.backward()\n")
    assert (d.kind, d.lineno, d.culprit_lineno) == ("graph_reuse", 4, 2)
    assert "a second time through the same graph" in d.summary and "compute the loss again" in d.hint
    assert "detach" not in d.hint


@pytest.mark.parametrize("body,how,line", [
    ("with torch.no_grad():\n    out = net(x)\nloss = out.sum()\nloss.backward()\n", "under no_grad", 2),
    ("out = net(x).detach()\nloss = out.sum()\nloss.backward()\n", "detach", 1),
    ("out = net(x).data\nloss = out.sum()\nloss.backward()\n", "data", 1),
    ("loss = torch.tensor(net(x).sum().item())\nloss.backward()\n", "item", 1),
])
def test_no_grad_names_where_the_chain_was_cut(ip: Any, body: str, how: str, line: int) -> None:
    ip.run_cell("net = Gate()\nx = torch.randn(2, 4)")
    d, _ = explain_cell(ip, body)
    assert d.kind == "no_grad" and d.op == "backward" and how in d.culprit_op
    assert d.culprit_lineno == line
    assert "requires_grad = True" in d.warning and "nothing trains" in d.warning and d.warning not in d.hint


def test_no_grad_from_frozen_parameters(ip: Any) -> None:
    ip.run_cell("net = Gate()\nfor p in net.parameters():\n    p.requires_grad_(False)")
    d, _ = explain_cell(ip, "loss = net(torch.randn(2, 4)).sum()\nloss.backward()\n")
    assert d.kind == "no_grad" and "`net` has `requires_grad=False`" in d.hint and "nothing trains" in d.warning


# -- indices -----------------------------------------------------------------------------------
@pytest.mark.parametrize("body,op,value,size", [
    ("emb = nn.Embedding(10, 4)\ntokens = torch.tensor([[1, 2, 10]])\nout = emb(tokens)\n", "aten::embedding", 10, 10),
    ("logits = torch.randn(2, 3)\ny = torch.tensor([0, 5])\nloss = F.cross_entropy(logits, y)\n",
     "aten::cross_entropy_loss", 5, 3),
    ("data = torch.zeros(2, 3)\nidx = torch.tensor([[0], [4]])\nout = torch.gather(data, 1, idx)\n", "aten::gather", 4, 3),
    ("data = torch.zeros(2, 3)\nidx = torch.tensor([7])\nout = torch.index_select(data, 1, idx)\n",
     "aten::index_select", 7, 3),
])
def test_index_errors_name_the_value_and_the_size(ip: Any, body: str, op: str, value: int, size: int) -> None:
    d, _ = explain_cell(ip, body)
    assert (d.kind, d.op, d.lineno) == ("index", op, 3)
    assert f"holds {value}" in d.hint and f"only {size} " in d.hint


def test_check_indices_stops_at_the_line_before_the_op(ip: Any) -> None:
    from torch_nbdebug.api.explain import IndexCheckError

    body = "emb = nn.Embedding(100, 8)\ntokens = torch.tensor([[1, 2, 100]])\nh = emb(tokens)\n"
    d, exc = explain_cell(ip, body, "--check-indices")
    assert isinstance(exc, IndexCheckError) and "index 100" in str(exc) and "position (0, 2)" in str(exc)
    assert (d.kind, d.op, d.lineno, d.module) == ("index", "aten::embedding", 3, "emb")
    assert "holds 100" in d.hint and "rows (num_embeddings)" in d.hint


# -- exception identity, display under the traceback, post mortem, the automatic paragraph ------
def test_user_exception_is_reraised_unchanged(ip: Any) -> None:
    ip.user_ns["boom"] = RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)")
    with capture_output(), pytest.raises(RuntimeError) as info:
        ip.run_cell_magic("explain", "", "x = 1\nraise boom\n")
    assert info.value is ip.user_ns["boom"] and ip.user_ns["_explain"].kind == "shape"


def test_card_is_displayed_under_the_traceback(ip: Any) -> None:
    with capture_output() as cap:
        result = ip.run_cell("%%explain\nx = torch.randn(2, 3, 32, 32)\nout = model(x)\n")
    assert isinstance(result.error_in_exec, RuntimeError)
    assert "mat1 and mat2 shapes cannot be multiplied" in cap.stdout  # the traceback came first
    [data] = [o.data for o in cap.outputs]
    assert 'class="tnd-explain tnd-explain-shape"' in data["text/html"] and "model.fc" in data["text/plain"]


def test_post_mortem_line_magic_and_auto_paragraph(ip: Any) -> None:
    with capture_output() as cap:
        ip.run_cell("out = model(torch.randn(2, 3, 32, 32))")
    [paragraph] = [o.data for o in cap.outputs]
    assert paragraph["text/plain"].startswith("torch_nbdebug: shape mismatch at `model.fc`")
    assert 'class="tnd-explain-auto"' in paragraph["text/html"]
    result = ip.run_line_magic("explain", "-o")
    assert isinstance(result, Diagnosis) and (result.kind, result.module) == ("shape", "model.fc")
    assert not result.recorded


def test_auto_paragraph_is_silent_for_other_errors_and_can_be_turned_off(ip: Any) -> None:
    with capture_output() as cap:
        ip.run_cell("int('seven')")
    assert cap.outputs == [] and "ValueError" in cap.stdout
    with capture_output():
        ip.run_line_magic("explain", "--auto off")
    with capture_output() as cap:
        ip.run_cell("out = model(torch.randn(2, 3, 32, 32))")
    assert cap.outputs == [] and "mat1 and mat2" in cap.stdout
    with capture_output():
        ip.run_line_magic("explain", "--auto on")


def test_auto_paragraph_suggests_explain_for_inplace(ip: Any) -> None:
    with capture_output() as cap:
        ip.run_cell("net = Gate(inplace_act=True)\nnet(torch.randn(3, 4)).sum().backward()")
    [paragraph] = [o.data for o in cap.outputs]
    assert "in place" in paragraph["text/plain"] and "`net.act`" in paragraph["text/plain"]
    assert "%%explain" in paragraph["text/plain"]


def test_quiet_shows_nothing_and_post_mortem_keeps_the_recorded_culprit(ip: Any) -> None:
    body = "net = Gate(inplace_act=True)\nloss = net(torch.randn(3, 4)).sum()\nloss.backward()\n"
    with capture_output() as cap:
        ip.run_cell("%%explain -q\n" + body)
    assert cap.outputs == [] and "modified by an inplace operation" in cap.stdout
    d = ip.run_line_magic("explain", "-o")
    assert d.recorded and (d.kind, d.culprit_module) == ("inplace", "net.act")


def test_numpy_round_trip_is_named_as_the_cut(ip: Any) -> None:
    ip.run_cell("net = Gate()\nx = torch.randn(2, 4)")
    d, _ = explain_cell(ip, "out = torch.from_numpy(net(x).detach().numpy())\nloss = out.sum()\nloss.backward()\n")
    assert (d.kind, d.culprit_op, d.culprit_lineno) == ("no_grad", "detach", 1)


def test_matmul_in_a_module_suggests_a_transpose(ip: Any) -> None:
    ip.run_cell("class Attn(nn.Module):\n    def forward(self, q, k):\n        return q @ k\nattn = Attn()")
    d, _ = explain_cell(ip, "out = attn(torch.randn(2, 5, 8), torch.randn(2, 5, 8))\n")
    assert (d.kind, d.op, d.module, d.line) == ("shape", "aten::bmm", "attn", "return q @ k")
    assert "transpose the last two dimensions" in d.hint
    assert {o.name: o.shape for o in d.operands} == {"q": (2, 5, 8), "k": (2, 5, 8)}
    ip.user_ns.pop("attn", None)
    ip.user_ns.pop("Attn", None)


@pytest.mark.parametrize("cell", ["net = Gate(inplace_act=True)\nnet(torch.randn(3, 4)).sum().backward()",
                                  "loss = torch.zeros(3).sum()\nloss.backward()"])
def test_auto_paragraph_suggests_explain_once(ip: Any, cell: str) -> None:
    with capture_output() as cap:
        ip.run_cell(cell)
    [paragraph] = [o.data for o in cap.outputs]
    assert paragraph["text/plain"].count("%%explain") == 1, paragraph["text/plain"]


def test_a_recorded_card_never_asks_to_run_the_cell_with_explain(ip: Any) -> None:
    d, _ = explain_cell(ip, "loss = torch.zeros(3).sum()\nloss.backward()\n")
    assert d.kind == "no_grad" and d.recorded and not d.suggest_record
    assert "%%explain" not in d.text() and "%%explain" not in d.html(), d.text()


# -- issue 28: loss sizes, index dtypes ------------------------------------------------------------
@pytest.mark.parametrize("loss_line,loss,fix", [
    ("loss = nn.BCEWithLogitsLoss()(logits, y)", "binary_cross_entropy_with_logits", "`y.unsqueeze(1)`"),
    ("loss = F.binary_cross_entropy(torch.sigmoid(logits), y)", "binary_cross_entropy", "`y.unsqueeze(1)`"),
    ("loss = F.binary_cross_entropy_with_logits(logits, y.view(4, 1, 1))", "binary_cross_entropy_with_logits",
     "`logits.unsqueeze(1)`"),
    ("loss = F.mse_loss(logits.expand(4, 3), y)", "mse_loss", "out_features"),
])
def test_a_loss_size_error_is_a_shape_error_at_the_loss_line(ip: Any, loss_line: str, loss: str, fix: str) -> None:
    body = f"logits = torch.randn(4, 1, requires_grad=True)\ny = torch.ones(4)\n{loss_line}\n"
    d, exc = explain_cell(ip, body)
    assert isinstance(exc, (ValueError, RuntimeError))
    assert (d.kind, d.op, d.lineno, d.line) == ("shape", f"aten::{loss}", 3, loss_line)
    assert "must have the same shape" in d.summary and fix in d.hint, d.hint
    if loss != "mse_loss":
        assert "4×1" in d.summary and "and target 4" in d.summary


@pytest.mark.parametrize("line,op", [("out = torch.gather(data, 1, idx)", "gather"),
                                     ("out = data.index_select(0, idx[0])", "index_select"),
                                     ("out = data.scatter(1, idx, 1.0)", "scatter"),
                                     ("out = data[idx]", "index")])
def test_a_float_index_is_a_dtype_error_naming_the_index(ip: Any, line: str, op: str) -> None:
    body = f"data = torch.randn(3, 4)\nidx = torch.zeros(3, 2)\n{line}\n"
    d, _ = explain_cell(ip, body)
    assert (d.kind, d.op, d.lineno) == ("dtype", f"aten::{op}", 3)
    name = "idx[0]" if op == "index_select" else "idx"
    assert f"`{name}`" in d.summary and f"`{name}.long()`" in d.hint, d.hint


MADE_IN_FORWARD = """
class Made(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
    def forward(self, x):
        proj = nn.Linear(4, 4)
        mask = torch.ones(2, 4)
        return proj(self.fc(x)) if self.use_proj else self.fc(x) * mask

class Lazy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
    def forward(self, x):
        if not hasattr(self, "head"):
            self.head = nn.Linear(4, 2)
        return self.head(self.fc(x))
"""


@pytest.mark.parametrize("use_proj", [True, False])
def test_what_a_forward_made_for_itself_is_named_as_the_models(ip: Any, use_proj: bool) -> None:
    """``model.to(device)`` never moves a module or tensor made inside ``forward`` (the meta device stands
    in for a GPU): it is named as the model's (``model.proj``, not ``linear``), its line is the culprit."""
    ip.run_cell(MADE_IN_FORWARD + f"model = Made().to('meta')\nmodel.use_proj = {use_proj}\n")
    d, exc = explain_cell(ip, "out = model(torch.randn(2, 4, device='meta'))\n")
    assert d.kind == "device"
    if use_proj:
        assert d.module == "model.proj" and (d.culprit_module, d.culprit_line) == ("model", "proj = nn.Linear(4, 4)")
        assert "create it once in `__init__` (`self.proj = ...`)" in d.hint, d.hint
    else:
        assert d.module == "model" and (d.culprit_module, d.culprit_line) == ("model", "mask = torch.ones(2, 4)")
        assert "`mask` is made inside `model`'s forward" in d.hint and "device=x.device" in d.hint, d.hint
    assert d.culprit_lineno == 6 + (not use_proj) and d.culprit_filename == d.filename
    ip.user_ns.pop("Made", None)


def test_a_submodule_a_forward_registers_after_to_is_named_with_its_line(ip: Any) -> None:
    ip.run_cell(MADE_IN_FORWARD + "model = Lazy().to('meta')\n")
    d, _ = explain_cell(ip, "out = model(torch.randn(2, 4, device='meta'))\n")
    assert (d.kind, d.module, d.culprit_module) == ("device", "model.head", "model"), d.text()
    assert (d.culprit_lineno, d.culprit_line) == (16, "self.head = nn.Linear(4, 2)")
    assert "create it once in `__init__` (`self.head = ...`)" in d.hint and "anew" not in d.hint
    ip.user_ns.pop("Lazy", None)
    ip.user_ns.pop("Made", None)


# -- issue 28: graph reuse -------------------------------------------------------------------------
RNN = """
class Rnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.RNNCell(4, 8)
        self.out = nn.Linear(8, 1)
    def forward(self, x, h):
        h = self.cell(x, h)
        return self.out(h), h
rnn = Rnn()
x = torch.randn(2, 4)
h = torch.zeros(2, 8)
"""
LOOP_STEP = "    prediction, h = rnn(x, h)\n    loss = prediction.sum()\n    loss.backward()\n"


def _clean_rnn(ip: Any) -> None:
    for name in ("Rnn", "rnn", "prediction", "ex", "loss1", "loss2", "caught", "opt"):
        ip.user_ns.pop(name, None)


def test_graph_reuse_names_the_loop_line_that_carries_the_hidden_state(ip: Any) -> None:
    ip.run_cell(RNN)
    d, _ = explain_cell(ip, "for step in range(3):\n" + LOOP_STEP)
    assert (d.kind, d.lineno, d.culprit_lineno, d.culprit_line) == ("graph_reuse", 4, 2, "prediction, h = rnn(x, h)")
    assert d.culprit_module == "" and "`h = h.detach()`" in d.hint and "`rnn.cell`" in d.hint, d.hint
    _clean_rnn(ip)


def test_graph_reuse_under_the_twin_names_the_culprit_though_the_old_graph_came_before_it(ip: Any) -> None:
    """The first backward ran before the recording began (a step outside it): the line of this step that
    used the old tensor is still named, and no card asks to run the cell again with %%explain."""
    ip.run_cell(RNN + "prediction, h = rnn(x, h)\nprediction.sum().backward()\n")
    cell = ("import torch_nbdebug\ntry:\n    with torch_nbdebug.explain() as ex:\n    " +
            LOOP_STEP.replace("\n    ", "\n        ") + "except RuntimeError as e:\n    caught = e\n")
    assert ip.run_cell(cell).success
    d = ip.user_ns["ex"].diagnosis
    assert "second time" in str(ip.user_ns["caught"])
    assert (d.kind, d.culprit_lineno, d.culprit_line) == ("graph_reuse", 4, "prediction, h = rnn(x, h)"), d.text()
    assert d.recorded and not d.suggest_record and "%%explain" not in d.text()
    _clean_rnn(ip)


def test_two_losses_of_one_forward_name_the_first_backward(ip: Any) -> None:
    ip.run_cell(RNN)
    body = ("out = rnn.out(torch.randn(3, 8))\nloss1, loss2 = out.sum(), (out ** 2).sum()\n"
            "loss1.backward()\nloss2.backward()\n")
    d, _ = explain_cell(ip, body)
    assert (d.kind, d.lineno, d.culprit_lineno, d.culprit_line) == ("graph_reuse", 4, 3, "loss1.backward()")
    assert "`(loss1 + loss2).backward()`" in d.hint and "retain_graph=True" in d.hint
    _clean_rnn(ip)


# -- issue 28: where the gradient chain was cut -------------------------------------------------------
@pytest.mark.parametrize("body,culprit_op,line", [
    ("out = net(x)\nprint(f'{out.sum().item():.3f}')\nloss = torch.tensor(out.sum())\nloss.backward()\n", "tensor", 3),
    ("out = net(x)\nvals = [o.sum() for o in out]\nloss = torch.tensor(vals).sum()\nloss.backward()\n", "tensor", 3),
    ("import numpy as np\nout = net(x)\narr = np.tanh(out.detach().numpy())\nloss = torch.from_numpy(arr).sum()\n"
     "loss.backward()\n", "detach", 3),
    ("loss = torch.tensor(net(x).sum().item(), requires_grad=False)\nloss.backward()\n", "item", 1),
])
def test_no_grad_names_the_cut_of_a_rewrap_or_a_numpy_round_trip(ip: Any, body: str, culprit_op: str,
                                                                   line: int) -> None:
    ip.run_cell("net = Gate()\nx = torch.randn(2, 4)")
    d, _ = explain_cell(ip, body)
    assert (d.kind, d.culprit_op, d.culprit_lineno) == ("no_grad", culprit_op, line), d.text()
    assert d.culprit_line == body.splitlines()[line - 1]
    ip.user_ns.pop("vals", None)
    ip.user_ns.pop("arr", None)


@pytest.mark.parametrize("call,x", [("net", "torch.randn(2, 4)"), ("model.features", "torch.randn(2, 3, 8, 8)")])
def test_no_grad_names_the_line_that_called_a_frozen_module(ip: Any, call: str, x: str) -> None:
    """A frozen model, or the frozen backbone of a model whose head trains."""
    ip.run_cell(f"net = Gate()\nfor p in {call}.parameters():\n    p.requires_grad_(False)\nx = {x}")
    body = f"print({call}(x).sum().item())\nfeats = {call}(x)\nloss = feats.sum()\nloss.backward()\n"
    d, _ = explain_cell(ip, body)
    assert (d.kind, d.culprit_module, d.culprit_lineno) == ("no_grad", call, 2), d.text()
    assert f"every parameter of `{call}` has `requires_grad=False`" in d.hint and "nothing trains" in d.warning
    ip.user_ns.pop("feats", None)
    ip.run_cell("for p in model.parameters():\n    p.requires_grad_(True)")


# -- issue 28: in-place culprits that are not the user's `x += ...` ----------------------------------
def test_an_optimizer_step_before_backward_names_the_step_line_and_the_weight(ip: Any) -> None:
    body = ("net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))\n"
            "opt = torch.optim.SGD(net.parameters(), lr=0.1)\n"
            "out = net(torch.randn(8, 4))\n"
            "out.mean().backward(retain_graph=True)\n"
            "opt.step()\n"
            "(out ** 2).mean().backward()\n")
    d, _ = explain_cell(ip, body)
    assert (d.kind, d.culprit_op, d.culprit_lineno, d.culprit_line) == ("inplace", "SGD.step", 5, "opt.step()")
    assert "`net.1.weight`" in d.summary and "`net.1.weight`" in d.hint, d.text()
    assert "before `step()`" in d.hint
    ip.user_ns.pop("opt", None)


def test_a_slice_assignment_into_a_tensor_a_later_op_saved_is_named(ip: Any) -> None:
    ip.run_cell("class Unroll(nn.Module):\n"
                "    def __init__(self):\n"
                "        super().__init__()\n"
                "        self.cell = nn.Linear(4, 4)\n"
                "    def forward(self, x):\n"
                "        h = torch.zeros(2, 3, 4)\n"
                "        for t in range(1, 3):\n"
                "            h[:, t] = torch.tanh(self.cell(h[:, t - 1] * x))\n"
                "        return h\n"
                "net = nn.Sequential(nn.Linear(4, 4), Unroll())\n")
    d, _ = explain_cell(ip, "loss = net(torch.randn(2, 4)).sum()\nloss.backward()\n")
    assert (d.kind, d.culprit_op, d.culprit_module) == ("inplace", "__setitem__", "net.1"), d.text()
    assert (d.culprit_lineno, d.culprit_line) == (8, "h[:, t] = torch.tanh(self.cell(h[:, t - 1] * x))")
    assert "torch.stack" in d.hint
    ip.user_ns.pop("Unroll", None)


def test_explain_never_switches_grad_mode_itself(ip: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A grad-mode switch of the tool's own is a place where a Stop can leave autograd off for the rest of
    the kernel: %%explain (with --check-indices) and its post-mortem reading make none."""
    import sys

    import torch

    switches: list[str] = []
    real = torch._C._set_grad_enabled

    def spy(mode: bool) -> None:
        frame = sys._getframe(1)
        for _ in range(4):  # set_grad_enabled, no_grad.__enter__/__exit__, then whoever switched
            if frame is None:
                break
            if "/torch_nbdebug/" in frame.f_code.co_filename.replace("\\", "/"):
                switches.append(frame.f_code.co_filename)
            frame = frame.f_back
        real(mode)

    monkeypatch.setattr(torch._C, "_set_grad_enabled", spy)
    body = "emb = nn.Embedding(5, 3)\ntokens = torch.tensor([[1, 7]])\nout = emb(tokens)\n"
    explain_cell(ip, body, "--check-indices")
    explain_cell(ip, body)
    assert switches == []
