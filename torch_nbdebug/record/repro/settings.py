"""Read around the runs of ``%%repro``, never changed: the settings that decide whether two runs can agree,
and the fingerprints of the state tensors a run left (compared after each run when no op wrote them)."""
from __future__ import annotations

import os
from typing import Any, Iterable

import torch

from torch_nbdebug.data.repro import Fingerprint, Settings
from torch_nbdebug.record.interrupts import no_grad_held
from torch_nbdebug.record.repro.ops import fingerprint_tensor, fingerprintable, read_fingerprints
from torch_nbdebug.record.repro.state import is_loader


def loaders_without_seed(named: Iterable[tuple[str, Any]]) -> tuple[str, ...]:
    """DataLoaders with worker processes whose randomness no seed controls."""
    return tuple(name for name, value in named if is_loader(value) and value.num_workers > 0
                 and value.generator is None and value.worker_init_fn is None)


def read_settings(named: Iterable[tuple[str, Any]], cuda_used: bool) -> Settings:
    """The global switches that decide whether a run can repeat (read, never changed)."""
    return Settings(
        deterministic=torch.are_deterministic_algorithms_enabled(),
        deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
        cublas_workspace=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        matmul_tf32=bool(torch.backends.cuda.matmul.allow_tf32),
        cudnn_tf32=bool(torch.backends.cudnn.allow_tf32),
        cudnn_benchmark=bool(torch.backends.cudnn.benchmark),
        cudnn_deterministic=bool(torch.backends.cudnn.deterministic),
        cuda_used=cuda_used,
        loaders=loaders_without_seed(named),
    )


def end_state(watched: Iterable[tuple[str, Any]]) -> dict[str, Fingerprint]:
    """Fingerprints of the given state tensors as a run left them."""
    tensors: list[tuple[str, torch.Tensor]] = []
    for name, ref in watched:
        t = ref()
        if isinstance(t, torch.Tensor) and fingerprintable(t):
            tensors.append((name, t))
    with no_grad_held():
        values = read_fingerprints([fingerprint_tensor(t) for _, t in tensors])
    return {name: Fingerprint(tuple(t.shape), str(t.dtype).replace("torch.", ""), *v)
            for (name, t), v in zip(tensors, values)}
