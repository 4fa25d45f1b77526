"""Per-op facts the reproducibility recorder needs, read once per ATen overload from its schema,
and the fingerprint of a tensor: a few exact reductions computed on the tensor's device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from torch_nbdebug.data.repro import NONDETERMINISTIC_OPS
from torch_nbdebug.record.compat import is_fake, op_arguments, op_returns

# Ops whose output memory holds whatever was there before (read before written -> 'uninitialized').
_EMPTY = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided",
                    "empty_permuted"})
# In-place ops that overwrite all of ``self`` without reading it.
# Ops whose schema does not say what they write: batch norm updates its running statistics in place in
# training (``native_batch_norm(..., Tensor? running_mean, Tensor? running_var, bool training, ...)``).
_RUNNING = frozenset({"running_mean", "running_var"})
_UNANNOTATED_WRITES = {"native_batch_norm": _RUNNING, "cudnn_batch_norm": _RUNNING, "miopen_batch_norm": _RUNNING}
_OVERWRITE = frozenset({"fill_", "zero_", "copy_", "normal_", "uniform_", "random_", "bernoulli_",
                        "exponential_", "geometric_", "cauchy_", "log_normal_"})
# Random ops without the ``nondeterministic_seeded`` tag on some versions.
_RANDOM_NAMES = frozenset({"bernoulli", "bernoulli_", "normal", "normal_", "uniform_", "rand", "randn",
                           "randint", "randperm", "rand_like", "randn_like", "randint_like", "multinomial",
                           "native_dropout", "dropout", "random_", "exponential_", "geometric_", "cauchy_",
                           "log_normal_", "poisson", "rrelu_with_noise"})
# Ops whose outputs are their inputs' values moved or converted, deterministically on every device:
# when the inputs agreed the outputs agree, so they are not read again (AccumulateGrad's layout
# clone of a gradient, reshape's ``_unsafe_view``, ``.to()``, ``torch.cat``).
_COPIES = frozenset({"clone", "_unsafe_view", "_to_copy", "copy", "copy_", "cat", "stack", "_reshape_copy",
                     "view_copy", "expand_copy", "permute_copy", "t_copy", "transpose_copy", "slice_copy",
                     "select_copy", "unsqueeze_copy", "squeeze_copy", "detach_copy", "alias_copy"})
# In-place elementwise ops (optimizers' updates) whose out-of-place twin computes the same values
# with the same kernel: run 1's first write of a parameter goes to new memory through it.
_TWINS = frozenset({"add", "sub", "mul", "div", "lerp", "addcmul", "addcdiv", "_foreach_add", "_foreach_sub",
                    "_foreach_mul", "_foreach_div", "_foreach_lerp", "_foreach_addcmul", "_foreach_addcdiv"})
_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@dataclass(frozen=True)
class OpInfo:
    """What the recorder needs to know about one ATen overload."""

    name: str                      # aten.add_.Tensor
    base: str                      # add_
    arg_names: tuple[str, ...]     # schema argument names, positional order
    writes: frozenset[str]         # arguments the op writes in place
    overwrites: frozenset[str]     # arguments it writes without reading (out=, self of fill_)
    is_view: bool                  # outputs alias an input: no data is read or made
    random: bool
    empty: bool
    lift: bool                     # torch.tensor / from_numpy: Python data becoming a tensor
    skip: bool = False             # profiler markers (record_function): not computation
    maybe_nondeterministic: bool = False  # listed as nondeterministic on some device
    light: bool = False            # inside an optimizer step, outputs not read: same inputs, same output
    copies: bool = False           # outputs are the inputs' values moved or converted (clone, cat, _to_copy)
    twin: Any = None               # the out-of-place overload of an in-place elementwise op (mul for mul_)
    returns_self: bool = False     # an in-place op that returns what it wrote (mul_; _foreach_mul_ returns None)


_cache: dict[Any, OpInfo] = {}


def op_info(func: Any) -> OpInfo:
    info = _cache.get(func)
    if info is None:
        info = _cache[func] = _read_info(func)
    return info


def _read_info(func: Any) -> OpInfo:
    name = str(func)
    base = name.split(".")[1] if name.startswith("aten.") else name.rsplit(".", 1)[0]
    args = op_arguments(func)
    writes = frozenset(a.name for a in args if a.alias_info is not None and a.alias_info.is_write) | \
        _UNANNOTATED_WRITES.get(base, frozenset())
    overwrites = frozenset(a.name for a in args if a.name in writes and (a.kwarg_only or base in _OVERWRITE))
    returns = op_returns(func)
    is_view = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
    tags = getattr(func, "tags", ())
    random = torch.Tag.nondeterministic_seeded in tags or base in _RANDOM_NAMES
    maybe_nondeterministic = base in NONDETERMINISTIC_OPS
    empty, lift = base in _EMPTY, base.startswith("lift")
    return OpInfo(name=name, base=base, arg_names=tuple(a.name for a in args), writes=writes,
                  overwrites=overwrites, is_view=is_view, random=random, empty=empty, lift=lift,
                  skip=name.startswith("profiler."), maybe_nondeterministic=maybe_nondeterministic,
                  light=not (maybe_nondeterministic or random or empty or lift or is_view),
                  copies=base in _COPIES and not is_view, twin=_twin(name, base, args, writes),
                  returns_self=bool(returns))


def _twin(name: str, base: str, args: list[Any], writes: frozenset[str]) -> Any:
    """``aten.mul.Tensor`` for ``aten.mul_.Tensor``: same arguments, returns new tensors; None for ops
    outside ``_TWINS``."""
    if writes != {"self"} or not base.endswith("_") or base[:-1] not in _TWINS or not name.startswith("aten."):
        return None
    packet = getattr(torch.ops.aten, base[:-1], None)
    twin = getattr(packet, name.split(".")[2], None) if packet is not None else None
    if twin is None or [a.name for a in op_arguments(twin)] != [a.name for a in args]:
        return None
    if any(r.alias_info is not None for r in op_returns(twin)):
        return None
    return twin


def named_tensors(info: OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """``(argument name, tensor)`` for every tensor argument, list elements as ``tensors[3]``."""
    found: list[tuple[str, torch.Tensor]] = []
    names = info.arg_names
    for i, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            found.append((names[i] if i < len(names) else f"arg{i}", value))
        elif isinstance(value, (list, tuple)) and value:
            _tensors_of(names[i] if i < len(names) else f"arg{i}", value, found)
    for name, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            found.append((name, value))
        elif isinstance(value, (list, tuple)) and value:
            _tensors_of(name, value, found)
    return found


def _tensors_of(name: str, value: Any, found: list[tuple[str, torch.Tensor]]) -> None:
    for i, item in enumerate(value):
        if isinstance(item, torch.Tensor):
            found.append((f"{name}[{i}]", item))


def scalars_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """A hash of every non-tensor argument (numbers, shapes, dtypes): a Python value that changed
    between the runs changes it."""
    parts: list[Any] = []
    for value in args:
        _scalar_parts(value, parts)
    for item in kwargs.items():
        _scalar_parts(item, parts)
    return hash(tuple(parts))


def _scalar_parts(value: Any, parts: list[Any]) -> None:
    kind = type(value)
    if kind is int or kind is bool or kind is str or value is None:  # the common cases, first
        parts.append(value)
    elif kind is float:
        parts.append(value.hex())
    elif isinstance(value, torch.Tensor):
        parts.append("T")
    elif isinstance(value, (list, tuple)):
        for item in value:
            _scalar_parts(item, parts)
    elif isinstance(value, (int, float, bool, str, type(None))):
        parts.append(value if not isinstance(value, float) else value.hex())
    elif isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        parts.append(str(value))
    else:  # generators, profiler handles, script objects: their repr holds an address
        parts.append(type(value).__name__)


def fingerprintable(t: torch.Tensor) -> bool:
    """Tensors with readable data in one block: not meta, fake, sparse, nested or quantized."""
    return t.layout == torch.strided and not t.is_nested and not t.is_meta and not t.is_quantized and not is_fake(t)


def _dense_flat(d: torch.Tensor) -> Optional[torch.Tensor]:
    """All elements as one contiguous 1-D view, in memory order, when ``d`` covers a dense block
    (contiguous, or a permutation of it such as a transpose); None when it has gaps or overlaps."""
    if d.is_contiguous():
        return d.view(-1)
    expected = 1
    for size, stride in sorted(zip(d.shape, d.stride()), key=lambda p: p[1]):
        if size != 1 and stride != expected:
            return None
        expected *= size
    return d.as_strided((d.numel(),), (1,))


def _as_ints(d: torch.Tensor) -> torch.Tensor:
    """The raw bits as integers. Narrow dtypes are read four bytes at a time when the memory allows it,
    so the sum wraps at 2**32 rather than 2**16."""
    if d.dim() == 1 and d.element_size() < 4 and d.is_contiguous() and (d.numel() * d.element_size()) % 4 == 0:
        return d.view(torch.int32)
    return d.view(torch.uint8) if d.dtype == torch.bool else d.view(_INT_VIEW[d.element_size()])


SAMPLE = 32  # values kept per float tensor, evenly spaced: they size a difference


def _sample(d: torch.Tensor, flat: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Up to ``SAMPLE`` evenly spaced values of a float tensor (strided views: nothing large is copied)."""
    if not d.is_floating_point() or d.numel() == 0:
        return None
    if flat is None:  # gaps or overlaps: a few rows and columns of each dimension
        flat = d[tuple(slice(None, None, max(1, n // 4)) for n in d.shape)].reshape(-1)
    step = max(1, flat.numel() // SAMPLE)
    return flat[: step * SAMPLE: step]  # one slice: the same values as [::step][:SAMPLE]


def fingerprint_parts(t: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """One reduction on ``t``'s device, the sum of the raw bits in their own width (exact: a changed
    bit changes it, barring a 2**-32 collision; no widening cast, ~10x faster on CPU), and for floats
    a few sampled values that size a difference. Transposed tensors are read in memory order."""
    d = t.detach()
    if d.is_complex():
        d = torch.view_as_real(d)
    flat = _dense_flat(d)
    bits = _as_ints(flat if flat is not None else d)
    return bits.sum(dtype=bits.dtype), _sample(d, flat)


FingerprintValue = tuple[int, tuple[float, ...]]


def fingerprint_now(t: torch.Tensor) -> FingerprintValue:
    """The fingerprint read at once (CPU tensors: no device to wait for)."""
    bits, sample = fingerprint_parts(t)
    return int(bits.item()), tuple(sample.tolist()) if sample is not None else ()


def fingerprint_tensor(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fingerprint left on ``t``'s device (no sync), read later with many others."""
    bits, sample = fingerprint_parts(t)
    values = sample.to(torch.float64) if sample is not None else torch.zeros(0, dtype=torch.float64, device=t.device)
    return bits.to(torch.int64), values


def read_fingerprints(pending: list[tuple[torch.Tensor, torch.Tensor]]) -> list[FingerprintValue]:
    """Bring many fingerprints to the host in two transfers per device."""
    rows: list[FingerprintValue] = [(0, ())] * len(pending)
    by_device: dict[torch.device, list[int]] = {}
    for i, (bits, _) in enumerate(pending):
        by_device.setdefault(bits.device, []).append(i)
    for indices in by_device.values():
        bit_rows = torch.stack([pending[i][0] for i in indices]).cpu().tolist()
        samples = torch.cat([pending[i][1] for i in indices]).cpu().tolist()
        at = 0
        for i, b in zip(indices, bit_rows):
            n = pending[i][1].numel()
            rows[i] = (b, tuple(samples[at:at + n]))
            at += n
    return rows
