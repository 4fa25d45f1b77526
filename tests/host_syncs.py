"""Count host synchronisations on a CPU: the calls that, on a CUDA tensor, block until the GPU catches up.

Also the 2-layer GPT training step the counts are taken around (the benchmarks' small model).
Not a test module (its name does not start with ``test_``): the cost tests import it. Every call of
``Tensor.item/tolist/numpy/__bool__/__float__/__int__/cpu`` and of ``Tensor.to('cpu')`` is
counted, except reading a tensor that an already counted ``cpu()``/``to("cpu")`` returned: that
tensor is on the host, so reading it waits for nothing (``t.cpu().numpy()`` is one synchronisation).
Also :class:`OpCount`, the ATen ops a block runs, by name.
"""
from __future__ import annotations

import collections
import contextlib
import weakref
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

_VIEWS = {"detach", "alias", "view", "_unsafe_view"}


class OpCount(TorchDispatchMode):
    """Counts the ATen ops a block runs, by name: those that compute something (views and detaches
    left out), or every one with ``views=True``."""

    def __init__(self, views: bool = False) -> None:
        super().__init__()
        self.views = views
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if self.views or name not in _VIEWS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


_READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__")


class SyncCount:
    def __init__(self) -> None:
        self.count = 0
        self.calls: list[str] = []
        self._host: dict[int, "weakref.ref[torch.Tensor]"] = {}  # id -> tensor already on the host

    def read(self, name: str, tensor: torch.Tensor) -> None:
        ref = self._host.get(id(tensor))
        if ref is None or ref() is not tensor:
            self.count += 1
            self.calls.append(name)

    def on_host(self, tensor: torch.Tensor) -> None:
        self._host[id(tensor)] = weakref.ref(tensor)


def _to_cpu(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``to("cpu")``: a device named as a string. ``to(device)`` with a ``torch.device`` is how the tools
    move a tensor to the device of the tensors they watch (no synchronisation on CUDA), and on a CPU
    the two cannot be told apart otherwise; the tools copy to the host with ``cpu()``."""
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, str) and torch.device(target).type == "cpu"


@contextlib.contextmanager
def counting_host_syncs() -> Iterator[SyncCount]:
    """Patch the Tensor methods for the duration of the block; yields the running count."""
    counter = SyncCount()
    originals = {name: getattr(torch.Tensor, name) for name in (*_READS, "cpu", "to")}

    def reader(name: str) -> Callable[..., Any]:
        original = originals[name]

        def wrapped(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            counter.read(name, self)
            return original(self, *args, **kwargs)
        return wrapped

    def copier(name: str) -> Callable[..., Any]:
        original = originals[name]

        def wrapped(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            if name == "cpu" or _to_cpu(args, kwargs):
                counter.read(name, self)
                if isinstance(out, torch.Tensor):
                    counter.on_host(out)
            return out
        return wrapped

    try:
        for name in _READS:
            setattr(torch.Tensor, name, reader(name))
        for name in ("cpu", "to"):
            setattr(torch.Tensor, name, copier(name))
        yield counter
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, 4, d // 4).transpose(1, 2) for z in self.c_attn(self.ln_1(x)).split(d, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class SmallGPT(nn.Module):
    """The 2-layer GPT (d=64) of the benchmarks: embeddings over 4096 elements are sampled, the rest whole."""

    def __init__(self, vocab: int = 512, d: int = 64) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(64, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def setup() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = SmallGPT()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), torch.randint(0, 512, (2, 32))


def step(model: nn.Module, opt: torch.optim.Optimizer, idx: torch.Tensor) -> None:
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    opt.step()


def plain_syncs(model: nn.Module, opt: torch.optim.Optimizer, idx: torch.Tensor, steps: int) -> int:
    """What the step itself reads (AdamW reads its step counters): the baseline the tools add to."""
    step(model, opt, idx)
    with counting_host_syncs() as plain:
        for _ in range(steps):
            step(model, opt, idx)
    assert plain.count > 0  # the counter sees the step's own reads: it is counting
    return plain.count
