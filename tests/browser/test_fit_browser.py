"""Every live view fits a 900-px window: nothing runs past the output area. A wide table or chart
scrolls (or shrinks) inside the view's own box, so the rest of the view stays in place; a cut-off
timeline or a column off to the right is what this catches. Screenshots: test-artifacts/fit_*.png."""
from __future__ import annotations

import pytest
from gallery import JS_OVERFLOW, STATIC_VIEWS, VIEWS, run_gallery
from playwright.sync_api import expect

pytestmark = pytest.mark.browser

NARROW = (900, 1000)


def test_every_view_fits_a_900_px_window(lab) -> None:
    page = run_gallery(lab, "fit_900", viewport=NARROW)
    assert page.evaluate("() => window.innerWidth") == NARROW[0]
    problems = {}
    for view, (cell, selector) in {**VIEWS, **STATIC_VIEWS}.items():
        root = lab.output(page, cell).locator(selector).first
        expect(root).to_be_visible()
        root.scroll_into_view_if_needed()
        found = root.evaluate(JS_OVERFLOW)
        # The output area is narrower than the window (prompt, margins): the check means something.
        assert 500 < found["areaWidth"] < NARROW[0], found
        if found["offenders"] or found["rootScrollWidth"] > found["areaWidth"]:
            problems[view] = found
        lab.screenshot(root, f"fit_{view}_900")
    assert not problems, f"views that run past the output area in a 900-px window: {problems}"

    # The timeline's chart shrinks to the width there is and keeps its aspect ratio; the drag-to-zoom
    # arithmetic reads the drawn size, so zooming still works at this width.
    memory = lab.output(page, VIEWS["memory_timeline"][0]).locator(VIEWS["memory_timeline"][1])
    chart = memory.locator("svg.chart")
    chart.scroll_into_view_if_needed()  # the mouse drags where the chart is on screen
    box = chart.bounding_box()
    assert box is not None and box["width"] < 760 and abs(box["height"] / box["width"] - 270 / 760) < 0.02, box
    hi = memory.get_attribute("data-hi")
    y = box["y"] + box["height"] / 2
    page.mouse.move(box["x"] + box["width"] * 0.40, y)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * 0.60, y, steps=5)
    page.mouse.up()
    expect(memory).not_to_have_attribute("data-hi", hi)
    lo2, hi2 = int(memory.get_attribute("data-lo")), int(memory.get_attribute("data-hi"))
    assert 0 < lo2 < hi2 < int(hi)

    # A wide table scrolls inside its own box: its last column can be scrolled into view.
    scroller = memory.locator("div.scroll").filter(has=page.locator("table.allocs"))
    assert scroller.evaluate("e => e.scrollWidth > e.clientWidth"), "the table should be wider than the view here"
    scroller.evaluate("e => { e.scrollLeft = e.scrollWidth; }")
    last = memory.locator("table.allocs tr.alloc").first.locator("td").last
    inside = last.evaluate("""(td) => { const s = td.closest('div.scroll').getBoundingClientRect();
                                        const r = td.getBoundingClientRect();
                                        return r.left >= s.left - 1 && r.left < s.right; }""")
    assert inside
