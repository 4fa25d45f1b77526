"""What a replay puts back: the module's plain attributes, the random streams, the buffers (a replay runs on
clones), the grad mode and autocast as when the call ran."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from torch_nbdebug.record import compat


def rng_state() -> tuple[torch.Tensor, Optional[list[torch.Tensor]]]:
    """The CPU generator's state (a 5 KB copy, under a microsecond) and CUDA's when CUDA is in use
    (``is_initialized`` alone: it is never True without a device, and ``is_available`` costs more)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


_STRUCTURE = ("_parameters", "_modules", "_buffers")


@contextlib.contextmanager
def restored_attributes(module: torch.nn.Module, changed: list[bool]) -> Iterator[None]:
    """Each submodule's plain attributes (``self.n += 1``, a list ``forward`` appends to) are put back
    after the replay; ``changed`` gets True when one differed."""
    saved = [(m, {k: v for k, v in m.__dict__.items() if k not in _STRUCTURE}) for m in module.modules()]
    copies = [{k: _shallow(v) for k, v in attrs.items() if type(v) in (list, dict, set)} for _, attrs in saved]
    try:
        yield
    finally:
        for (m, attrs), contents in zip(saved, copies):
            now = m.__dict__
            for k in [k for k in now if k not in attrs and k not in _STRUCTURE]:
                del now[k]
                changed.append(True)
            for k, v in attrs.items():
                if now.get(k, _MISSING) is not v:
                    now[k] = v
                    changed.append(True)
            for k, copy in contents.items():
                if not _same_contents(attrs[k], copy):
                    _put_back(attrs[k], copy)
                    changed.append(True)


_MISSING = object()


def _shallow(value: Any) -> Any:
    return list(value) if type(value) is list else dict(value) if type(value) is dict else set(value)


def _same_contents(now: Any, copy: Any) -> bool:
    if type(now) is dict:
        return now.keys() == copy.keys() and all(now[k] is copy[k] for k in copy)
    if type(now) is set:
        return now == copy
    return len(now) == len(copy) and all(a is b for a, b in zip(now, copy))


def _put_back(now: Any, copy: Any) -> None:
    if type(now) is list:
        now[:] = copy
    else:
        now.clear()
        now.update(copy)


@contextlib.contextmanager
def autocast_as(state: tuple) -> Iterator[None]:
    """Autocast as when the call ran (a backward birth's forward is replayed after its autocast ended)."""
    with contextlib.ExitStack() as stack:
        for context in compat.autocast_contexts(state):
            stack.enter_context(context)
        yield


@contextlib.contextmanager
def grad_mode(enabled: bool) -> Iterator[None]:
    """The call's grad mode, set inside the try (``torch.set_grad_enabled`` sets it on construction,
    before its ``with`` protects it: a Stop landing there would leave it changed)."""
    before = torch.is_grad_enabled()
    try:
        torch.set_grad_enabled(enabled)
        yield
    finally:
        torch.set_grad_enabled(before)


@contextlib.contextmanager
def restored_rng(rng: Optional[torch.Tensor], cuda_rng: Optional[list[torch.Tensor]]) -> Iterator[None]:
    """The random streams as when the call ran (``rng``, ``cuda_rng``), the user's put back afterwards."""
    now_cpu, now_cuda = rng_state()
    try:
        if rng is not None:
            torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        yield
    finally:
        torch.set_rng_state(now_cpu)
        if now_cuda is not None:
            torch.cuda.set_rng_state_all(now_cuda)


@contextlib.contextmanager
def restored_buffers(module: torch.nn.Module) -> Iterator[None]:
    """The replay runs on detached clones of every buffer (BatchNorm's running mean/var and batch
    counter): the user's buffers are never written, so their ``_version`` (which autograd checks for
    the buffers it saved) stays; the original dict entries are put back afterwards."""
    saved = [(compat.buffer_registry(m), dict(compat.buffer_registry(m))) for m in module.modules()]
    try:
        for registry, buffers in saved:
            for name, buf in buffers.items():
                if isinstance(buf, torch.Tensor):
                    registry[name] = buf.detach().clone()
        yield
    finally:
        for registry, buffers in saved:
            registry.clear()
            registry.update(buffers)
