"""One notebook that shows every live view of torch_nbdebug, for the tests that look at all of them at
once (a 900-px window, the dark theme, the keyboard): test_fit_browser.py, test_dark_browser.py,
test_a11y_browser.py.

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

# Run All stops at a failing cell: the %%explain cell (it fails on purpose) comes last.
CELLS = [SETUP, NANWATCH, MEMORY, MEMORY_STATE, GRADS, REPRO, EXPLAIN]

# view -> (cell index, selector of the view's root inside that cell's output area)
VIEWS = {
    "nanwatch": (1, ".tnd-nanwatch"),
    "memory_timeline": (2, ".tnd-memory-widget"),
    "memory_state": (3, ".tnd-memory-state"),
    "grads": (4, ".tnd-grads"),
    "explain": (6, ".tnd-explain-view"),
}
REPRO_CELL = 5  # static HTML only (render/repro.py): screenshot, not a widget

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


def run_gallery(lab, name: str, **options):
    """Open the gallery notebook (``options``: viewport, theme) and run it; the last cell (%%explain)
    fails on purpose, every other cell must not."""
    return lab.run_notebook(CELLS, name=name, allow_errors=True, **options)
