"""Which ATen ops need a NaN/Inf check, and the cheap checks themselves.

An op that cannot turn finite inputs into non-finite outputs needs no check: views, copies,
indexing, comparisons, creation, and bounded functions (relu, sigmoid, tanh, gelu). Their
non-finite outputs can only be carried in from an input, and the next checked op sees them.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import torch

from torch_nbdebug.data.nanwatch import ROUNDS_TO_ZERO
from torch_nbdebug.record.compat import node_sequence_nr, op_arguments, tensor_version, tree_leaves

VIEW, SKIP, CHECK, ABSORB, LIFT, CAST, SCALER = 0, 1, 2, 3, 4, 5, 6

# Cannot create a non-finite value from finite inputs (copies, selection, bounded maps, creation). (``neg`` can
# turn a mask's -inf into +inf, a birth: it is checked.)
_SAFE = frozenset("""
detach alias clone contiguous cat stack split split_with_sizes chunk unbind
narrow index index_select gather embedding eq ne lt gt le ge logical_and logical_or logical_not
logical_xor bitwise_and bitwise_or bitwise_not bitwise_xor isnan isinf isfinite isneginf isposinf
zeros ones empty empty_like zeros_like ones_like new_zeros new_ones new_empty empty_strided
new_empty_strided arange rand randn randint rand_like randn_like randint_like normal normal_ uniform_
bernoulli bernoulli_ random_ relu relu_ threshold threshold_backward sigmoid sigmoid_ tanh tanh_
gelu gelu_ silu silu_ hardtanh hardtanh_ hardsigmoid abs sign sgn max min amax amin argmax argmin
aminmax sort topk flip roll repeat _unsafe_view t permute max_pool2d_with_indices max_pool1d
max_pool2d max_pool3d_with_indices zero_ fill fill_ full full_like new_full scalar_tensor tril triu
masked_select nonzero _local_scalar_dense set_ resize_ select_backward slice_backward
expand_copy view_copy permute_copy unsqueeze_copy squeeze_copy
lift_fresh_copy _reshape_alias unfold im2col col2im constant_pad_nd reflection_pad2d
replication_pad2d _assert_async _assert_tensor_metadata sym_size sym_stride sym_numel
_has_compatible_shallow_copy_type is_same_size equal allclose count_nonzero any all
""".split())

# Select or replace values: a non-finite input may be thrown away here (the torch.where trap).
_ABSORBING = frozenset("where masked_fill masked_fill_ nan_to_num nan_to_num_ clamp clamp_ clamp_min "
                       "clamp_min_ clamp_max clamp_max_ index_put index_put_".split())
# Copies that may change the dtype: float32 -> float16 overflows past 65504 (``x.half()``, autocast).
_CASTS = frozenset("_to_copy copy copy_ to _copy_from _copy_from_and_resize".split())
# A tensor literal written by the user (``torch.tensor([...])``).
_LIFTS = frozenset(("lift_fresh",))
HALF = (torch.float16, torch.bfloat16)

_cache: dict[Any, int] = {}
# How an op writes into its arguments: not at all, in place into ``self`` (``log_``), or into ``out=``.
PURE, INPLACE, OUT = 0, 1, 2
_writes: dict[Any, tuple[int, frozenset[str]]] = {}


def category(func: Any) -> int:
    """VIEW, SKIP, CHECK, ABSORB or LIFT for an OpOverload (cached per overload)."""
    found = _cache.get(func)
    if found is None:
        found = _categorize(func)
        _cache[func] = found
    return found


def writes(func: Any) -> tuple[int, frozenset[str]]:
    """(PURE/INPLACE/OUT, names of the ``out=`` arguments) from the op's schema (cached)."""
    found = _writes.get(func)
    if found is None:
        found = _writes[func] = _schema_writes(func)
    return found


def _schema_writes(func: Any) -> tuple[int, frozenset[str]]:
    arguments = op_arguments(func)  # [] without a schema: pure
    written = [a for a in arguments if a.alias_info is not None and a.alias_info.is_write]
    outs = frozenset(a.name for a in written if a.kwarg_only)
    if outs:
        return OUT, outs
    if written and arguments and written[0] is arguments[0]:
        return INPLACE, outs
    return PURE, outs


def pre_state(func: Any, args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """For an op that overwrites its own input and can create NaN/Inf (``x.log_()``,
    ``torch.exp(x, out=x)``): ``self``'s finiteness *before* the op (a 0-d tensor, not read here).
    None for every other op."""
    mode = _writes.get(func)
    if mode is None:
        mode = writes(func)
    if mode[0] == PURE or not args or category(func) != CHECK:
        return None
    t = args[0]
    if mode[0] == OUT and not any(kwargs.get(name) is t for name in mode[1]):
        return None  # out= into a separate tensor: its old contents are not an input
    if not isinstance(t, torch.Tensor) or not checkable(t) or t.numel() == 0:
        return None
    return finite_value(t)


def finite_value(t: torch.Tensor) -> torch.Tensor:
    """A 0-d float32 that is finite exactly when ``t`` is: ``min/2 + max/2`` cannot overflow on
    huge finite values (a sum can), keeps the sign of a lone infinity, and NaN propagates."""
    lo, hi = torch.aminmax(t.detach())
    return lo.float() * 0.5 + hi.float() * 0.5


def op_inputs(func: Any, args: Any, kwargs: dict, limit: int = 32) -> list[torch.Tensor]:
    """The op's checkable float inputs, leaving out the tensors it only writes (``out=``)."""
    mode, outs = writes(func)
    if mode == OUT and kwargs:
        kwargs = {k: v for k, v in kwargs.items() if k not in outs}
    return float_inputs(args, kwargs, limit)


def _categorize(func: Any) -> int:
    name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
    if name in _LIFTS:
        return LIFT
    if name in _ABSORBING:
        return ABSORB
    if name in _CASTS:
        return CAST
    if name in ("_amp_foreach_non_finite_check_and_unscale_", "_amp_foreach_non_finite_check_and_unscale"):
        return SCALER  # GradScaler looking for inf gradients (it then skips the step)
    if getattr(func, "is_view", False):
        return VIEW  # shares its input's storage: nothing new to check or to register
    if name in _SAFE:
        return SKIP
    return CHECK


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def checkable(t: Any) -> bool:
    """A dense float tensor with data: not meta, not sparse, not a subclass (FakeTensor, DTensor...)."""
    # (``is_meta`` reads a flag; ``t.device.type`` builds a device object: this runs for every output)
    return type(t) in _PLAIN and t.is_floating_point() and t.layout == torch.strided and not t.is_meta


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


_ROUNDS_TO_ZERO = {getattr(torch, name): value for name, value in ROUNDS_TO_ZERO.items()}


def rounded_constant(args: tuple, kwargs: dict, dtype: torch.dtype) -> Optional[float]:
    """A Python float among the arguments that ``dtype`` rounds to 0 (``clamp_min(1e-12)``, ``var + 1e-12`` in
    float16): an eps that protects nothing. Called for half-precision outputs only."""
    tiny = _ROUNDS_TO_ZERO.get(dtype, 0.0)
    for value in (*args, *kwargs.values()):
        if type(value) is float and 0.0 < abs(value) < tiny:
            return value
    return None


_SQRT_MAX = {d: math.sqrt(torch.finfo(d).max) for d in HALF}


def squares_may_overflow(inputs: Sequence[torch.Tensor]) -> bool:
    """A half-precision input whose values reach the square root of its dtype's largest number (256 in
    float16): a square or product of it inside the module (``x.pow(2)`` in a hand-written RMSNorm) overflows,
    and an op after it (``rsqrt``) may turn the Inf into a finite, wrong value before the module returns."""
    for x in inputs:
        limit = _SQRT_MAX.get(x.dtype)
        if limit is not None and x.numel():
            lo, hi = torch.aminmax(x.detach())
            if max(-float(lo), float(hi)) > limit:
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


def version_of(t: torch.Tensor) -> int:
    """The version counter (bumped by in-place writes); -1 for an inference tensor, which has none."""
    return -1 if t.is_inference() else tensor_version(t)


def read_together(tensors: Sequence[torch.Tensor]) -> list[list[float]]:
    """Every tensor's values as floats, read with one transfer per device (on CUDA: one host
    synchronisation, however many tensors). ``torch.cat`` promotes the dtypes (float16 norms, float32
    statistics, float64 sums) without changing a NaN/Inf; one ``tolist`` copies the result."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    result: list[list[float]] = [[] for _ in tensors]
    for indices in by_device.values():
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in indices]).tolist()
        pos = 0
        for i in indices:
            n = tensors[i].numel()
            result[i], pos = flat[pos:pos + n], pos + n
    return result


def is_bad_value(value: float) -> bool:
    return not math.isfinite(value)


def finite(t: Any) -> bool:
    """NaN/Inf-propagating sum, read at once (CPU); a sum that overflowed is confirmed element-wise, and a
    tensor we cannot read counts as finite."""
    if not isinstance(t, torch.Tensor) or not checkable(t) or t.numel() == 0:
        return True
    with torch.no_grad():
        return math.isfinite(sum_value(t)) or not any_nonfinite(t)


def any_nonfinite(t: torch.Tensor) -> bool:
    """Precise confirmation (used only after the cheap sum flagged)."""
    return not bool(torch.isfinite(t).all())


def has_nan(t: torch.Tensor) -> bool:
    return bool(torch.isnan(t).any())


def cast_source(func: Any, args: tuple) -> Optional[torch.Tensor]:
    """The tensor a cast/copy reads (``copy_(self, src)`` reads ``src``), if it is a float tensor."""
    name = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else ""
    src = args[1] if name == "copy_" and len(args) > 1 else args[0] if args else None
    return src if isinstance(src, torch.Tensor) and checkable(src) else None


_narrowing: dict[tuple[torch.dtype, torch.dtype], bool] = {}


def narrows(src: torch.dtype, dst: torch.dtype) -> bool:
    """Can a finite ``src`` value overflow in ``dst`` (float32 -> float16, bfloat16 -> float16)?"""
    key = (src, dst)
    found = _narrowing.get(key)
    if found is None:
        found = _narrowing[key] = src.is_floating_point and dst.is_floating_point and \
            torch.finfo(dst).max < torch.finfo(src).max
    return found


def any_external(func: Any, args: tuple, produced: Any) -> bool:
    """Does a copy-like op read a float tensor the watch did not produce (one list level deep)?
    An in-place op's ``self`` is written, not read (``buf.copy_(src)``, ``x.fill_(v)``)."""
    mode = _writes.get(func)
    if mode is None:
        mode = writes(func)
    for a in args[1:] if mode[0] == INPLACE else args:
        if isinstance(a, torch.Tensor):
            if a.is_floating_point() and not produced.contains(a):
                return True
        elif isinstance(a, (list, tuple)):
            for t in a:
                if isinstance(t, torch.Tensor) and t.is_floating_point() and not produced.contains(t):
                    return True
    return False


def op_name(func: Any) -> str:
    return str(func)


_MAX_LEAVES = 16  # float tensors of one module output checked for births


def float_leaves(value: Any, depth: int = 0) -> list[torch.Tensor]:
    """Every checkable float tensor of a module output (tuples, lists, dicts, dataclass fields), capped."""
    if isinstance(value, torch.Tensor):
        return [value] if checkable(value) and value.numel() > 0 else []
    if depth > 4:
        return []
    if isinstance(value, dict):
        items: Any = value.values()
    elif isinstance(value, (tuple, list)):
        items = value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [getattr(value, f.name, None) for f in dataclasses.fields(value)]
    else:
        return []
    found: list[torch.Tensor] = []
    for item in items:
        found += [x for x in float_leaves(item, depth + 1) if all(x is not y for y in found)]
        if len(found) >= _MAX_LEAVES:
            return found[:_MAX_LEAVES]
    return found


def made_since(t: torch.Tensor, seq: int) -> bool:
    """Whether autograd made ``t`` at or after node number ``seq`` (a leaf, or a tensor made without
    autograd, was not)."""
    fn = t.grad_fn
    return fn is not None and node_sequence_nr(fn) >= seq
