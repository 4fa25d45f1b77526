"""Under JupyterLab Dark every live view follows the theme: cards and charts on a dark background,
text in light colours, and every piece of text readable on what is behind it (contrast >= 3:1, the
WCAG minimum for large text and for the parts of a chart). Screenshots: test-artifacts/dark_*.png."""
from __future__ import annotations

import pytest
from conftest import DARK
from gallery import REPRO_CELL, VIEWS, run_gallery
from playwright.sync_api import expect

pytestmark = pytest.mark.browser

# Colour arithmetic in the page: the effective background of an element (the first non-transparent
# background up the tree, alpha-blended over what is under it), relative luminance and contrast (WCAG).
JS_COLOURS = """(root) => {
  const parse = (c) => { const m = c.match(/rgba?\\(([^)]+)\\)/); if (!m) return null;
    const p = m[1].split(/[ ,\\/]+/).filter(Boolean).map(Number); return [p[0], p[1], p[2], p.length > 3 ? p[3] : 1]; };
  const lum = (c) => { const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
    return 0.2126 * f(c[0]) + 0.7152 * f(c[1]) + 0.0722 * f(c[2]); };
  const blend = (top, under) => [0, 1, 2].map((i) => top[i] * top[3] + under[i] * (1 - top[3])).concat([1]);
  const background = (e) => {
    const layers = [];
    for (let p = e; p; p = p.parentElement) {
      const c = parse(getComputedStyle(p).backgroundColor);
      if (c && c[3] > 0) { layers.push(c); if (c[3] >= 1) break; }
    }
    let out = [255, 255, 255, 1];
    for (const c of layers.reverse()) out = blend(c, out);
    return out;
  };
  const ratio = (a, b) => { const [x, y] = [lum(a), lum(b)].sort((p, q) => q - p); return (x + 0.05) / (y + 0.05); };
  const ink = (e) => parse(e instanceof SVGElement ? getComputedStyle(e).fill : getComputedStyle(e).color);
  const surfaces = [root, ...root.querySelectorAll('.card, .plot, table, pre, button')]
    .filter((e) => e.getBoundingClientRect().width > 0)
    .map((e) => ({ what: e.tagName.toLowerCase() + '.' + (e.getAttribute('class') || ''), bg: lum(background(e)) }));
  const texts = [];
  for (const e of root.querySelectorAll('*')) {
    const own = Array.from(e.childNodes).some((n) => n.nodeType === 3 && n.textContent.trim());
    if (!own || !e.getClientRects().length || getComputedStyle(e).visibility === 'hidden') continue;
    const c = ink(e);
    if (!c) continue;
    const bg = background(e instanceof SVGElement ? e.ownerSVGElement : e);
    texts.push({ text: e.textContent.trim().slice(0, 40), tag: e.tagName.toLowerCase(), ink: lum(blend(c, bg)),
                 ratio: ratio(blend(c, bg), bg) });
  }
  return { surfaces, texts };
}"""


def test_every_view_follows_jupyterlab_dark(lab) -> None:
    page = run_gallery(lab, "dark", theme=DARK)
    assert page.evaluate("() => document.body.dataset.jpThemeLight") == "false"
    problems = []
    for view, (cell, selector) in VIEWS.items():
        root = lab.output(page, cell).locator(selector).first
        expect(root).to_be_visible()
        root.scroll_into_view_if_needed()
        found = root.evaluate(JS_COLOURS)
        assert found["texts"], f"{view}: no text found"
        for s in found["surfaces"]:
            if s["bg"] > 0.1:  # luminance: 0 black, 1 white; JupyterLab Dark's panels are ~0.01
                problems.append(f"{view}: light background under {s['what']} (luminance {s['bg']:.2f})")
        for t in found["texts"]:
            if t["ratio"] < 3:
                problems.append(f"{view}: {t['tag']} {t['text']!r} contrast {t['ratio']:.1f}:1")
        body = [t for t in found["texts"] if t["tag"] in ("td", "th", "b", "h3", "span", "div", "code")]
        if body and sorted(t["ink"] for t in body)[len(body) // 2] < 0.4:
            problems.append(f"{view}: text is not light (median luminance below 0.4)")
        lab.screenshot(root, f"dark_{view}")
    lab.screenshot(lab.output(page, REPRO_CELL), "dark_repro")
    assert not problems, "\n".join(problems)
