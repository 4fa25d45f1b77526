"""The Python twins (``explain()``, ``explain_exception``), safety (identity, no residue, no tensor kept),
the exception hook's cooperation with other handlers, and bad input."""
from __future__ import annotations

import gc
import sys
import weakref
from typing import Any

import pytest
import torch
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output
from torch import nn

import torch_nbdebug
from torch_nbdebug.api.explain import Diagnosis, Explanation, explain, explain_exception
from torch_nbdebug.errors import InputError
from torch_nbdebug.magics import explain as explain_magics
from torch_nbdebug.magics import explain_hook
from torch_nbdebug.record.modules import global_hook_counts


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(torch.sigmoid(self.proj(x)))


def test_context_manager_passes_the_exception_through_and_fills_the_diagnosis() -> None:
    gate = Gate()
    with pytest.raises(RuntimeError) as info:
        with explain() as ex:
            gate(torch.randn(2, 4)).sum().backward()
    assert isinstance(ex, Explanation) and isinstance(ex.diagnosis, Diagnosis)
    d = ex.diagnosis
    assert (d.kind, d.culprit_op, d.culprit_module) == ("inplace", "relu(inplace=True)", "gate.act")
    assert d.recorded and "modified by an inplace operation" in str(info.value)
    assert torch_nbdebug.explain is explain and torch_nbdebug.Diagnosis is Diagnosis


def test_the_same_exception_object_passes_through() -> None:
    boom = RuntimeError("Expected all tensors to be on the same device, but found at least two devices")
    with pytest.raises(RuntimeError) as info:
        with explain() as ex:
            raise boom
    assert info.value is boom and ex.diagnosis is not None and ex.diagnosis.kind == "device"


def test_no_error_gives_no_diagnosis_and_other_errors_stay_silent() -> None:
    with explain() as ex:
        torch.ones(2).sum()
    assert ex.diagnosis is None and "without an error" in ex.text()
    with pytest.raises(KeyError):
        with explain() as ex:
            {}["missing"]
    assert ex.diagnosis is None and ex.raised == "KeyError"
    try:
        int("x")
    except ValueError as err:
        assert explain_exception(err) is None


def test_explain_exception_post_mortem_reads_the_traceback() -> None:
    fc = nn.Linear(288, 10)
    try:
        fc(torch.randn(2, 7200))
    except RuntimeError as err:
        d = explain_exception(err, namespace={"fc": fc})
    assert d is not None and (d.kind, d.op, d.module) == ("shape", "aten::linear", "fc")
    assert not d.recorded and "in_features=7200" in d.hint
    assert d.text().startswith("explain [shape]") and 'data-kind="shape"' in d.html()


def test_no_tensor_is_kept_alive_and_nothing_is_left_behind() -> None:
    big = torch.randn(64, 64, requires_grad=True)
    ref = weakref.ref(big)
    before = global_hook_counts()
    with pytest.raises(RuntimeError):
        with explain() as ex:
            h = torch.sigmoid(big)
            h.mul_(2)
            h.sum().backward()
    assert ex.diagnosis is not None and ex.diagnosis.culprit_op == "mul_"
    assert global_hook_counts() == before
    del big, h
    sys.last_traceback = sys.last_value = None  # pytest keeps nothing else
    gc.collect()
    assert ref() is None


def test_keyboard_interrupt_is_not_explained_and_removes_everything() -> None:
    before = global_hook_counts()
    with pytest.raises(KeyboardInterrupt):
        with explain() as ex:
            raise KeyboardInterrupt
    assert ex.diagnosis is None and global_hook_counts() == before


def test_bad_arguments_raise_input_errors() -> None:
    with pytest.raises(InputError, match="check_indices"):
        explain(check_indices="yes")  # type: ignore[arg-type]
    with pytest.raises(InputError, match="exception object"):
        explain_exception("boom")  # type: ignore[arg-type]


# -- the magic's bad input and the exception hook ----------------------------------------------
@pytest.fixture
def shell() -> Any:
    from IPython.testing.globalipapp import get_ipython

    ip = get_ipython()
    ip.register_magics(explain_magics.MAGICS)
    yield ip
    explain_magics.unload(ip)
    for kind, names in explain_magics.MAGICS.magics.items():  # leave the shell as %unload_ext would
        for name in names:
            ip.magics_manager.magics[kind].pop(name, None)
    ip.magics_manager.registry.pop(explain_magics.MAGICS.__name__, None)


@pytest.mark.parametrize("line,cell,message", [
    ("--bogus", None, "bogus"),
    ("--auto maybe", None, "maybe"),
    ("--check-indices", None, "needs a cell"),
    ("", "   \n", "needs code"),
    ("--auto off", "x = 1\n", "line magic"),
])
def test_bad_input_gives_usage_errors(shell: Any, line: str, cell: Any, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        if cell is None:
            shell.run_line_magic("explain", line)
        else:
            shell.run_cell_magic("explain", line, cell)


def test_post_mortem_without_an_exception_says_what_to_do(shell: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(sys, "last_value", None, raising=False)
    monkeypatch.setattr(sys, "last_exc", None, raising=False)
    with pytest.raises(UsageError, match="no exception yet"):
        shell.run_line_magic("explain", "")


def test_hook_chains_to_and_restores_a_previous_custom_handler(shell: Any) -> None:
    seen: list[str] = []

    def theirs(self: Any, etype: Any, value: Any, tb: Any, tb_offset: Any = None) -> None:
        seen.append(type(value).__name__)

    shell.set_custom_exc((RuntimeError,), theirs)
    previous = (shell.custom_exceptions, shell.CustomTB)
    try:
        explain_magics.load(shell)
        assert shell.custom_exceptions == (Exception,)
        shell.run_cell("import torch")
        with capture_output() as cap:
            shell.run_cell("torch.zeros(5).view(2, 3)")
        assert seen == ["RuntimeError"]  # their handler showed the error...
        assert "view to [2, 3]" in cap.outputs[0].data["text/plain"]  # ...and ours added the paragraph
        explain_magics.unload(shell)
        assert (shell.custom_exceptions, shell.CustomTB) == previous
        assert explain_hook.active(shell) is None
    finally:
        shell.set_custom_exc((), None)


def test_load_ext_installs_the_hook_and_unload_removes_it(ipython: Any) -> None:
    assert explain_hook.active(ipython) is not None and "explain" in ipython.magics_manager.magics["cell"]
    ipython.run_line_magic("unload_ext", "torch_nbdebug")
    assert explain_hook.active(ipython) is None and ipython.custom_exceptions == ()
    ipython.run_line_magic("load_ext", "torch_nbdebug")


# -- names from a running function's locals ----------------------------------------------------
def test_names_inside_a_function_come_from_its_locals_and_nothing_is_kept_alive() -> None:
    fc = nn.Linear(288, 10)
    tokens = torch.randn(2, 7200)
    refs = [weakref.ref(fc), weakref.ref(tokens)]
    with pytest.raises(RuntimeError):
        with explain() as ex:
            fc(tokens)
    d = ex.diagnosis
    assert d is not None and (d.kind, d.module) == ("shape", "fc")  # a local model, named as written
    assert [o.name for o in d.operands] == ["tokens", "fc.weight", "fc.bias"]  # `input` is `tokens` again
    assert d.operands[0].shape == (2, 7200)
    # While this function still runs, deleting the locals frees them: the explainer kept no snapshot.
    del fc, tokens
    gc.collect()
    assert [r() for r in refs] == [None, None]


def test_operands_on_a_line_of_the_function_itself_are_named() -> None:
    first, second = torch.randn(3, 4), torch.randn(3, 5)
    ref = weakref.ref(second)
    with pytest.raises(RuntimeError):
        with explain() as ex:
            torch.cat([first, second], dim=0)
    d = ex.diagnosis
    assert d is not None and d.kind == "shape"
    assert [(o.name, o.shape) for o in d.operands] == [("first", (3, 4)), ("second", (3, 5))]
    del second
    gc.collect()
    assert ref() is None


def test_operands_are_told_apart_by_identity_not_by_looks() -> None:
    """``x`` and ``fc.bias`` look alike (shape (3,), float32, leaves that require grad) but are two tensors:
    both are listed; ``input`` in ``Linear.forward`` is ``x`` itself and is listed once, as ``x``."""
    fc = nn.Linear(4, 3)
    x = torch.randn(3, requires_grad=True)
    refs = [weakref.ref(x), weakref.ref(fc.bias)]
    with pytest.raises(RuntimeError):
        with explain() as ex:
            fc(x)
    d = ex.diagnosis
    assert d is not None and d.kind == "shape"
    assert [(o.name, o.shape) for o in d.operands] == [("x", (3,)), ("fc.weight", (3, 4)), ("fc.bias", (3,))]
    del fc, x
    gc.collect()
    assert [r() for r in refs] == [None, None]


DEV_LIBRARY = '''
import torch
from torch import nn


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)

    def forward(self, ids):
        return self.emb(ids)
'''


def test_explain_exception_names_a_model_from_a_library_installed_in_development_mode(tmp_path: Any) -> None:
    """A library of the user's installed with ``pip install -e`` is user code (not under site-packages):
    the innermost user frame is in it, but the model is named in the globals further out (here: this
    module's, as a notebook's)."""
    import importlib.util

    path = tmp_path / "devlib_tagger.py"
    path.write_text(DEV_LIBRARY)
    spec = importlib.util.spec_from_file_location("devlib_tagger", path)
    assert spec is not None and spec.loader is not None
    library = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(library)
    globals()["tagger"] = library.Tagger()
    try:
        with pytest.raises(IndexError) as info:
            tagger(torch.tensor([[3, 12]]))  # noqa: F821 - set just above, as a notebook cell would
        diagnosis = explain_exception(info.value)
        assert diagnosis is not None and diagnosis.module == "tagger.emb", diagnosis
    finally:
        del globals()["tagger"]


class PositionAdd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(16, 64)

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        return embeds + self.pos(torch.arange(embeds.shape[1])).to(embeds.device)


def test_the_op_named_is_the_expression_that_raised_not_the_last_call_on_the_line() -> None:
    """``a + b.to(d)`` fails in the ``+`` (Python's column positions say so, as a traceback's carets do),
    not in ``to``, the line's last call."""
    model = PositionAdd()
    with pytest.raises(RuntimeError) as info:
        model(torch.randn(2, 16, 48))
    diagnosis = explain_exception(info.value, namespace={"model": model})
    assert diagnosis is not None and diagnosis.kind == "shape" and diagnosis.op == "aten::add", diagnosis


class Wrapped(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ᾱ = (x.to("cpu") * 2
             + y.reshape(3))
        return ᾱ


def test_the_op_named_reads_expressions_over_several_lines_and_after_non_ascii_names() -> None:
    """Python's column positions count UTF-8 bytes, and a bracketed expression may span lines."""
    with pytest.raises(RuntimeError) as info:
        Wrapped()(torch.ones(2), torch.ones(3))
    diagnosis = explain_exception(info.value, namespace={})
    assert diagnosis is not None and diagnosis.op == "aten::add", diagnosis
