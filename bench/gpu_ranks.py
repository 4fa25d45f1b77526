"""The NCCL run of bench/gpu_check.sh: DDP over 2 GPUs under ``torchrun -m torch_nbdebug nanwatch``.

    torchrun --standalone --nproc-per-node 2 -m torch_nbdebug nanwatch --out DIR bench/gpu_ranks.py
    python bench/gpu_ranks.py --check DIR     # the report must name rank 1, step 1, aten.sqrt and who sent it

Rank 1 makes a NaN at step 1 (sqrt of -1); DDP's NCCL all-reduce of its gradient bucket carries it to
rank 0, which must be reported as a receiver, not a birth.
"""
from __future__ import annotations

import os
import sys


def train() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 8).to(device), device_ids=[device.index])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        out = model(torch.randn(32, 64, device=device))
        if rank == 1 and step == 1:
            out = out * torch.sqrt(torch.tensor(-1.0, device=device))
        loss = out.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    dist.destroy_process_group()


def check(directory: str) -> int:
    import torch_nbdebug

    report = torch_nbdebug.load(directory)
    f = report.findings
    print(report.text().split("\n== rank")[0])
    first, sent = f["first"], f["sent"]
    ok = (first is not None and (first["rank"], first["step"], first["event"]["op"]) == (1, 1, "aten.sqrt.default")
          and bool(sent) and sent[0]["senders"] == [1] and sent[0]["receivers"] == [0] and f["receivers"] == [0])
    print("gpu_ranks: NCCL report", "ok" if ok else "WRONG")
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--check":
        sys.exit(check(sys.argv[2]))
    train()
