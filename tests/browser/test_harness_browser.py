"""The browser harness itself: a real JupyterLab, a real kernel from this venv, a real widget."""
from __future__ import annotations

import sys
import time

import nbformat
import pytest
from playwright.sync_api import expect

pytestmark = pytest.mark.browser

# A tiny anywidget defined in the cell: the button increments `count` in the browser, Python observes
# it and answers through `reply`, which the browser renders. The text only changes after a full
# browser -> kernel -> browser round trip.
COUNTER_CELL = '''
import anywidget, traitlets

class Counter(anywidget.AnyWidget):
    _esm = """
    export default {
      render({ model, el }) {
        const button = document.createElement("button");
        button.className = "harness-button";
        button.textContent = "add one";
        const label = document.createElement("span");
        label.className = "harness-reply";
        const show = () => { label.textContent = model.get("reply"); };
        button.addEventListener("click", () => {
          model.set("count", model.get("count") + 1);
          model.save_changes();
        });
        model.on("change:reply", show);
        show();
        el.append(button, label);
        return () => model.off("change:reply", show);
      }
    };
    """
    count = traitlets.Int(0).tag(sync=True)
    reply = traitlets.Unicode("python saw 0 clicks").tag(sync=True)

    @traitlets.observe("count")
    def _answer(self, change):
        self.reply = f"python saw {change['new']} clicks, squared {change['new'] ** 2}"

counter = Counter()
counter
'''


def test_kernel_is_this_venv_and_text_output_is_readable(lab) -> None:
    page = lab.run_notebook([
        "import sys, torch_nbdebug\nprint('prefix=' + sys.prefix)\nprint('ok', 6 * 7)",
    ], name="harness_text")
    text = lab.output_text(page, 0)
    assert f"prefix={sys.prefix}" in text
    assert "ok 42" in text


def test_widget_click_round_trips_through_python(lab) -> None:
    page = lab.run_notebook([COUNTER_CELL], name="harness_widget")
    out = lab.output(page, 0)
    button = out.locator("button.harness-button")
    reply = out.locator(".harness-reply")
    expect(reply).to_have_text("python saw 0 clicks")
    button.click()
    expect(reply).to_have_text("python saw 1 clicks, squared 1")
    button.click()
    button.click()
    expect(reply).to_have_text("python saw 3 clicks, squared 9")
    # The kernel's own object holds the count the browser set.
    expect(lab.run_cell(page, "print('count in python:', counter.count)")).to_contain_text(
        "count in python: 3")
    lab.screenshot(page, "harness_widget")


def test_cell_error_is_reported_with_its_traceback(lab) -> None:
    with pytest.raises(AssertionError, match=r"cell 1: ZeroDivisionError: division by zero"):
        lab.run_notebook(["x = 1", "x / 0", "print('never runs')"], name="harness_error")
    page = lab.pages[-1]
    expect(lab.output(page, 1)).to_contain_text("ZeroDivisionError")
    assert lab.output_text(page, 2) == ""


def test_kernel_crash_fails_fast(lab) -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError, match="the kernel died while running"):
        lab.run_notebook(["import os", "os._exit(1)", "print('never')"], name="harness_crash")
    assert time.monotonic() - start < 120  # not the 900 s run timeout


def test_open_notebook_runs_afresh(lab, tmp_path) -> None:
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# A saved notebook"),
        nbformat.v4.new_code_cell("print('fresh', sum(range(5)))", execution_count=7, outputs=[
            nbformat.v4.new_output("stream", name="stdout", text="stale output\n")]),
        # A cell meant to fail (the teaching notebooks have them): Run All goes on past it.
        nbformat.v4.new_code_cell("raise ValueError('meant to fail')",
                                  metadata={"tags": ["raises-exception"]}),
        nbformat.v4.new_code_cell("print('after the failure')"),
    ])
    path = tmp_path / "harness_saved.ipynb"
    nbformat.write(nb, path)
    page = lab.open_notebook(path)
    expect(lab.output(page, 1)).to_contain_text("fresh 10")
    assert "stale" not in lab.output_text(page, 1)
    expect(lab.cell(page, 0)).to_contain_text("A saved notebook")
    expect(lab.output(page, 2)).to_contain_text("ValueError: meant to fail")
    expect(lab.output(page, 3)).to_contain_text("after the failure")
