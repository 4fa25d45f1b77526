"""Under JupyterLab Dark every live view follows the theme: cards and charts on a dark background,
text in light colours, and every piece of text readable on what is behind it (contrast >= 3:1, the
WCAG minimum for large text and for the parts of a chart). The static %%repro card (inline styles only)
is held to the same rule. Screenshots: test-artifacts/dark_*.png."""
from __future__ import annotations

import pytest
from conftest import DARK
from gallery import JS_COLOURS, STATIC_VIEWS, VIEWS, dark_problems, run_gallery
from playwright.sync_api import expect

pytestmark = pytest.mark.browser


def test_every_view_follows_jupyterlab_dark(lab) -> None:
    page = run_gallery(lab, "dark", theme=DARK)
    assert page.evaluate("() => document.body.dataset.jpThemeLight") == "false"
    problems = []
    for view, (cell, selector) in {**VIEWS, **STATIC_VIEWS}.items():
        root = lab.output(page, cell).locator(selector).first
        expect(root).to_be_visible()
        root.scroll_into_view_if_needed()
        found = root.evaluate(JS_COLOURS)
        assert found["texts"], f"{view}: no text found"
        problems += dark_problems(view, found)
        lab.screenshot(root, f"dark_{view}")
    assert not problems, "\n".join(problems)
