"""The nanwatch report's text, static HTML and widget state; hints and processing on hand-built data."""
from __future__ import annotations

import json

import torch
from torch import nn

from torch_nbdebug.api.nanwatch import NanReport, nanwatch
from torch_nbdebug.data.nanwatch import LayerStats, NanEvent, NanSummary
from torch_nbdebug.data.stats import TensorStats
from torch_nbdebug.process.nanwatch import hint, mark_births, summarize_watch
from torch_nbdebug.render.bundle import WIDGET_MIME
from torch_nbdebug.render.nanwatch import NanView, report_html, report_text

from test_nanwatch import check_path, make_model  # noqa: F401 - recorded reports on both check paths


def _stats(**kw: object) -> TensorStats:
    base = dict(shape=(2,), dtype="float32", device="cpu", numel=2)
    base.update(kw)
    return TensorStats(**base)  # type: ignore[arg-type]


def _event(**kw: object) -> NanEvent:
    base = dict(phase="forward", op="aten.log.default", kind="nan", module="model.1", filename="<cell>",
                lineno=2, line="y = torch.log(x)", inputs=(_stats(min=-1.0, max=1.0),), output=_stats(nan=1))
    base.update(kw)
    return NanEvent(**base)  # type: ignore[arg-type]


# -- process -------------------------------------------------------------------------------------
def test_hints_name_cause_and_fix() -> None:
    assert "negative" in hint(_event())
    assert "clamp" in hint(_event(kind="inf", inputs=(_stats(min=0.0, max=1.0, zeros=1),)))
    assert "0/0" in hint(_event(op="aten.div.Tensor"))
    assert "bfloat16" in hint(_event(op="aten.exp.default", kind="inf", output=_stats(dtype="float16", inf=1)))
    assert "GradScaler" in hint(_event(op="aten.mm.default", kind="inf", output=_stats(dtype="float16", inf=1)))
    assert "0 * inf" in hint(_event(op="aten.mul.Tensor", inputs=(_stats(inf=1), _stats(zeros=1))))
    assert "sqrt" in hint(_event(phase="backward", op="SqrtBackward0", forward_op="aten.sqrt.default"))
    assert "data" in hint(_event(phase="input"))
    opt = _event(phase="optimizer", op="Adam.step", param="model.fc.weight", iteration=7, detail="lr=10, gradient finite")
    assert "learning rate" in hint(opt) and "step 6" in hint(opt)  # iteration 7: six steps before it


def test_summarize_watch_splits_absorbed_and_marks_the_birth_row() -> None:
    fwd = _event(kind="inf", sequence_nr=5)
    bwd = _event(phase="backward", op="LogBackward0", sequence_nr=5, forward_op="aten.log.default")
    layers = (LayerStats("model"), LayerStats("model.1"))
    s = summarize_watch([fwd, bwd], {0}, layers)
    assert [e.op for e in s.events] == ["LogBackward0"] and [e.op for e in s.absorbed] == ["aten.log.default"]
    assert s.first.absorbed_forward and "torch.where" in s.first.hint
    assert [layer.birth for layer in s.layers] == [False, True]
    assert mark_births(layers, ())[1].birth is False


# -- render ---------------------------------------------------------------------------------------
def _report() -> NanReport:
    model = make_model()
    with nanwatch(namespace={"net<b>": model}) as report:
        model(torch.randn(4, 4)).sum().backward()
    return report


def test_text_html_and_widget_bundle() -> None:
    report = _report()
    bundle = report._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html", WIDGET_MIME}
    text = bundle["text/plain"]
    assert text.startswith("nanwatch: NaN born in forward: aten.log.default in net<b>.1")
    assert "why/fix:" in text and "return torch.log(h)" in text
    html = bundle["text/html"]
    assert "net&lt;b&gt;.1" in html and "net<b>" not in html  # escaped everywhere
    assert '<tr class="mark">' in html and "◀ birth" in html
    assert 'class="line hl"' in html and "return torch.log(h)" in html
    # self-contained and readable where sanitizers strip <style>/<svg> (an untrusted notebook)
    assert "<style" not in html and "<svg" not in html and "http" not in html


def test_widget_state_is_json_and_complete() -> None:
    report = _report()
    view = report.widget()
    assert isinstance(view, NanView)
    state = view.report
    json.dumps(state, allow_nan=False)
    first = state["events"][0]
    assert first["op"] == "aten.log.default" and first["module"] == "net<b>.1" and first["title"]
    assert first["lineno"] in range(state["source_first_line"], state["source_first_line"] + 400)
    assert "return torch.log(h)" in state["cell_source"]
    assert [row["module"] for row in state["layers"] if row["birth"]] == ["net<b>.1"]
    assert view.selected == 0


def test_empty_report_renders_ok_card() -> None:
    s = NanSummary(ops_checked=12)
    assert report_text(s).startswith("nanwatch: no NaN/Inf born (12 ops checked")
    assert 'class="card ok"' in report_html(s)
    assert "still running" in report_text(s, finished=False)


def test_report_never_holds_tensors() -> None:
    report = _report()

    def walk(value: object) -> None:
        assert not isinstance(value, (torch.Tensor, nn.Module))
        if isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)

    walk(report.to_dict())
    walk(list(vars(report).values()))


def test_loss_over_only_ignored_targets_gets_its_own_hint() -> None:
    logits = torch.randn(3, 5)
    target = torch.full((3,), -100)
    with nanwatch() as report:
        torch.nn.functional.cross_entropy(logits, target)
    assert report.first.op == "aten.nll_loss_forward.default" and "ignore_index" in report.first.hint


def test_numbers_are_written_one_way_exponent_from_1e5_or_below_1e_3() -> None:
    from torch_nbdebug.data.nanwatch import LayerStats
    from torch_nbdebug.data.stats import fmt_number
    from torch_nbdebug.render.nanwatch import layers_html

    assert [fmt_number(v) for v in (8.125e19, -5.136e21, 12345.6, 0.0012345, 1.5e-7, 0.0, 99999.9)] == \
        ["8.125e+19", "-5.136e+21", "12350", "0.001234", "1.5e-07", "0", "1e+05"]
    html = layers_html((LayerStats("model.encoder.0", 1, 8.125e19, -5.136e21, 3.0, True),))
    assert "8.125e+19" in html and "81250000000000000000" not in html
    assert "model.<wbr>encoder.<wbr>0" in html  # a long path may wrap at its dots
