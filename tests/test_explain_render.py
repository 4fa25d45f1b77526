"""The diagnosis widget's synced state (what the browser gets), its MIME bundle, and the static card
it sits on; diagnoses recorded by ``explain()`` on tiny CPU models and built by hand."""
from __future__ import annotations

import json
import typing
from typing import Any

import pytest
import torch
from torch import nn

from torch_nbdebug.api.explain import Diagnosis, Explanation, explain
from torch_nbdebug.data.explain import Diagnosis as DiagnosisData
from torch_nbdebug.data.explain import Operand
from torch_nbdebug.process.explain_hints import REQUIRES_GRAD_WARNING
from torch_nbdebug.render.bundle import WIDGET_MIME
from torch_nbdebug.render.explain import (DiagnosisPayload, ExplainView, OperandPayload, diagnosis_html,
                                          payload)
from torch_nbdebug.render.widget import unpack


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(torch.sigmoid(self.proj(x)))


def _recorded_inplace() -> Diagnosis:
    gate = Gate()
    with pytest.raises(RuntimeError):
        with explain() as ex:
            gate(torch.randn(2, 4)).sum().backward()
    assert ex.diagnosis is not None
    return ex.diagnosis


def _recorded_no_grad() -> Diagnosis:
    net = nn.Linear(4, 1)
    with pytest.raises(RuntimeError):
        with explain() as ex:
            with torch.no_grad():
                loss = net(torch.randn(3, 4)).sum()
            loss.backward()
    assert ex.diagnosis is not None and ex.diagnosis.kind == "no_grad"
    return ex.diagnosis


HOSTILE = Diagnosis.of(DiagnosisData(
    kind="shape", message="mat1 and mat2 shapes cannot be multiplied (2x9 and 8x1)", exc_type="RuntimeError",
    op="aten::linear", module="net<script>alert(1)</script>", filename="<cell>", lineno=3,
    line="y = net(x) # </td><b>", hint="set `in_features=9` in `net<b>`", summary="`net<b>` expects 8",
    operands=(Operand(name="x<i>", shape=(2, 9), dtype="float32", device="cpu", producer="cell line 2"),
              Operand(name="sparse", shape=None, dtype="float32", device="meta"))))


def _walk(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [v for x in value.values() for v in _walk(x)]
    if isinstance(value, list):
        return [v for x in value for v in _walk(x)]
    return [value]


# -- the synced state ----------------------------------------------------------------------------
def test_widget_state_is_the_diagnosis_as_json() -> None:
    d = _recorded_inplace()
    view = d.widget()
    assert isinstance(view, ExplainView) and view.expanded is False
    state = view.diagnosis
    assert json.loads(json.dumps(state, allow_nan=False)) == state  # survives the comm unchanged
    assert set(state) == set(typing.get_type_hints(DiagnosisPayload))
    assert all(isinstance(v, (str, int, bool, type(None))) for v in _walk(state))  # no tensors, no tuples
    assert (state["kind"], state["title"]) == ("inplace", "Saved tensor modified in place")
    assert (state["culprit_op"], state["culprit_module"]) == ("relu(inplace=True)", "gate.act")
    assert state["culprit_lineno"] > 0 and "self.act" in state["culprit_line"]
    assert state["recorded"] is True and state["warning"] == ""
    assert state["text"] == d.text()  # what the copy button copies


def test_operands_carry_name_shape_dtype_device_and_producer() -> None:
    state = payload(HOSTILE)
    assert state["operands"] == [
        OperandPayload(name="x<i>", shape=[2, 9], dtype="float32", device="cpu", producer="cell line 2",
                       requires_grad=False),
        OperandPayload(name="sparse", shape=None, dtype="float32", device="meta", producer="", requires_grad=False)]
    assert set(state["operands"][0]) == set(typing.get_type_hints(OperandPayload))


def test_user_strings_reach_the_widget_raw_and_the_static_card_escaped() -> None:
    state = payload(HOSTILE)
    assert state["module"] == "net<script>alert(1)</script>"  # the view puts it in a text node
    html = diagnosis_html(HOSTILE)
    assert "<script>" not in html and "</td><b>" not in html and "x<i>" not in html
    assert "net&lt;script&gt;" in html


def test_the_view_writes_no_html_strings() -> None:
    js = unpack(ExplainView._esm)[0]  # the module as sent: the view's code and the shared dom.js it imports
    assert "innerHTML" not in js and "insertAdjacentHTML" not in js and "outerHTML" not in js
    assert "children.flat(Infinity)" in js  # nested children (culprit: op, " in ", [module, line]) are flattened
    assert "aria-expanded" in js and "aria-label" in js  # the toggle says its state; the icon button its name


def test_no_grad_warning_is_its_own_field() -> None:
    d = _recorded_no_grad()
    assert d.warning == REQUIRES_GRAD_WARNING and REQUIRES_GRAD_WARNING not in d.hint
    state = ExplainView.of(d).diagnosis
    assert state["warning"] == REQUIRES_GRAD_WARNING and state["hint"] == d.hint
    assert f"careful: {REQUIRES_GRAD_WARNING}" in d.text()  # every view still says it, once
    assert d.text().count("requires_grad = True") == 1
    html = d.html()
    assert 'class="tnd-explain-careful"' in html and html.count("requires_grad = True") == 1
    assert d.paragraph().text().endswith(REQUIRES_GRAD_WARNING)


def test_expanded_is_synced_and_settable() -> None:
    view = ExplainView.of(HOSTILE, expanded=True)
    assert view.expanded is True
    synced = {name for name in view.trait_names(sync=True) if not name.startswith("_")}
    assert {"diagnosis", "expanded"} <= synced
    assert not synced - {"diagnosis", "expanded", "layout", "tabbable", "tooltip"}  # nothing heavy


# -- bundles -------------------------------------------------------------------------------------
def test_bundle_carries_text_static_card_and_widget() -> None:
    d = _recorded_inplace()
    for shown in (d, _explanation(d)):
        data = shown._repr_mimebundle_()
        assert set(data) == {"text/plain", "text/html", WIDGET_MIME}
        assert data["text/plain"].startswith("explain [inplace]")
        assert 'class="tnd-explain tnd-explain-inplace"' in data["text/html"]  # the saved notebook's view
        assert data[WIDGET_MIME]["model_id"]


def test_no_diagnosis_means_no_widget() -> None:
    with explain() as ex:
        torch.ones(2).sum()
    data = ex._repr_mimebundle_()
    assert set(data) == {"text/plain", "text/html"} and "without an error" in data["text/plain"]
    assert set(HOSTILE.paragraph()._repr_mimebundle_()) == {"text/plain", "text/html"}  # under tracebacks


def _explanation(d: Diagnosis) -> Explanation:
    ex = Explanation()
    ex.diagnosis, ex.finished = d, True
    return ex
