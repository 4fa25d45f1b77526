"""The %%repro report as text and static HTML: what a person reads, escaped, sanitizer-safe."""
from __future__ import annotations

from torch_nbdebug.api.repro import ReproReport
from torch_nbdebug.data.repro import NondeterministicUse, PreflightItem, ReproOp, ReproSummary
from torch_nbdebug.render.repro import report_html, report_text

FIRST = ReproOp(op="aten.index_add_.default", module="model.<b>emb</b>", filename="<cell>", lineno=3,
                line="out.index_add_(0, idx, rows)  # <script>", phase="backward", max_abs_diff=2.5e-7,
                input=None, kind="output", index=41)
SUMMARY = ReproSummary(
    identical=False, first=FIRST, cause="nondeterministic_op", hint="call torch.use_deterministic_algorithms(True)",
    nondeterministic_ops=(NondeterministicUse("aten.index_add_.default", "cuda", 2, "<cell>", 3, "out.index_add_(...)"),),
    preflight=(PreflightItem("CUBLAS_WORKSPACE_CONFIG", "unset", "warn", "set it to :4096:8"),
               PreflightItem("torch.backends.cudnn.benchmark", "off", "ok")),
    ops=(120, 42), state=("model", "opt"), notes=("side effects outside torch happened twice",))


def test_text_names_op_line_phase_cause_and_fix() -> None:
    text = report_text(SUMMARY)
    assert text.splitlines()[0] == ("repro: the runs differ - cause: nondeterministic_op "
                                    "(same inputs, different output (a nondeterministic kernel))")
    assert "aten.index_add_.default at line 3 in model.<b>emb</b>, backward" in text
    assert "max |diff| >= 2.5e-07" in text and "fix: call torch.use_deterministic_algorithms(True)" in text
    assert "nondeterministic on cuda: aten.index_add_.default x2 line 3" in text
    assert "preflight: CUBLAS_WORKSPACE_CONFIG = unset - set it to :4096:8" in text
    assert "cudnn.benchmark" not in text  # only warnings in the text view


def test_html_is_escaped_and_static() -> None:
    html = report_html(SUMMARY)
    assert "<script>" not in html and "&lt;script&gt;" in html and "model.&lt;b&gt;emb&lt;/b&gt;" in html
    assert "<style" not in html and "<svg" not in html and "style=" in html
    assert "CUBLAS_WORKSPACE_CONFIG" in html and "side effects" in html


def test_identical_and_bundle() -> None:
    report = ReproReport(ReproSummary(identical=True, ops=(10, 10)))
    bundle = report._repr_mimebundle_()
    assert set(bundle) == {"text/plain", "text/html"}
    assert bundle["text/plain"] == "repro: the two runs are identical (10 ops compared bit for bit)"
    assert "#1a7f37" in bundle["text/html"] and report.identical and report.cause is None
    assert ReproReport().text() == "repro: still running"


def test_html_follows_the_notebook_theme() -> None:
    """Under JupyterLab Dark a hard-coded light code chip left the code unreadable (contrast 1.1:1):
    backgrounds and muted text come from JupyterLab's variables, with fallbacks for other viewers."""
    html = report_html(SUMMARY)
    assert "#f6f8fa" not in html
    assert "background:var(--jp-layout-color2," in html.replace(" ", "")
    assert "var(--jp-ui-font-color2," in html


def test_fix_text_shows_backticked_code_as_code_not_raw_backticks() -> None:
    summary = ReproSummary(identical=False, first=FIRST, cause="rng", ops=(3, 3),
                           hint="seed with `torch.manual_seed(0)` before the cell, or pass a `<Generator>`; 1 ` left")
    html = report_html(summary)
    fix = html[html.index(">fix<"):]
    assert "<code" in fix and ">torch.manual_seed(0)</code>" in fix and ">&lt;Generator&gt;</code>" in fix
    assert "`torch" not in fix and "1 ` left" in fix  # an unpaired backtick stays as written
    assert "fix: seed with `torch.manual_seed(0)`" in report_text(summary)  # the text view keeps them
