"""The pure rules (message -> kind, op, hint) on hand-built facts and recordings, and the renderers."""
from __future__ import annotations

import pytest

from torch_nbdebug.data.explain import (CutEvent, Diagnosis, FailureFacts, InplaceEvent, OpSite, Operand,
                                        Recording)
from torch_nbdebug.process.explain import classify, diagnose
from torch_nbdebug.process.explain_hints import assigned_name
from torch_nbdebug.render.explain import diagnosis_html, diagnosis_text, paragraph_text


@pytest.mark.parametrize("message,kind", [
    ("mat1 and mat2 shapes cannot be multiplied (2x7200 and 288x10)", "shape"),
    ("Given groups=1, weight of size [8, 3, 3, 3], expected input[2, 1, 8, 8] to have 3 channels, "
     "but got 1 channels instead", "shape"),
    ("Sizes of tensors must match except in dimension 1. Expected size 2 but got size 3 for tensor number 1 "
     "in the list.", "shape"),
    ("shape '[2, 3]' is invalid for input of size 5", "shape"),
    ("The size of tensor a (4) must match the size of tensor b (5) at non-singleton dimension 1", "shape"),
    ("Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu!", "device"),
    ("Input type (torch.cuda.FloatTensor) and weight type (torch.FloatTensor) should be the same", "device"),
    ("expected target dtype to be Long or Byte, but got Float", "dtype"),
    ("mat1 and mat2 must have the same dtype, but got Double and Float", "dtype"),
    ("one of the variables needed for gradient computation has been modified by an inplace operation: "
     "[torch.FloatTensor [4, 8]], which is output 0 of SigmoidBackward0, is at version 1; expected version 0 "
     "instead.", "inplace"),
    ("Trying to backward through the graph a second time (or directly access saved tensors ...)", "graph_reuse"),
    ("element 0 of tensors does not require grad and does not have a grad_fn", "no_grad"),
    ("Target 5 is out of bounds.", "index"),
    ("index out of range in self", "index"),
    ("CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously reported", "index"),
    ("something else entirely", "other"),
])
def test_messages_are_classified(message: str, kind: str) -> None:
    assert classify(message)[0] == kind


def _facts(message: str, **kw: object) -> FailureFacts:
    return FailureFacts(exc_type="RuntimeError", message=message, from_torch=True, **kw)  # type: ignore[arg-type]


def test_device_side_assert_says_restart_and_offers_check_indices() -> None:
    d = diagnose(_facts("CUDA error: device-side assert triggered"))
    assert d is not None and d.kind == "index" and d.restart_needed
    assert "restart the kernel" in d.hint and "%%explain --check-indices" in d.hint
    assert "Restart the kernel" in diagnosis_html(d)


def test_non_torch_errors_stay_silent() -> None:
    assert diagnose(FailureFacts(exc_type="ValueError", message="bad literal", from_torch=False)) is None
    assert diagnose(_facts("weird torch failure")) is not None  # a torch error of an unknown family


def test_inplace_matches_the_recorded_event_by_node_version_and_shape() -> None:
    saver = OpSite(op="sigmoid", module="net", filename="<cell>", lineno=3, line="s = torch.sigmoid(x)")
    wrong = InplaceEvent(site=OpSite(op="add_", lineno=9), version=1, shape=(2, 2), node="SigmoidBackward0",
                         node_seq=1)
    right = InplaceEvent(site=OpSite(op="mul_", module="net.act", lineno=4, line="s.mul_(2)"), version=1,
                         shape=(4, 8), node="SigmoidBackward0", node_seq=7)
    rec = Recording(inplace=(right, wrong), sites=((7, saver),))
    message = ("one of the variables needed for gradient computation has been modified by an inplace operation: "
               "[torch.FloatTensor [4, 8]], which is output 0 of Sigmoid, is at version 1; expected version 0")
    d = diagnose(_facts(message), rec)
    assert d is not None and (d.culprit_op, d.culprit_module, d.culprit_lineno) == ("mul_", "net.act", 4)
    assert "`sigmoid` at line 3" in d.hint and not d.suggest_record
    post_mortem = diagnose(_facts(message, inplace_modules=("net.act",)))
    assert post_mortem is not None and post_mortem.suggest_record and "`net.act`" in post_mortem.hint


def test_no_grad_prefers_a_real_cut_to_a_logged_item() -> None:
    rec = Recording(cuts=(CutEvent("detach", OpSite(op="detach", lineno=2)), CutEvent("item", OpSite(op="item", lineno=5))))
    d = diagnose(_facts("element 0 of tensors does not require grad and does not have a grad_fn",
                        backward_of="loss"), rec)
    assert d is not None and (d.culprit_op, d.culprit_lineno) == ("detach", 2)
    assert "`loss.requires_grad = True`" in d.warning and "requires_grad = True" not in d.hint


def test_feature_mismatch_hint_reads_the_image_size() -> None:
    d = diagnose(_facts("mat1 and mat2 shapes cannot be multiplied (2x7200 and 288x10)", module="model.fc",
                        module_type="Linear", call="linear", model_input=(2, 3, 32, 32), model_has_conv=True))
    assert d is not None and d.op == "aten::linear"
    assert "7200 features for 32×32 inputs" in d.hint and "5× larger" in d.hint and "in_features=7200" in d.hint


def test_assigned_name() -> None:
    assert assigned_name("h = torch.tanh(x)") == "h" and assigned_name("self.h += 1") == "self.h"
    assert assigned_name("loss.backward()") == "" and assigned_name("a == b") == ""


def test_html_escapes_user_strings_and_survives_sanitizers() -> None:
    d = Diagnosis(kind="shape", message="<b>", module="m<script>", line="x = a<b", hint="use `x<y`",
                  summary="s&", operands=(Operand(name="<img>", shape=(2,), dtype="float32", device="cpu"),))
    html = diagnosis_html(d)
    assert "<script>" not in html and "<img>" not in html and "m&lt;script&gt;" in html
    assert "<style" not in html and "<svg" not in html and 'style="' in html
    assert "<code" in html and "x&lt;y" in html
    assert diagnosis_text(d).startswith("explain [shape]") and "m<script>" in paragraph_text(d)


@pytest.mark.parametrize("message,kind", [
    ("Target size (torch.Size([4])) must be the same as input size (torch.Size([4, 1]))", "shape"),
    ("Using a target size (torch.Size([4])) that is different to the input size (torch.Size([4, 1])) is "
     "deprecated. Please ensure they have the same size.", "shape"),
    ("gather(): Expected dtype int32/int64 for index", "dtype"),
    ("index_select(): Expected dtype int32 or int64 for index", "dtype"),
    ("scatter(): Expected dtype int64 for index", "dtype"),
    ("tensors used as indices must be long, int, byte or bool tensors", "dtype"),
])
def test_loss_sizes_and_index_dtypes_are_classified(message: str, kind: str) -> None:
    assert classify(message)[0] == kind


def test_carried_name_is_the_one_a_line_assigns_and_reads() -> None:
    from torch_nbdebug.process.explain_graph_reuse import carried_name

    assert carried_name("prediction, h = rnn(x, h)") == "h" and carried_name("h = torch.tanh(x)") == "h"
    assert carried_name("a, b = f(x)") == "" and carried_name("loss.backward()") == ""


def test_graph_reuse_names_the_line_outside_forward_and_the_first_of_two_backwards() -> None:
    message = "Trying to backward through the graph a second time"
    inner = OpSite(op="tanh", module="rnn.cell", lineno=8, line="h = self.cell(x, h)")
    loop = OpSite(op="", lineno=16, line="prediction, h = rnn(x, h)")
    rec = Recording(sites=((5, inner),), outer=((5, loop),))
    d = diagnose(_facts(message, backward_of="loss", freed_nodes=(("TanhBackward0", 5),), freed_users=(9,)), rec)
    assert d is not None and (d.culprit_lineno, d.culprit_line) == (16, "prediction, h = rnn(x, h)")
    assert "`h = h.detach()`" in d.hint and "`rnn.cell`" in d.hint
    first = OpSite(op="backward", lineno=3, line="loss1.backward()")
    two = Recording(backwards=(first, OpSite(op="backward", lineno=4, line="loss2.backward()")))
    d = diagnose(_facts(message, backward_of="loss2", freed_nodes=(("SumBackward0", 2),), freed_root=True), two)
    assert d is not None and d.culprit_lineno == 3 and "`(loss1 + loss2).backward()`" in d.hint
    same = Recording(backwards=two.backwards, repeated_root=True)
    d = diagnose(_facts(message, backward_of="loss", freed_nodes=(("SumBackward0", 2),), freed_root=True), same)
    assert d is not None and "a second time through the same graph" in d.summary
