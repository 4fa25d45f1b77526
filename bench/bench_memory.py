"""%%cudamem overhead on CPU: a plain training step vs memory_timeline vs torch.profiler, side by side.

    .venv/bin/python bench/bench_memory.py             # 2-layer GPT, then GPT-2-small-like (a few minutes)
    .venv/bin/python bench/bench_memory.py --quick     # 4 blocks for the big one, fewer repeats
    .venv/bin/python bench/bench_memory.py --model small --repeats 21

The 2-layer GPT (d=64, sequence of 32) is the CPU stand-in for a GPU: its ops are so cheap that the
recorder's Python work per op shows, as it would next to microsecond kernels. Targets:
memory_timeline <= 1.10x on GPT-2-small-like; on the small model (issue 27) within 0.5x of its floor, the
no-op dispatch mode it runs (always timed: each run prints the ratio, the floor's and the distance, with quartiles).

Each timed call is one full step (zero_grad, forward, loss, backward, Adam step). The memory_timeline
variant enters and leaves the recorder inside the timing and includes building the timeline (what
%%cudamem does before drawing); the static SVG render is timed separately. The profiler variant is
``torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True)`` (what its memory
timeline needs) plus ``export_memory_timeline`` to a .json file. Each variant is timed in pairs with a
plain step, back to back (which goes first alternates), one thread; its ratio is the median over pairs
of its time over the plain one's (issue 11's "median paired ratio"), with the quartiles.

``--floors`` also times what any op-precise CPU recorder pays before doing anything: a
``TorchDispatchMode`` that only calls the op (with and without dynamo's per-op wrapper, which
memory_timeline's mode skips), and the profiler's own C++ memory feed (``profile_memory=True``, no shapes,
no stacks, no post-processing: the raw kineto result only). On CPU there is no other allocation feed
(no allocator history or hooks, unlike CUDA), so the no-op mode is memory_timeline's floor.

The same feed without op events (an activity set with no CPU ops in it: on this CPU-only build, {CUDA}
records nothing else) is the floor of a recorder built on the allocator's events plus module hooks
(issue 11; evaluated and not built): the step itself runs at full speed, but stopping post-processes every
allocation and free event in C++, and reading each event's address, bytes and time (needed to pair a free
with its allocation) costs more again in Python. Its two rows time start + stop, then start + stop + that
read: on the 2-layer GPT (about 950 allocator events per step) 1.4-1.6x and 1.8-2.1x, about the no-op
mode's own cost before any bookkeeping, module hooks or timeline, and without an op, shape or dtype per
allocation (what the timeline and its tests name).

The last row is the route issue 27 proposed: the profiler's op events with its memory feed, each
allocation read with the innermost op event whose time range encloses it. On the 2-layer GPT the raw
feed with op events alone costs 2.7-3.0x (above the target of the no-op mode + 0.5x) and reading the
allocations with their op 4.5-5.0x, more than memory_timeline itself, still without the source line,
output shape, dtype and op overload (``mm.default``) that the timeline names per allocation. Nor does it
give the same timeline: per step the allocator reports 431 allocations where the recorder sees 192 new
storages (kernels' own buffers), the innermost op around them is mostly the factory inside the op
(``aten::empty_strided``, ``aten::empty``: 173 of 431) or only ``Optimizer.step#Adam.step`` (116): the
bytes, the peak and its op would be another timeline's.
The profiler's C++ log lines on fd 2 are silenced around the floor rows (bench output only).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import GPT, lm_loss, training_step  # noqa: E402
from timing import Pairs, clock, paired  # noqa: E402
from torch_nbdebug.api.memory import memory_timeline  # noqa: E402
from torch_nbdebug.record.compat import EagerDispatchMode, TorchDispatchMode  # noqa: E402
# fd 2 to /dev/null for a block: the profiler's C++ logs (USDT start/stop, "Failed to recover
# relationship...", "Memory block of unknown size...") would flood the benchmark's output
from torch_nbdebug.record.profile import quiet_stderr as quiet_fd2  # noqa: E402


def make_step(model: torch.nn.Module, opt: torch.optim.Optimizer, idx: torch.Tensor,
              target: torch.Tensor) -> Callable[[], None]:
    return lambda: training_step(opt, lambda: lm_loss(model, idx, target))


def recorded(step: Callable[[], None], ns: dict[str, Any], record_lines: bool = True,
             phases: Optional[list[tuple[float, float, float]]] = None) -> Any:
    """The step under memory_timeline; leaving the block builds the timeline (peak, categories, leaks).
    ``phases`` gets the CPU seconds of entering the block, of the step inside it and of leaving it."""
    clock_cpu = time.process_time
    block = memory_timeline(ns, device="cpu", record_lines=record_lines)
    entering = clock_cpu()
    with block as tl:
        started = clock_cpu()
        step()
        stepped = clock_cpu()
    if phases is not None:
        phases.append((started - entering, stepped - started, clock_cpu() - stepped))
    return tl


def line_cost(step: Callable[[], None], ns: dict[str, Any]) -> tuple[int, float]:
    """Time the recorder's source-line lookup itself (one per allocation, cached per call site)."""
    from torch_nbdebug.record.memory import MemoryRecorder

    original = MemoryRecorder._user_line
    spent, calls = [0.0], [0]

    def timed(self: Any) -> Any:
        t0 = time.thread_time()  # CPU time of this thread: other processes' load does not count
        try:
            return original(self)
        finally:
            spent[0] += time.thread_time() - t0
            calls[0] += 1

    MemoryRecorder._user_line = timed  # type: ignore[method-assign]
    try:
        recorded(step, ns)
    finally:
        MemoryRecorder._user_line = original  # type: ignore[method-assign]
    return calls[0], spent[0]


def profiled(step: Callable[[], None]) -> Any:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        step()
    return prof


class _NoOpMode(TorchDispatchMode):
    """Calls the op, nothing else: the floor of every per-op dispatch-mode recorder."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


class _NoOpEagerMode(EagerDispatchMode):
    """The same without dynamo's per-op wrapper, as memory_timeline's mode runs."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


FLOOR = "no-op mode, no dynamo wrapper"


def under(mode_class: Any, step: Callable[[], None]) -> None:
    with mode_class():
        step()


def profiler_feed(step: Callable[[], None], cpu_ops: bool = True) -> Any:
    """The profiler's memory events only: start kineto with profile_memory, run, stop; the raw result
    (what an allocation feed would read) without torch.profiler's Python post-processing. Without
    ``cpu_ops`` no op events are recorded: an activity set with no CPU in it (an empty one is refused;
    on this CPU-only build {CUDA} records nothing else, on a CUDA build it would trace kernels)."""
    from torch._C._profiler import ProfilerConfig, ProfilerState, _ExperimentalConfig
    from torch.autograd.profiler import ProfilerActivity, _disable_profiler, _enable_profiler, _prepare_profiler

    config = ProfilerConfig(ProfilerState.KINETO, False, True, False, False, False, _ExperimentalConfig())
    activities = {ProfilerActivity.CPU if cpu_ops else ProfilerActivity.CUDA}
    _prepare_profiler(config, activities)
    _enable_profiler(config, activities)
    try:
        step()
    finally:
        result = _disable_profiler()
    return result


def memory_only_feed(step: Callable[[], None], read: bool) -> Any:
    """The allocator's [memory] events without op events: start, run, stop; with ``read``, each event's
    address, bytes (+ allocated, - freed) and time, as a recorder pairing allocations with frees needs."""
    result = profiler_feed(step, cpu_ops=False)
    if not read:
        return result
    return [(e.extra_fields.ptr, e.extra_fields.alloc_size, e.start_time_ns) for e in result.experimental_event_tree()]


def op_memory_feed(step: Callable[[], None]) -> list[tuple[int, int, int, str]]:
    """The profiler route of issue 27: op events and the allocator's, then each allocation and free read
    with its address, bytes and time, and the op that made it: the innermost op event whose time range
    encloses it (allocation events are roots of the profiler's event tree here, with no parent op).
    Still no source line, output shape, dtype or op overload per allocation."""
    ops: list[tuple[int, int, str]] = []
    memory: list[tuple[int, int, int]] = []
    stack = list(profiler_feed(step).experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag.name == "Allocation":
            memory.append((event.start_time_ns, event.extra_fields.ptr, event.extra_fields.alloc_size))
        elif event.tag.name == "TorchOp":
            ops.append((event.start_time_ns, event.end_time_ns, event.name))
    ops.sort(key=lambda op: (op[0], -op[1]))
    found: list[tuple[int, int, int, str]] = []
    open_ops: list[tuple[int, int, str]] = []  # nested ranges enclosing the current time, innermost last
    next_op = 0
    for time_ns, ptr, size in sorted(memory):
        while next_op < len(ops) and ops[next_op][0] <= time_ns:
            while open_ops and open_ops[-1][1] < ops[next_op][0]:
                open_ops.pop()
            open_ops.append(ops[next_op])
            next_op += 1
        while open_ops and open_ops[-1][1] < time_ns:
            open_ops.pop()
        found.append((ptr, size, time_ns, open_ops[-1][2] if open_ops else ""))
    return found


def quietly(fn: Callable[[], Any]) -> Callable[[], None]:
    """``fn`` with fd 2 silenced while it runs (see ``quiet_fd2``)."""
    def run() -> None:
        with quiet_fd2():
            fn()
    return run


def export_seconds(prof: Any) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        return clock(lambda: prof.export_memory_timeline(os.path.join(tmp, "mem.json"), device="cpu"))[0].wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("small", "gpt2", "both"), default="both")
    parser.add_argument("--quick", action="store_true", help="4 blocks and 3 repeats: a smoke run")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--no-profiler", action="store_true", help="skip the torch.profiler comparison")
    parser.add_argument("--floors", action="store_true",
                        help="also time a no-op dispatch mode (with/without dynamo's wrapper), the raw profiler memory feed, "
                             "the memory-only feed (no op events) with and without reading its events, and the "
                             "op + memory feed read with each allocation's op")
    parser.add_argument("--lines-cost", action="store_true",
                        help="also time memory_timeline(record_lines=False): the cost of naming source lines")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if args.model in ("small", "both"):
        measure(args, "2-layer GPT (d=64)", GPT(512, 64, 2, 4, 64), 512, 32, args.repeats or (11 if args.quick else 31))
    if args.model in ("gpt2", "both"):
        layers = args.layers or (4 if args.quick else 12)
        measure(args, f"GPT-like: {layers} blocks, d=768", GPT(args.vocab, 768, layers, 12, 256), args.vocab, args.seq,
                args.repeats or (3 if args.quick else 5))


def print_paired(pairs: Pairs) -> None:
    """Each variant's median paired CPU ratio (timed next to a plain step), with the quartiles."""
    parts = []
    for name in pairs.pairs:
        lo, hi = pairs.spread(name)
        parts.append(f"{name} {pairs.ratio(name):.2f}x [{lo:.2f}-{hi:.2f}]")
    print("paired cpu ratios (median over pairs of the variant's CPU time over the plain step next to it, "
          "[quartiles]): " + "; ".join(parts))


def measure(args: argparse.Namespace, label: str, model: torch.nn.Module, vocab: int, seq: int, repeats: int) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    idx = torch.randint(0, vocab, (args.batch, seq))
    target = torch.randint(0, vocab, (args.batch, seq))
    step = make_step(model, opt, idx, target)
    ns = {"model": model, "opt": opt, "idx": idx, "target": target}
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{label}, {n_params / 1e6:.2f}M params, batch {args.batch}, seq {seq}, "
          f"1 thread, {repeats} pairs per variant (each timed next to a plain step)")
    step()  # warm-up: Adam state, allocator, lazy init
    recorded(step, ns).html()  # warm-up of the recorder and the renderer too
    # Always timed: memory_timeline's floor, the no-op mode it runs (without dynamo's wrapper).
    floors: dict[str, Callable[[], Any]] = {FLOOR: lambda: under(_NoOpEagerMode, step)}
    floors.update({"no-op mode": lambda: under(_NoOpMode, step),
              "profiler memory feed, raw": quietly(lambda: profiler_feed(step)),
              "memory-only feed (no op events)": quietly(lambda: memory_only_feed(step, read=False)),
              "memory-only feed + read events": quietly(lambda: memory_only_feed(step, read=True)),
              "op + memory feed + read, op per alloc": quietly(lambda: op_memory_feed(step)),
              } if args.floors else {})
    variants: dict[str, Callable[[], Any]] = {"memory_timeline": lambda: recorded(step, ns, phases=phases)}
    if args.lines_cost:
        variants["no lines"] = lambda: recorded(step, ns, record_lines=False)
    if not args.no_profiler:
        variants["profiler"] = lambda: profiled(step)
    variants.update(floors)
    renders, events, exports = [], [], []
    phases: list[tuple[float, float, float]] = []

    def after(name: str, out: Any) -> None:
        if name == "memory_timeline":
            renders.append(clock(out.html)[0].wall)  # the static SVG, timed apart from the step
            events.append(len(out.steps) - 1)
        elif name == "profiler":
            exports.append(export_seconds(out))

    pairs = paired({"plain": step, **variants}, "plain", repeats, after=after)
    print_paired(pairs)
    plain = pairs.summary("plain")
    ours = pairs.summary("memory_timeline")
    print("(wall = elapsed seconds; cpu = this process's CPU seconds, less sensitive to other load on the machine)")
    print(f"plain step                          wall {plain.wall:.3f} s   cpu {plain.cpu:.3f} s")
    print(f"memory_timeline (record + build)    wall {ours.wall:.3f} s   "
          f"paired ratio {pairs.ratio('memory_timeline', cpu=False):.2f}x; "
          f"cpu paired ratio {pairs.ratio('memory_timeline'):.2f}x; "
          f"{int(statistics.median(events))} events; static SVG render {statistics.median(renders):.3f} s")
    print(f"memory_timeline vs its floor ({FLOOR}): {pairs.versus_floor('memory_timeline', FLOOR)} "
          "(target: distance <= +0.50x on the 2-layer GPT, ratio <= 1.10x on GPT-2-small-like)")
    enter, inside, leave = (statistics.median(p[i] for p in phases) * 1000 for i in range(3))
    print(f"  of which (cpu medians): entering {enter:.1f} ms, the step inside {inside:.1f} ms "
          f"(plain {plain.cpu * 1000:.1f} ms), leaving + building the timeline {leave:.1f} ms")
    if "no lines" in variants:
        calls, spent = line_cost(step, ns)
        print(f"memory_timeline(record_lines=False)  cpu paired ratio {pairs.ratio('no lines'):.2f}x; "
              f"source lines, timed inside the recorder: {calls} lookups, {spent * 1e6 / max(calls, 1):.2f} us each, "
              f"{spent * 1000:.1f} ms per step")
    if "profiler" in variants:
        prof, export = pairs.summary("profiler").wall, statistics.median(exports)
        print(f"torch.profiler(profile_memory)      wall {prof:.3f} s   "
              f"paired ratio {pairs.ratio('profiler', cpu=False):.2f}x; "
              f"cpu paired ratio {pairs.ratio('profiler'):.2f}x; export_memory_timeline {export:.3f} s; "
              f"with export {(prof + export) / plain.wall:.2f}x")
    for name in floors:
        lo, hi = pairs.spread(name)
        print(f"floor: {name:38s} cpu paired ratio {pairs.ratio(name):.2f}x [{lo:.2f}-{hi:.2f}]")


if __name__ == "__main__":
    main()
