"""Which ATen ops need a NaN/Inf check, and the cheap checks themselves.

An op that cannot turn finite inputs into non-finite outputs needs no check: views, copies,
indexing, comparisons, creation, and bounded functions (relu, sigmoid, tanh, gelu). Their
non-finite outputs can only be carried in from an input, and the next checked op sees them.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch
from torch.utils._pytree import tree_leaves

VIEW, SKIP, CHECK, ABSORB, LIFT = 0, 1, 2, 3, 4

# Cannot create a non-finite value from finite inputs (copies, selection, bounded maps, creation).
_SAFE = frozenset("""
detach alias clone contiguous _to_copy copy copy_ to cat stack split split_with_sizes chunk unbind
narrow index index_select gather embedding eq ne lt gt le ge logical_and logical_or logical_not
logical_xor bitwise_and bitwise_or bitwise_not bitwise_xor isnan isinf isfinite isneginf isposinf
zeros ones empty empty_like zeros_like ones_like new_zeros new_ones new_empty empty_strided
new_empty_strided arange rand randn randint rand_like randn_like randint_like normal normal_ uniform_
bernoulli bernoulli_ random_ relu relu_ threshold threshold_backward sigmoid sigmoid_ tanh tanh_
gelu gelu_ silu silu_ hardtanh hardtanh_ hardsigmoid abs neg sign sgn max min amax amin argmax argmin
aminmax sort topk flip roll repeat _unsafe_view t permute max_pool2d_with_indices max_pool1d
max_pool2d max_pool3d_with_indices zero_ fill fill_ full full_like new_full scalar_tensor tril triu
masked_select nonzero _local_scalar_dense set_ resize_ select_backward slice_backward
index_put index_put_ expand_copy view_copy permute_copy unsqueeze_copy squeeze_copy
lift_fresh_copy _reshape_alias unfold im2col col2im constant_pad_nd reflection_pad2d
replication_pad2d _assert_async _assert_tensor_metadata sym_size sym_stride sym_numel
_has_compatible_shallow_copy_type is_same_size equal allclose count_nonzero any all
""".split())

# Select or replace values: a non-finite input may be thrown away here (the torch.where trap).
_ABSORBING = frozenset("where masked_fill masked_fill_ nan_to_num nan_to_num_ clamp clamp_ clamp_min "
                       "clamp_min_ clamp_max clamp_max_".split())
# A tensor literal written by the user (``torch.tensor([...])``).
_LIFTS = frozenset(("lift_fresh",))
HALF = (torch.float16, torch.bfloat16)

_cache: dict[Any, int] = {}


def category(func: Any) -> int:
    """VIEW, SKIP, CHECK, ABSORB or LIFT for an OpOverload (cached per overload)."""
    found = _cache.get(func)
    if found is None:
        found = _categorize(func)
        _cache[func] = found
    return found


def _categorize(func: Any) -> int:
    name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
    if name in _LIFTS:
        return LIFT
    if name in _ABSORBING:
        return ABSORB
    if getattr(func, "is_view", False):
        return VIEW  # shares its input's storage: nothing new to check or to register
    if name in _SAFE:
        return SKIP
    return CHECK


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def checkable(t: Any) -> bool:
    """A dense float tensor with data: not meta, not sparse, not a subclass (FakeTensor, DTensor...)."""
    return type(t) in _PLAIN and t.is_floating_point() and t.layout == torch.strided and t.device.type != "meta"


def float_outputs(out: Any) -> list[torch.Tensor]:
    """Checkable floating-point tensors among an op's outputs (one level of tuple/list)."""
    if isinstance(out, torch.Tensor):
        return [out] if checkable(out) else []
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor) and checkable(t)]
    return []


def float_inputs(args: Any, kwargs: Any, limit: int = 32) -> list[torch.Tensor]:
    """Up to ``limit`` checkable floating-point tensors among the arguments (lists included)."""
    found = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and checkable(t)]
    return found[:limit]


def has_nonfinite_scalar(args: Any, kwargs: Any) -> bool:
    """True when the user passed an infinite/NaN constant (``masked_fill(m, -inf)``): intentional."""
    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, float) and not math.isfinite(leaf):
            return True
    return False


def propagating_sum(t: torch.Tensor) -> torch.Tensor:
    """A 0-d float32 sum: NaN/Inf propagate through it, ~20x cheaper than ``isfinite().all()``.

    Half types are summed in float32 so that a sum of finite values cannot overflow.
    """
    if t.dtype in HALF:
        return t.sum(dtype=torch.float32)
    return t.sum()


def sum_value(t: torch.Tensor) -> float:
    """The propagating sum read back as a Python float (CPU: no device synchronisation)."""
    return propagating_sum(t).item()


def is_bad_value(value: float) -> bool:
    return not math.isfinite(value)


def any_nonfinite(t: torch.Tensor) -> bool:
    """Precise confirmation (used only after the cheap sum flagged)."""
    return not bool(torch.isfinite(t).all())


def has_nan(t: torch.Tensor) -> bool:
    return bool(torch.isnan(t).any())


def storage_key(t: torch.Tensor) -> Optional[int]:
    """Identity of a tensor's storage (shared by its views); None for tensors without one."""
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def op_name(func: Any) -> str:
    return str(func)


def all_tensors(items: Iterable[Any]) -> list[torch.Tensor]:
    return [t for t in items if isinstance(t, torch.Tensor)]
