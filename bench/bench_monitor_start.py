"""%%monitor's first run in a fresh kernel: what it costs beyond the same loop run plain.

    .venv/bin/python bench/bench_monitor_start.py            # 3 fresh kernels, medians
    .venv/bin/python bench/bench_monitor_start.py --runs 1
    .venv/bin/python bench/bench_monitor_start.py --pause 4   # a notebook's pace: %load_ext, then a few s

Each run starts a fresh in-process ipykernel (the shell, display publisher and comms of a notebook's
kernel), defines a small model (torch on one thread), times the plain 30-step loop, ``%load_ext torch_nbdebug``, then the
same loop under ``%%monitor loss, opt.param_groups[0]["lr"]`` three times (the first run pays what is
paid once: imports, the first widget, the first picture; the second and third show that every later run
costs the same), each in a cell of its own. ``--pause`` waits between ``%load_ext`` and the first run
(the drawing modules it imports in the background have finished after ~3 s).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, sys, time
    from ipykernel.inprocess.manager import InProcessKernelManager
    from ipykernel.kernelbase import Kernel
    km = InProcessKernelManager()
    km.start_kernel()
    Kernel._instance = km.kernel
    shell = km.kernel.shell
    SETUP = '''
    import torch
    from torch import nn
    torch.set_num_threads(1)  # one thread: no spinning workers in the CPU times on a shared machine
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.003)
    x, y = torch.randn(256, 64), torch.randn(256, 1)
    '''
    LOOP = '''for step in range(30):
        loss = nn.functional.mse_loss(net(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
    '''
    out = {}
    def timed(name, code, cell_id):
        start, cpu = time.perf_counter(), time.process_time()
        result = shell.run_cell(code, store_history=True, cell_id=cell_id)
        assert result.success, result.error_in_exec
        out[name], out[name + "_cpu"] = time.perf_counter() - start, time.process_time() - cpu
    shell.run_cell(SETUP)
    timed("plain", LOOP, "plain")
    timed("load_ext", "%load_ext torch_nbdebug", "load")
    time.sleep(float(sys.argv[1]))
    monitored = '%%monitor loss, opt.param_groups[0]["lr"]\\n' + LOOP
    timed("first", monitored, "m1")
    timed("second", monitored, "m2")
    timed("third", monitored, "m3")
    timed("plain_again", LOOP, "plain")
    print(json.dumps(out))
""")


def one(pause: float) -> dict[str, float]:
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(pause)], capture_output=True, text=True, timeout=600)
    if run.returncode:
        raise SystemExit(run.stderr[-3000:])
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="fresh kernels (medians are printed)")
    ap.add_argument("--pause", type=float, default=0.0, help="seconds between %%load_ext and the first run")
    args = ap.parse_args(argv)
    runs = [one(args.pause) for _ in range(args.runs)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    plain = min(med["plain"], med["plain_again"])
    plain_cpu = min(med["plain_cpu"], med["plain_again_cpu"])
    print(f"median of {args.runs} fresh kernel(s), seconds: wall, and the kernel process's CPU time (all its")
    print("threads: steadier than wall on a shared machine)")
    print(f"  plain 30-step loop          {plain:6.2f}   cpu {plain_cpu:6.2f}")
    print(f"  %load_ext torch_nbdebug     {med['load_ext']:6.2f}   cpu {med['load_ext_cpu']:6.2f}"
          + (f"   (then {args.pause:g} s idle)" if args.pause else ""))
    for name, label in (("first", "first %%monitor run "), ("second", "second %%monitor run"),
                        ("third", "third %%monitor run ")):
        print(f"  {label}        {med[name]:6.2f}   cpu {med[name + '_cpu']:6.2f}  (+{med[name] - plain:.2f} wall, "
              f"+{med[name + '_cpu'] - plain_cpu:.2f} cpu over plain)")
    fixed = statistics.median(r["first"] - r["second"] for r in runs)
    fixed_cpu = statistics.median(r["first_cpu"] - r["second_cpu"] for r in runs)
    print(f"  paid once (first - second run, same kernel)  {fixed:+.2f}   cpu {fixed_cpu:+.2f}")
    uneven_cpu = statistics.median(r["second_cpu"] - r["third_cpu"] for r in runs)
    print(f"  second - third run (0 when every later run costs the same)  cpu {uneven_cpu:+.2f}")


if __name__ == "__main__":
    main()
