"""%%monitor's first run in a fresh kernel: what it costs beyond the same loop run plain.

    .venv/bin/python bench/bench_monitor_start.py            # 3 fresh kernels, medians
    .venv/bin/python bench/bench_monitor_start.py --runs 1

Each run starts a fresh in-process ipykernel (the shell, display publisher and comms of a notebook's
kernel), defines a small model, times the plain 30-step loop, ``%load_ext torch_nbdebug``, then the
same loop under ``%%monitor loss, opt.param_groups[0]["lr"]`` twice (the first run pays what is paid
once: imports, the first widget, the first picture), each in a cell of its own.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, time
    from ipykernel.inprocess.manager import InProcessKernelManager
    from ipykernel.kernelbase import Kernel
    km = InProcessKernelManager()
    km.start_kernel()
    Kernel._instance = km.kernel
    shell = km.kernel.shell
    SETUP = '''
    import torch
    from torch import nn
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))
    opt = torch.optim.SGD(net.parameters(), lr=0.003)
    x, y = torch.randn(256, 64), torch.randn(256, 1)
    '''
    LOOP = '''for step in range(30):
        loss = nn.functional.mse_loss(net(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
    '''
    def timed(code, cell_id):
        start = time.perf_counter()
        result = shell.run_cell(code, store_history=True, cell_id=cell_id)
        assert result.success, result.error_in_exec
        return time.perf_counter() - start
    shell.run_cell(SETUP)
    out = {"plain": timed(LOOP, "plain")}
    out["load_ext"] = timed("%load_ext torch_nbdebug", "load")
    monitored = '%%monitor loss, opt.param_groups[0]["lr"]\\n' + LOOP
    out["first"] = timed(monitored, "m1")
    out["second"] = timed(monitored, "m2")
    out["plain_again"] = timed(LOOP, "plain")
    print(json.dumps(out))
""")


def one() -> dict[str, float]:
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    if run.returncode:
        raise SystemExit(run.stderr[-3000:])
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="fresh kernels (medians are printed)")
    args = ap.parse_args(argv)
    runs = [one() for _ in range(args.runs)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    plain = min(med["plain"], med["plain_again"])
    print(f"median of {args.runs} fresh kernel(s), seconds")
    print(f"  plain 30-step loop          {plain:6.2f}")
    print(f"  %load_ext torch_nbdebug     {med['load_ext']:6.2f}")
    print(f"  first %%monitor run         {med['first']:6.2f}  (+{med['first'] - plain:.2f} over plain)")
    print(f"  second %%monitor run        {med['second']:6.2f}  (+{med['second'] - plain:.2f} over plain)")


if __name__ == "__main__":
    main()
