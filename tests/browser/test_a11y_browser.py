"""The live views with the keyboard alone: what acts on a click is a Tab stop, Enter/Space act on it,
the focus is visible, icon buttons have names, memory details show on focus as they do on hover, and
the gradient stepper's arrow keys still work once ▶ has reached the last layer (and is disabled).
Screenshots: test-artifacts/a11y_*.png."""
from __future__ import annotations

import pytest
from gallery import VIEWS, run_gallery
from playwright.sync_api import expect

pytestmark = pytest.mark.browser

FOCUS_RING = "e => { const s = getComputedStyle(e); return s.outlineStyle !== 'none' && parseFloat(s.outlineWidth) >= 1; }"


def _view(lab, page, name):
    cell, selector = VIEWS[name]
    return lab.output(page, cell).locator(selector).first


def test_views_work_from_the_keyboard(lab) -> None:
    page = run_gallery(lab, "a11y")

    # Every button says what it does: its text or an aria-label has words, not only ◀ ▶.
    names = page.locator(".tnd button").evaluate_all(
        "bs => bs.map(b => (b.getAttribute('aria-label') || b.textContent).trim())")
    assert names and all(any(ch.isalpha() for ch in n) for n in names), names

    # nanwatch: Tab from one birth row to the next, Enter shows it in the card, Space goes back.
    nanwatch = _view(lab, page, "nanwatch")
    rows = nanwatch.locator("tr.nw-event")
    expect(rows).to_have_count(2)
    title = nanwatch.locator(".nw-card .nw-title")
    expect(title).to_contain_text("Inf born in backward: SqrtBackward0")
    rows.nth(0).focus()
    page.keyboard.press("Tab")
    second = nanwatch.locator("tr.nw-event[data-index='1']")
    expect(second).to_be_focused()
    page.keyboard.press("Enter")
    expect(title).to_contain_text("Inf born in forward: aten.exp.default")
    expect(nanwatch.locator("tr.nw-event[data-index='1']")).to_be_focused()  # redrawn, focus kept
    expect(nanwatch.locator("tr.nw-event[data-index='1']")).to_have_attribute("aria-current", "true")
    assert nanwatch.locator("tr.nw-event[data-index='1']").evaluate(FOCUS_RING)
    page.keyboard.press("Shift+Tab")
    page.keyboard.press(" ")
    expect(title).to_contain_text("Inf born in backward: SqrtBackward0")
    # The keys stayed in the view: the notebook did not go to edit mode on Enter.
    assert page.evaluate("() => window.jupyterapp.shell.currentWidget.content.mode") == "command"
    lab.screenshot(nanwatch, "a11y_nanwatch_focus")

    # Memory timeline: Tab from the last toolbar button reaches the first allocation row; its details
    # show on focus (not only on hover), and the focus is visible.
    memory = _view(lab, page, "memory_timeline")
    memory.locator("button[data-action='reset']").focus()
    page.keyboard.press("Tab")
    first = memory.locator("tr.alloc").first
    expect(first).to_be_focused()
    expect(memory.locator(".detail")).to_contain_text("phase")
    expect(first).to_have_class("alloc hl")
    assert first.evaluate(FOCUS_RING)
    page.keyboard.press("Tab")
    expect(first).not_to_have_class("alloc hl")  # blur takes the highlight away
    expect(memory.locator("tr.alloc").nth(1)).to_be_focused()
    lab.screenshot(memory, "a11y_memory_focus")

    # Memory now: a row's details show on focus too.
    state = _view(lab, page, "memory_state")
    state.locator("table.tensors tr[tabindex]").first.focus()
    expect(state.locator(".tip")).to_contain_text(" on cpu")

    # Gradient stepper: ▶ clicked to the last layer disables itself; the arrow keys still move.
    grads = _view(lab, page, "grads")
    label = grads.locator(".tnd-layer-name")
    expect(label).to_have_text("1/7 deep.0")
    nxt = grads.locator("button.tnd-next")
    for k in range(2, 8):
        nxt.click()
        expect(label).to_contain_text(f"{k}/7 ")
    expect(nxt).to_be_disabled()
    page.keyboard.press("ArrowLeft")
    expect(label).to_contain_text("6/7 ")
    page.keyboard.press("ArrowRight")
    expect(label).to_contain_text("7/7 ")
    # The flow bars are Tab stops of their own: Enter selects one, the focus stays on it, visibly.
    grads.focus()
    page.keyboard.press("Tab")
    page.keyboard.press("Tab")
    bar = grads.locator("g.tnd-flow-layer[data-layer='1']")
    expect(bar).to_be_focused()
    page.keyboard.press("Enter")
    expect(label).to_have_text("2/7 deep.2")
    expect(grads.locator("g.tnd-flow-layer[data-layer='1']")).to_be_focused()
    ring = grads.locator("g.tnd-flow-layer[data-layer='1'] rect.col").evaluate("e => getComputedStyle(e).strokeWidth")
    assert float(ring.replace("px", "")) >= 2, ring
    lab.screenshot(grads, "a11y_grads_focus")
