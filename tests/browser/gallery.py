"""One notebook that shows every live view of torch_nbdebug, for the tests that look at all of them at
once (a 900-px window, the dark theme, the keyboard): test_fit_browser.py, test_dark_browser.py,
test_a11y_browser.py, and all three in Notebook 7: test_notebook7_browser.py.

Names are long on purpose (a module path, a holder, a source line), as in real models, so a view that
does not wrap or scroll shows it. ``VIEWS`` maps a view's name to the index of the cell that shows it
and the CSS selector of its root, so a test can walk them all.
"""
from __future__ import annotations

# TORCH_NBDEBUG_LIVE=0: these tests look at the final views, so the magics skip the live progress view
# (render/live.py, tested in its own files) that the final view otherwise replaces.
SETUP = """
import os
os.environ["TORCH_NBDEBUG_LIVE"] = "0"
import torch
from torch import nn
import torch.nn.functional as F
%load_ext torch_nbdebug

class AttentionWithAVeryLongDescriptiveName(nn.Module):
    def __init__(self):
        super().__init__()
        self.query_key_value_projection = nn.Linear(4, 4)
    def forward(self, x):
        h = self.query_key_value_projection(x)
        return torch.sqrt(torch.relu(h))

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 4), AttentionWithAVeryLongDescriptiveName(), nn.Linear(4, 1))
xb = torch.randn(8, 4)
deep = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(16, 16), nn.Tanh())], nn.Linear(16, 2))
opt = torch.optim.SGD(deep.parameters(), lr=0.05)
"""
# The line of SETUP (as the kernel numbers it) whose sqrt makes the backward birth.
SQRT_LINE = SETUP.lstrip("\n").splitlines().index("        return torch.sqrt(torch.relu(h))") + 1

# Two births: Inf in backward (the gradient of sqrt at 0), then an exp overflow in forward.
NANWATCH = """%%nanwatch
out = model(xb)
loss = out.sum()
loss.backward()
scale = torch.exp(torch.full((2,), 200.0))
"""

MEMORY = """%%cudamem --device cpu
validation_losses_kept_with_their_graphs = []
for step in range(4):
    batch_of_inputs = torch.randn(64, 16)
    loss = F.mse_loss(deep(batch_of_inputs), torch.zeros(64, 2))
    opt.zero_grad()
    loss.backward()
    opt.step()
    validation_losses_kept_with_their_graphs.append(loss)
"""

MEMORY_STATE = "%cudamem --device cpu"

GRADS = """%%grads deep
for step in range(6):
    opt.zero_grad()
    F.mse_loss(deep(torch.randn(32, 16)), torch.randn(32, 2)).backward()
    opt.step()
"""

EXPLAIN = """%%explain
features = torch.randn(2, 3, 32, 32).flatten(1)
logits = model(features)
"""

REPRO = """%%repro --no-restore-rng
noise = torch.randn(4)
"""

GRAPH = "%graph model(xb).sum()"

MONITOR = """%%monitor loss
for step in range(30):
    loss = F.mse_loss(deep(torch.randn(32, 16)), torch.zeros(32, 2))
    opt.zero_grad()
    loss.backward()
    opt.step()
"""

# Run All stops at a failing cell: the %%explain cell (it fails on purpose) comes last.
CELLS = [SETUP, NANWATCH, MEMORY, MEMORY_STATE, GRADS, REPRO, GRAPH, MONITOR, EXPLAIN]

# view -> (cell index, selector of the view's root inside that cell's output area)
VIEWS = {
    "nanwatch": (1, ".tnd-nanwatch"),
    "memory_timeline": (2, ".tnd-memory-widget"),
    "memory_state": (3, ".tnd-memory-state"),
    "grads": (4, ".tnd-grads"),
    "graph": (6, ".tnd-graph-widget"),
    "monitor": (7, ".tnd-monitor"),
    "explain": (8, ".tnd-explain-view"),
}
REPRO_CELL = 5  # static HTML only (render/repro.py): screenshot, not a widget
# Static HTML views (no widget, no stylesheet of ours): same shape as VIEWS.
STATIC_VIEWS = {"repro": (REPRO_CELL, ".tnd-repro")}

# Elements of a view that stick out of the output area's visible width. An element may be wider only
# inside a scroll container of the view's own (overflow-x auto/scroll below the view's root): that
# part scrolls inside the output, the rest of the view stays put. JupyterLab's own output scroller
# does not count: scrolling the whole view sideways to read a column is what "cut off" means.
JS_OVERFLOW = """(root) => {
  const area = root.closest('.jp-OutputArea-output') || root.parentElement;
  const limit = area.getBoundingClientRect().left + area.clientWidth + 1;
  const scrolls = (e) => ['auto', 'scroll'].includes(getComputedStyle(e).overflowX);
  const inScroller = (e) => { for (let p = e.parentElement; p && p !== area; p = p.parentElement) {
    if (scrolls(p)) return true; if (p === root) break; } return false; };
  const out = [];
  for (const e of [root, ...root.querySelectorAll('*')]) {
    const r = e.getBoundingClientRect();
    if (!r.width || r.right <= limit || inScroller(e)) continue;
    const name = e.tagName.toLowerCase() + (e.getAttribute('class') ? '.' + e.getAttribute('class').split(' ').join('.') : '');
    out.push(`${name} right=${Math.round(r.right)} > ${Math.round(limit)}`);
  }
  return {offenders: out, areaWidth: area.clientWidth, rootScrollWidth: root.scrollWidth};
}"""


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


def dark_problems(view: str, found: dict) -> list[str]:
    """What JS_COLOURS found that does not suit a dark theme: a light surface, text under 3:1 contrast
    (the WCAG minimum for large text and for the parts of a chart), or body text that is not light."""
    problems = []
    for s in found["surfaces"]:
        if s["bg"] > 0.1:  # luminance: 0 black, 1 white; JupyterLab Dark's panels are ~0.01
            problems.append(f"{view}: light background under {s['what']} (luminance {s['bg']:.2f})")
    for t in found["texts"]:
        if t["ratio"] < 3:
            problems.append(f"{view}: {t['tag']} {t['text']!r} contrast {t['ratio']:.1f}:1")
    # Body text: HTML text and the labels of SVG figures (a graph's node names are its main text). Its
    # median must be at least as light as JupyterLab Dark's secondary text (--jp-ui-font-color2, which
    # blends to luminance ~0.29 on its panels); any text colour meant for a light page is below 0.2
    # (black 0, JupyterLab Light's secondary text ~0.18, GitHub grey #57606a ~0.11).
    body = [t for t in found["texts"] if t["tag"] in ("td", "th", "b", "h3", "span", "div", "code", "text")]
    if body and sorted(t["ink"] for t in body)[len(body) // 2] < 0.25:
        darkest = sorted(body, key=lambda t: t["ink"])[:len(body) // 2 + 1]
        problems.append(f"{view}: text is not light (median luminance below 0.25): "
                        + ", ".join(f"{t['tag']} {t['text']!r} {t['ink']:.2f}" for t in darkest))
    return problems


def run_gallery(lab, name: str, **options):
    """Open the gallery notebook (``options``: viewport, theme) and run it; the last cell (%%explain)
    fails on purpose, every other cell must not."""
    return lab.run_notebook(CELLS, name=name, allow_errors=True, **options)
