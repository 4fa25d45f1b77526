"""Cost of the live view (render/live.py) on training steps, against the same steps without it.

Each timed call is one cell's worth of AdamW steps (zero_grad, forward, cross-entropy, backward,
step): 3 of the GPT-2-small-like model, 20 of the small one (a cell runs many steps; the live view's
fixed cost per cell, creating and closing its widget, is printed apart).
Variants, interleaved within every repeat (the machine is shared: only ratios measured in the same
run mean anything; medians of repeats; CPU time of the process):

- ``plain``: the 3 steps;
- ``plain+live``: the same inside the live view the magics use (``magics._common.live_view``: the
  widget shown, torch's global optimizer step post hook ticking it, an update pushed when due);
- ``record``: the 3 steps inside ``record_gradients(model)`` (what ``%%grads`` does without a live
  front end);
- ``record+live``: ``record`` with ``%%grads``'s live view (its progress reads the per-layer gradient
  norms of the new steps from the device when an update is due).

The live view runs under a stand-in for ipykernel's shell whose display publisher drops messages;
without a kernel the widget's comm is ipywidgets' dummy, so what is timed is ours: the hook, the
clock, ``progress()``, the widget's state serialisation. Updates are due at most every 0.25 s; a CPU
step of the GPT-2-small-like model takes longer, so here an update is pushed at every step (the worst
case; on a GPU, with 30 ms steps, one in eight steps pushes one).
Target (issue 13): the live view costs no measurable time, ``+live`` <= 1.02x.
Run: ``.venv/bin/python bench/bench_live.py [--quick] [--model small|gpt2|both]``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import GPT, lm_loss, small_gpt, training_step  # noqa: E402
from timing import interleave  # noqa: E402
from IPython.core.formatters import DisplayFormatter  # noqa: E402

from torch_nbdebug.api.grads import record_gradients  # noqa: E402
from torch_nbdebug.magics._common import live_view  # noqa: E402
from torch_nbdebug.magics._live import GradsProgress  # noqa: E402
from torch_nbdebug.render.live import Progress  # noqa: E402



class _Publisher:
    def __init__(self) -> None:
        self.count = 0

    def publish(self, data: Any, metadata: Any = None, **kw: Any) -> None:
        self.count += 1


def kernel_shell() -> Any:
    """Looks like ipykernel's shell to ``live_frontend``; publishes nowhere."""
    shell = type("ZMQInteractiveShell", (), {"__module__": "ipykernel.zmqshell"})()
    shell.kernel = object()
    shell.display_pub = _Publisher()
    shell.display_formatter = DisplayFormatter()
    return shell


def variants(model: nn.Module, idx: torch.Tensor, count: int) -> dict[str, Callable[[], None]]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    shell = kernel_shell()

    def steps() -> None:
        for _ in range(count):
            training_step(opt, lambda: lm_loss(model, idx, idx))

    def plain_live() -> None:
        with live_view(shell, "%%bench", lambda: Progress(status="running"), print) as live:
            steps()
        assert live.steps == count

    def record() -> None:
        with record_gradients(model, name="gpt") as rec:
            steps()
        assert len(rec.steps) == count

    def record_live() -> None:
        rec = record_gradients(model, name="gpt")
        with live_view(shell, "%%grads gpt", GradsProgress(rec), print) as live:
            with rec:
                steps()
            live.show(None)  # what the magic does with the report (not rendered here: timed apart)
        assert len(rec.steps) == count and live.steps == count

    return {"plain": steps, "plain+live": plain_live, "record": record, "record+live": record_live}


def fixed_cost_ms(repeats: int = 50) -> float:
    """Median wall milliseconds of a live view shown and closed around no steps (widget, comm, bundle)."""
    shell = kernel_shell()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        with live_view(shell, "%%bench", lambda: Progress(status=""), print):
            pass
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def measure(label: str, model: nn.Module, vocab: int, seq: int, steps: int, repeats: int) -> None:
    idx = torch.randint(0, vocab, (2, seq))
    timings = interleave(variants(model, idx, steps), repeats, warmup=1, alternate=True)
    print(f"{label}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, batch 2, seq {seq}, "
          f"{steps} AdamW steps per call, {timings.repeats('plain')} interleaved repeats, medians")
    summaries = timings.summaries()
    for name, base in (("plain+live", "plain"), ("record+live", "record")):
        s, b = summaries[name], summaries[base]
        print(f"  {name:<12} vs {base:<7} cpu median {s.cpu * 1e3:8.1f} ms vs {b.cpu * 1e3:8.1f} ms  "
              f"ratio {s.cpu / b.cpu:5.3f}x | cpu min ratio {s.cpu_min / b.cpu_min:5.3f}x | "
              f"wall median ratio {s.wall / b.wall:5.3f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, a shorter GPT-2 sequence")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--model", choices=("small", "gpt2", "both"), default="both")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.model in ("small", "both"):
        measure("2-layer GPT (d=64)", small_gpt(), 512, 32, 20, args.repeats or (15 if args.quick else 41))
    if args.model in ("gpt2", "both"):
        model = GPT(vocab=50257, tied=True, fused_attention=True)  # GPT-2's vocabulary, tied head: 124M parameters
        measure("GPT-2-small-like", model, 50257, 32 if args.quick else 64, 3, args.repeats or (3 if args.quick else 5))
    print(f"live view fixed cost per cell (shown and closed, no steps): {fixed_cost_ms():.2f} ms median")


if __name__ == "__main__":
    main()
