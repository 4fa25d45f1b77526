"""%graph benchmark, side by side with torchviz ``make_dot`` + a ``dot`` layout on the same graphs.

    .venv/bin/python bench/bench_graph.py [--repeat 5] [--layers 48]

Cases (issue 3 targets): a GPT-48-like model (~3,400 autograd nodes): ``%graph loss`` through a real
IPython shell to the first view (text + static SVG + widget) <= 1 s, ``%%graph`` around the forward,
opening one module <= 0.5 s; a 5,000-layer chain to the first view <= 2 s (torchviz: RecursionError);
100,000 nodes: a collapsed view within seconds. torchviz is timed as ``make_dot`` + ``dot -Tsvg`` with
the graphviz-pure binary (no system Graphviz). Timings are medians of interleaved repeats, single
thread; the machine is shared, so read the ratios as much as the seconds.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import subprocess
import sys
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from timing import clock, interleave

torch.set_num_threads(1)
DOT = shutil.which("graphviz-pure", path=os.path.dirname(sys.executable)) or shutil.which("dot")


class Attn(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, d)
        self.v_proj = nn.Linear(d, d)
        self.c_proj = nn.Linear(d, d)
        self.attn_drop = nn.Dropout(0.1)
        self.resid_drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.c_proj(y))


class NewGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # minGPT's GELU: several autograd nodes
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = Attn(d, heads)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(d, 4 * d), act=NewGELU(), c_proj=nn.Linear(4 * d, d),
                                      dropout=nn.Dropout(0.1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        m = self.mlp
        return x + m.dropout(m.c_proj(m.act(m.c_fc(self.ln_2(x)))))


class GPT(nn.Module):
    def __init__(self, layers: int = 48, d: int = 32, heads: int = 4, vocab: int = 64, block: int = 8) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.drop = nn.Dropout(0.1)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1])))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def torchviz_svg(tensor: torch.Tensor) -> Optional[str]:
    """torchviz's picture: make_dot + a dot layout to SVG (graphviz-pure, no system Graphviz)."""
    from torchviz import make_dot

    source = make_dot(tensor).source
    if DOT is None:
        return None
    return subprocess.run([DOT, "-Tsvg"], input=source, capture_output=True, text=True, check=True).stdout


def shell() -> Any:
    from IPython.testing.globalipapp import get_ipython

    from torch_nbdebug.magics.graph import MAGICS

    ip = get_ipython()
    ip.register_magics(MAGICS)
    return ip


def first_view(ip: Any, line: str) -> Any:
    """The magic through IPython, then everything a notebook shows: text, static SVG, widget."""
    g = ip.run_line_magic("graph", line)
    g._repr_mimebundle_()
    return g


def bench_gpt(ip: Any, layers: int, repeat: int) -> None:
    model = GPT(layers)
    idx = torch.randint(0, 64, (2, 8))
    ip.user_ns.update(model=model, idx=idx, F=F)
    ip.run_cell("loss = F.cross_entropy(model(idx).view(-1, 64), idx.view(-1))")
    g = first_view(ip, "-o loss")
    print(f"GPT-{layers}: {len(g.data.ops()):,} autograd nodes, {len(g.data.params())} parameters; "
          f"first view shows {len(g.shown())} items")
    cell = "loss = F.cross_entropy(model(idx).view(-1, 64), idx.view(-1))\nloss"
    from torch_nbdebug.api.graph import record_graph

    def recorded_forward() -> None:
        with record_graph(names=ip.user_ns):
            F.cross_entropy(model(idx).view(-1, 64), idx.view(-1))

    fns = {
        "%graph loss (first view)": lambda: first_view(ip, "-o loss"),
        "%%graph cell (forward+view)": lambda: ip.run_cell_magic("graph", "-o", cell)._repr_mimebundle_(),
        "forward under record_graph": recorded_forward,
        "plain forward (anchor)": lambda: F.cross_entropy(model(idx).view(-1, 64), idx.view(-1)),
        "torchviz make_dot + dot": lambda: torchviz_svg(ip.user_ns["loss"]),
    }
    t = interleave(fns, repeat).median_walls()
    g = ip.run_cell_magic("graph", "-o", cell)
    w = g.widget()
    block = "m:model.h.7"

    def expand_two() -> None:  # open the repeated blocks, then one block, as two clicks
        w._on_message(w, {"type": "toggle", "id": "m:model.h"}, [])
        w._on_message(w, {"type": "toggle", "id": block}, [])

    def collapse() -> None:
        w._on_message(w, {"type": "toggle", "id": "m:model.h"}, [])

    opens = []
    for _ in range(repeat):
        opens.append(clock(expand_two)[0].wall / 2)
        collapse()
    t["expand one module (per click)"] = statistics.median(opens)
    for k, v in t.items():
        print(f"  {k:34s} {v * 1000:8.1f} ms")
    viz = t["torchviz make_dot + dot"]
    print(f"  ratio first view / torchviz: {t['%graph loss (first view)'] / viz:.3f}; "
          f"recorded forward: {t['forward under record_graph'] / t['plain forward (anchor)']:.2f}x plain forward; "
          f"targets: first view <= 1000 ms -> {'OK' if t['%graph loss (first view)'] <= 1 else 'MISSED'}, "
          f"expand <= 500 ms -> {'OK' if t['expand one module (per click)'] <= 0.5 else 'MISSED'}")


def bench_chain(ip: Any, n: int, repeat: int) -> None:
    x = torch.randn(4, requires_grad=True)
    y = x
    for _ in range(n):
        y = y * 1.0001
    ip.user_ns.update(x=x, y=y)
    try:
        torchviz_svg(y)
        viz = "ok"
    except RecursionError:
        viz = "RecursionError"
    t = interleave({"first view": lambda: first_view(ip, "-o y")}, repeat).median_wall("first view")
    print(f"{n:,}-layer chain: first view {t * 1000:.1f} ms (target <= 2000 ms: {'OK' if t <= 2 else 'MISSED'}); "
          f"torchviz make_dot: {viz}")


def bench_huge(ip: Any, n: int, chains: int = 5) -> None:
    # Several chains, not one: PyTorch itself overflows the C stack freeing a single chain deeper
    # than ~30,000 nodes once Python has walked its next_functions (torchviz triggers it too).
    x = torch.randn(2, requires_grad=True)
    ends = []
    for c in range(chains):
        y = x
        for _ in range(n // chains):
            y = y * 1.0001
        ends.append(y)
    y = torch.stack(ends).sum()
    ip.user_ns.update(x=x, y=y)
    sample, g = clock(lambda: first_view(ip, "-o y"))
    t = sample.wall
    print(f"{n:,} nodes: first view {t:.2f} s, {len(g.shown())} items shown; message: {g.data.notes[-1]!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--chain", type=int, default=5000)
    parser.add_argument("--huge", type=int, default=100_000)
    parser.add_argument("--quick", action="store_true", help="fewer repeats, for ./dev bench")
    args = parser.parse_args()
    if args.quick:
        args.repeat = min(args.repeat, 2)
    print(f"torch {torch.__version__}, dot: {DOT or 'none (torchviz timed without layout)'}")
    ip = shell()
    bench_gpt(ip, args.layers, args.repeat)
    bench_chain(ip, args.chain, args.repeat)
    bench_huge(ip, args.huge)


if __name__ == "__main__":
    main()
