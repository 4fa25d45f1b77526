"""Cost of record_gradients on a GPT-2-small-like training step, against anchors run side by side.

Variants, interleaved within every repeat (the machine is shared, so only ratios measured in the
same run mean anything; medians of repeats; CPU time of the process, which other processes on a
busy machine disturb far less than wall time):

- ``plain``: zero_grad, forward, cross-entropy, backward, AdamW step;
- ``foreach_norm``: plain + ``torch._foreach_norm`` over all gradients (the cheapest useful anchor);
- ``naive``: plain + per-parameter norm and 64-bin ``histc``, each read with ``.item()``/``.tolist()``
  (what a hand-written logger does; one host sync per parameter);
- ``record``: plain inside ``record_gradients(model)`` (default sample=4096, 64 bins), steady state;
  ``record_first``: the first step of a block, which is also recorded at the end of its backward
  (until an optimizer has stepped, a step is a backward pass).

The one-off costs of entering and leaving the block (the exact recomputation of the last step
over every element) are printed separately. Run: ``.venv/bin/python bench/bench_grads.py [--quick]``.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from torch_nbdebug.api.grads import record_gradients
from torch_nbdebug.record.grads_stats import Sampler, sampled_rows


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """12 blocks, d=768, 12 heads, GPT-2 vocabulary with tied input/output embeddings (124M parameters)."""

    def __init__(self, vocab: int = 50257, d: int = 768, layers: int = 12, heads: int = 12, ctx: int = 256) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats and a shorter sequence")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    repeats = args.repeats or (3 if args.quick else 7)
    seq = args.seq or (32 if args.quick else 64)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    idx = torch.randint(0, 50257, (args.batch, seq))
    params = list(model.parameters())
    n = sum(p.numel() for p in params)

    def step(after_backward: Callable[[], None] = lambda: None) -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
        after_backward()
        opt.step()

    def norms() -> None:
        torch.stack(torch._foreach_norm([p.grad for p in params])).cpu()

    def naive() -> None:
        for p in params:
            p.grad.norm().item()
            torch.histc(p.grad, 64).tolist()

    names = ("plain", "foreach_norm", "naive", "record", "record_first")
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    enter_exit: list[float] = []

    def timed(name: str, fn: Callable[[], None]) -> None:
        w, c = time.perf_counter(), time.process_time()
        fn()
        wall[name].append(time.perf_counter() - w)
        cpu[name].append(time.process_time() - c)

    sampler = Sampler(params, 4096)
    present = tuple(range(len(params)))

    def record_work() -> None:
        """What the recorder adds to one step, alone: gather w, all statistics, gather w again."""
        sampler.gather(params, present, params[0].device)
        out = sampled_rows(params, present, sampler, 64)
        sampler.gather(params, present, params[0].device)
        out["raw"].cpu()

    work: list[float] = []
    step()  # warm up allocator and AdamW state
    for _ in range(repeats):
        c = time.process_time()
        record_work()
        work.append(time.process_time() - c)
        timed("plain", step)
        timed("foreach_norm", lambda: step(norms))
        timed("naive", lambda: step(naive))
        c0 = time.process_time()
        with record_gradients(model, name="gpt") as rec:
            c1 = time.process_time()
            timed("record_first", step)  # the first step of a block is also recorded at its backward's end
            timed("record", step)
            c2 = time.process_time()
        enter_exit.append(time.process_time() - c2 + c1 - c0)
    assert len(rec.steps) == 2 and rec.trace.step_kind == "optimizer"
    print(f"GPT-2-small-like: {n / 1e6:.1f}M parameters in {len(params)} tensors, batch {args.batch}, "
          f"seq {seq}, 1 thread, {repeats} interleaved repeats, medians")
    print("  CPU time of this process is the measure (the machine is shared; wall time shown for reference)")
    print("  (min: the least disturbed repeat; contention only ever adds time)")
    base_c, base_w, base_m = (statistics.median(cpu["plain"]), statistics.median(wall["plain"]), min(cpu["plain"]))
    for name in names:
        c, w, m = statistics.median(cpu[name]), statistics.median(wall[name]), min(cpu[name])
        print(f"  {name:<13} cpu median {c * 1e3:8.1f} ms/step ratio {c / base_c:5.3f}x | "
              f"cpu min ratio {m / base_m:5.3f}x | wall median ratio {w / base_w:5.3f}x")
    print(f"  recorder work alone on the same gradients: cpu {statistics.median(work) * 1e3:.1f} ms = "
          f"{statistics.median(work) / base_c:.3f} of a plain step")
    print(f"  record_gradients enter+exit (once per block, includes the exact last step): "
          f"cpu {statistics.median(enter_exit) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
