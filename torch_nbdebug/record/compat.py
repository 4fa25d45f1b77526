"""The one door to PyTorch's private API (DESIGN.md section 9).

Every ``torch._C`` call and every other private torch name the package uses is reached through this
module, so a torch release that renames one breaks one place, with a message that names the feature
and the torch it needs. Public equivalents come first (``StorageWeakRef`` for storage lifetimes,
``torch.compiler.set_stance`` for compiled code); what has none is wrapped here, looked up lazily
where it is not on the hot path, and bound once where it is (the op-level recorders call these for
every op).

This module imports torch only (plus the package's one error class, which imports nothing).
"""
from __future__ import annotations

import importlib
import re
import sys
import threading
import types
import warnings
import weakref
from typing import Any, Callable, Collection, Iterable, Iterator, Optional, cast

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torch_nbdebug.errors import NbdebugError

__all__ = [
    "FEATURES", "MIN_TORCH", "NO_SEQUENCE", "StorageWeakRef", "TORCH_VERSION", "TorchDispatchMode",
    "TorchVersionError", "at_least", "below_autograd", "bind", "compiled_callables", "cuda_history_enabled",
    "collective_work", "cuda_memory_snapshot", "current_autograd_node", "dispatch_mode_at", "dispatch_stack_len",
    "drop_library", "dynamo_loaded", "FLIGHT_RECORDER_ENV", "flight_recorder_dump",
    "floor_warning", "force_eager", "foreach_norm", "free_storage_weak_ref", "function_mode_at",
    "function_stack_len", "global_hook_warning", "is_compiled_module", "is_fake", "next_sequence_nr", "node_output_metadata",
    "node_saved_attributes", "node_sequence_nr", "op_arguments", "op_returns", "original_module",
    "parse_version", "pop_dispatch_mode", "profiler_anti_patterns", "profiler_events", "profiler_running", "pop_function_mode", "push_dispatch_mode", "push_function_mode",
    "queue_backward_callback", "require", "restore_stance", "start_cuda_memory_history",
    "stop_cuda_memory_history", "storage_expired", "storage_id", "storage_key", "storage_use_count",
    "storage_weak_ref", "tensor_key", "tensor_version", "tree_leaves", "unskip_dynamo_codes",
]


def parse_version(text: str) -> tuple[int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13)``; ``"2.14.0.dev20261101"`` -> ``(2, 14)``."""
    match = re.match(r"(\d+)\.(\d+)", text)
    if match is None:
        raise ValueError(f"cannot read a torch version from {text!r}")
    return int(match.group(1)), int(match.group(2))


TORCH_VERSION: tuple[int, int] = parse_version(torch.__version__)

# The oldest torch the test suite runs (requirements/dev.txt pins it; pyproject.toml claims it).
MIN_TORCH: tuple[int, int] = (2, 13)

# Feature -> (first torch that has it, what the feature is for). A version map like torchview's:
# ``require`` turns a missing feature into one sentence naming the feature and the torch it needs.
FEATURES: dict[str, tuple[tuple[int, int], str]] = {
    "cuda_memory_history": ((2, 1), "the CUDA allocator timeline (_record_memory_history with stacks=)"),
    "foreach_norm_dtype": ((2, 3), "batched float32 gradient norms of half-precision gradients"),
    "compiler_stance": ((2, 6), "keeping torch.compile'd code compiled around a watch (torch.compiler.set_stance)"),
    "package": (MIN_TORCH, "torch_nbdebug"),
}


class TorchVersionError(NbdebugError, RuntimeError):
    """The installed torch is too old for a feature: the message names the feature and the version."""


def floor_warning(current: Optional[tuple[int, int]] = None) -> Optional[str]:
    """The sentence to show once when the installed torch is older than the one the suite runs."""
    have = TORCH_VERSION if current is None else current
    if have >= MIN_TORCH:
        return None
    return (f"torch_nbdebug is tested with torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}, but torch {have[0]}.{have[1]} is "
            f"installed: some features may fail; upgrade with `pip install -U 'torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}'`")


def at_least(version: tuple[int, int], current: Optional[tuple[int, int]] = None) -> bool:
    """Whether the installed torch (or ``current``) is at least ``version``."""
    return (TORCH_VERSION if current is None else current) >= version


def require(feature: str, current: Optional[tuple[int, int]] = None) -> None:
    """Raise :class:`TorchVersionError` when ``feature`` needs a newer torch than the installed one."""
    needed, purpose = FEATURES[feature]
    have = TORCH_VERSION if current is None else current
    if have < needed:
        raise TorchVersionError(
            f"{purpose} needs torch>={needed[0]}.{needed[1]}, but torch {have[0]}.{have[1]} is installed: "
            f"upgrade with `pip install -U 'torch>={needed[0]}.{needed[1]}'`")


def bind(owner: Any, name: str, what: str) -> Callable[..., Any]:
    """``owner.name`` (a private torch function), or a stand-in that raises :class:`TorchVersionError`
    when called: a torch release that drops the name breaks the one feature using it, with a message,
    not the import of the whole package."""
    found = getattr(owner, name, None)
    if callable(found):
        return found
    where = f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"

    tested = f"{MIN_TORCH[0]}.{MIN_TORCH[1]}"

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise TorchVersionError(
            f"{what} needs {where}, which torch {torch.__version__} does not have; torch_nbdebug is tested "
            f"with torch {tested}: install it with `pip install 'torch=={tested}.*'`")

    return missing


if (_FLOOR := floor_warning()) is not None:  # pip enforces the floor; --no-deps or conda may not
    warnings.warn(_FLOOR, RuntimeWarning, stacklevel=2)


# -- storages ---------------------------------------------------------------------------------
def storage_key(tensor: torch.Tensor) -> Optional[int]:
    """Identity of a tensor's storage (shared by all its views), or None for storage-less tensors.

    The key equals ``StorageWeakRef(storage).cdata`` (both are the StorageImpl address) without taking
    and dropping a weak count per call: recorders ask for it on every op output.
    """
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None  # sparse, nested, functional or wrapper subclasses: no plain storage


def storage_id(storage: Any) -> int:
    """The key of an ``UntypedStorage`` itself (what :func:`storage_key` returns for its tensors)."""
    return storage._cdata


def storage_weak_ref(storage: Any) -> int:
    """A raw weak reference (an int, equal to the storage's key) that keeps the address from being
    reused while held; free it with :func:`free_storage_weak_ref`. ``StorageWeakRef`` is the public
    object form; registries holding hundreds of thousands of entries keep the bare int."""
    return storage._weak_ref()


def storage_use_count(tensor: torch.Tensor) -> Optional[int]:
    """How many strong references hold ``tensor``'s storage: its TensorImpls (the tensor and every view
    or alias) plus one for the Python storage object this call reads it through. None when this torch
    cannot say or the tensor has no plain storage (callers then treat the storage as shared)."""
    if _storage_use_count is None:
        return None
    try:
        return int(_storage_use_count(tensor.untyped_storage()._cdata))
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):
        return None


_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)
# Bound once: registries purge thousands of entries at a time.
storage_expired: Callable[[int], bool] = bind(torch.UntypedStorage, "_expired", "storage lifetimes")
"""Whether the storage behind a raw weak reference (:func:`storage_weak_ref`) has been freed."""
free_storage_weak_ref: Callable[[int], None] = bind(torch.UntypedStorage, "_free_weak_ref", "storage lifetimes")
"""Drop a raw weak reference from :func:`storage_weak_ref`."""


# -- tensors ----------------------------------------------------------------------------------
def tensor_key(tensor: torch.Tensor) -> int:
    """Identity of a tensor's TensorImpl: stable while it lives, unlike ``id()`` of its Python object,
    which is dropped and made again when a tensor passes through C++ only (autograd's backward)."""
    return tensor._cdata


_FAKE: list[type] = []


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a FakeTensor (shapes only, no data: statistics must not read it)."""
    if not _FAKE:
        from torch._subclasses.fake_tensor import FakeTensor  # imported on first use: it is not small

        _FAKE.append(FakeTensor)
    return isinstance(t, _FAKE[0])


def foreach_norm(tensors: list[torch.Tensor], ord: float = 2,
                 dtype: Optional[torch.dtype] = None) -> list[torch.Tensor]:
    """One batched kernel for many norms (``torch._foreach_norm``), optionally accumulated in ``dtype``."""
    if dtype is None:
        return list(torch._foreach_norm(tensors, ord))
    if not at_least(FEATURES["foreach_norm_dtype"][0]):
        return [torch.linalg.vector_norm(t, ord, dtype=dtype) for t in tensors]
    return list(torch._foreach_norm(tensors, ord, dtype=dtype))


def op_arguments(func: Any) -> list[Any]:
    """The schema arguments of an ATen overload (``func._schema.arguments``); [] when it has none."""
    schema = getattr(func, "_schema", None)
    return list(schema.arguments) if schema is not None else []


def op_returns(func: Any) -> list[Any]:
    """The schema returns of an ATen overload (``func._schema.returns``, each with ``alias_info``)."""
    schema = getattr(func, "_schema", None)
    return list(schema.returns) if schema is not None else []


# -- autograd ---------------------------------------------------------------------------------
# Bound once: the op-level recorders call these for every op.
current_autograd_node: Callable[[], Any] = bind(torch._C, "_current_autograd_node", "telling backward from forward")
"""The autograd node whose backward is running now (None in forward)."""
next_sequence_nr: Callable[[], int] = bind(torch._C._autograd, "_get_sequence_nr", "matching backward nodes to ops")
"""The sequence number the next autograd node made on this thread will get."""


NO_SEQUENCE = 2**64 - 1
"""The sequence number of nodes made outside forward (AccumulateGrad, graph roots)."""


def node_sequence_nr(node: Any) -> int:
    """An autograd node's sequence number (its creation order in forward; ``NO_SEQUENCE`` for none)."""
    return node._sequence_nr()


def node_output_metadata(node: Any) -> Iterable[Any]:
    """Metadata (``shape``, ``dtype``) of the forward outputs a node receives gradients for."""
    return node._input_metadata


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the running backward pass has finished (call it from a backward hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def tensor_version(t: torch.Tensor) -> int:
    """The tensor's version counter (bumped by every in-place write): a changed value means changed data."""
    return t._version


def tensor_versions(tensors: Iterable[torch.Tensor]) -> tuple[int, ...]:
    """Each tensor's version counter, -1 for an inference tensor (which keeps none), in one call: a model's
    parameters are read at every model call."""
    return tuple([-1 if t.is_inference() else t._version for t in tensors])


# -- modules' own registries ----------------------------------------------------------------------
def buffer_registry(module: torch.nn.Module) -> dict[str, Any]:
    """The module's own buffer dict (``_buffers``), the one ``register_buffer`` writes: a replay swaps
    clones in and puts the originals back without a ``register_buffer`` call per buffer."""
    return cast(dict[str, Any], module._buffers)


def own_parameters(module: torch.nn.Module) -> list[Any]:
    """The module's own parameters, ``None`` entries included, in order (``_parameters``; no recursion)."""
    return list(module._parameters.values())


def child_module_dict(module: torch.nn.Module) -> dict[str, Any]:
    """The module's own child dict (``_modules``: live, not a copy; ``None`` entries included), by name."""
    return module._modules


def parameter_and_child_dicts(module: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """The module's own parameter and child dicts (``_parameters``, ``_modules``: live, not copies; ``None``
    entries included), in one call: a walk of the module tree reads them at every module."""
    return module._parameters, module._modules


def module_registries(module: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The module's own parameter, buffer and child dicts (live, not copies): what an attribute name of the
    module itself holds, read without a descriptor or ``__getattr__``."""
    return (cast(dict[str, Any], module._parameters), cast(dict[str, Any], module._buffers),
            cast(dict[str, Any], module._modules))


def view_base(t: torch.Tensor) -> Optional[torch.Tensor]:
    """The tensor a view was made from (``_base``), or None for a tensor that is no view."""
    return t._base if t._is_view() else None


def node_saved_attributes(node: Any) -> list[str]:
    """Names of a node's saved-for-backward attributes (``_saved_self``, ...): ``dir`` is slow, cache it."""
    return [a for a in dir(node) if a.startswith("_saved_")]


# -- dispatch and function mode stacks -------------------------------------------------------
dispatch_stack_len: Callable[[], int] = bind(torch._C, "_len_torch_dispatch_stack", "the dispatch mode stack")
"""How many TorchDispatchModes are on the stack."""
dispatch_mode_at: Callable[[int], Any] = bind(torch._C, "_get_dispatch_stack_at", "the dispatch mode stack")
"""The dispatch mode at a stack index (0 = outermost)."""
function_stack_len: Callable[[], int] = bind(torch._C, "_len_torch_function_stack", "the function mode stack")
"""How many TorchFunctionModes are on the stack."""
function_mode_at: Callable[[int], Any] = bind(torch._C, "_get_function_stack_at", "the function mode stack")
"""The function mode at a stack index (0 = outermost)."""
pop_function_mode: Callable[[], Any] = bind(torch._C, "_pop_torch_function_stack", "the function mode stack")
"""Take the innermost function mode off the stack (without running its ``__exit__``)."""
push_function_mode: Callable[[Any], None] = bind(torch._C, "_push_on_torch_function_stack", "the function mode stack")
"""Put a mode taken off with :func:`pop_function_mode` back on top."""


def collective_work(value: Any) -> Any:
    """The ``Work`` (``is_completed()``, ``wait()``) of a c10d op's boxed result as a dispatch mode sees it
    (a ``torch.ScriptObject``); None when it is none."""
    try:
        from torch._C._distributed_c10d import Work
    except ImportError:  # torch built without distributed
        return None
    try:
        return Work.unbox(value)
    except (RuntimeError, TypeError):
        return None


FLIGHT_RECORDER_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
"""Flight Recorder records the collectives of process groups created while one of these is set (gloo and NCCL)."""


def flight_recorder_dump() -> Optional[str]:
    """Flight Recorder's record of this process's collectives as JSON text (collectives and stack traces
    included), or None when this torch has none."""
    try:
        _dump_fr_trace_json = getattr(importlib.import_module("torch._C._distributed_c10d"), "_dump_fr_trace_json")
    except (ImportError, AttributeError):
        return None
    try:
        return _dump_fr_trace_json(True, True)
    except RuntimeError:
        return None


def below_autograd() -> Any:
    """A context in which an op called again skips the Autograd key (a kernel registered there calls the
    op's real kernel this way, as torch.library's examples do)."""
    return torch._C._AutoDispatchBelowAutograd()


def drop_library(lib: Any) -> None:
    """Remove every kernel a ``torch.library.Library`` registered (the ops' own kernels are back)."""
    lib._destroy()


def pop_dispatch_mode() -> Any:
    """Take the innermost dispatch mode off the stack (without running its ``__exit__``)."""
    return torch._C._pop_torch_dispatch_stack(None)


def push_dispatch_mode(mode: Any) -> None:
    """Put a mode taken off with :func:`pop_dispatch_mode` back on top."""
    torch._C._push_on_torch_dispatch_stack(mode)


# -- CUDA allocator history ------------------------------------------------------------------
def cuda_history_enabled() -> bool:
    """Whether anyone has CUDA allocator history recording on (False without CUDA)."""
    if not torch.cuda.is_available():
        return False
    return bool(torch._C._cuda_isHistoryEnabled())


def start_cuda_memory_history(max_entries: int) -> None:
    """Record every allocator event with Python stacks, starting from an empty history."""
    require("cuda_memory_history")
    torch.cuda.memory._record_memory_history("all", context="all", stacks="python",
                                            max_entries=max_entries, clear_history=True)


def stop_cuda_memory_history() -> None:
    """Turn allocator history off and clear it (so a later snapshot shows none of our events)."""
    torch.cuda.memory._record_memory_history(enabled=None, clear_history=True)


def cuda_memory_snapshot() -> dict[str, Any]:
    """The allocator's segments and per-device traces, as PyTorch's memory viewer reads them."""
    return torch.cuda.memory._snapshot()


# -- torch.compile ---------------------------------------------------------------------------
# Dynamo refuses to run or compile frames while a TorchDispatchMode is on the stack, and it marks each
# code object it refused as "skip" for good (torch/_dynamo/convert_frame.py, CatchErrorsWrapper), so
# a compiled model called once under a watch would run eagerly for the rest of the process.
def dynamo_loaded() -> bool:
    """Whether torch.compile has been used in this process (importing dynamo costs about a second)."""
    return "torch._dynamo" in sys.modules


def force_eager() -> Any:
    """Run compiled code eagerly from now on, without touching its caches; undo with :func:`restore_stance`.

    ``torch.compiler.set_stance`` (public) sets the stance when called and restores the previous one
    on ``__exit__``, so nested watches restore each other's stance in order.
    """
    require("compiler_stance")
    return torch.compiler.set_stance("force_eager")


def restore_stance(stance: Any) -> None:
    """Put back the compiler stance that was current before :func:`force_eager`."""
    stance.__exit__(None, None, None)


class _HookWarningFilter:
    """While any of this package's global module hooks is installed, torch's warning that a
    ``torch.compile(module)`` wrapper makes global hooks fire an extra time is ours to handle (the tools
    know the wrapper and its model as one), not the user's: it is filtered out, by one filter entry shared
    by every watch (counted: nested watches and threads), removed when the last one ends. The user's own
    filters, before and during the watch, are left as they are."""

    MESSAGE = r"Using `torch\.compile\(module\)` when there are global hooks on modules"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self._entry: Any = None  # the filter entry we added, and the filter list it was added to
        self._where: list = []

    def acquire(self) -> None:
        with self._lock:
            if self._users == 0:
                if not any(f[0] == "ignore" and f[1] is not None and f[1].pattern == self.MESSAGE
                           for f in warnings.filters):  # (the user's own, same filter: left where it is)
                    warnings.filterwarnings("ignore", message=self.MESSAGE, category=UserWarning)
                    self._entry, self._where = warnings.filters[0], cast("list[Any]", warnings.filters)  # a list (typed Sequence)
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users = max(0, self._users - 1)
            if self._users or self._entry is None:
                return
            entry, self._entry = self._entry, None
            # From the list it went into, and from the current one (a catch_warnings block entered in the
            # watch swaps the list, and puts the one we added to back when it ends).
            for filters in (self._where, cast("list[Any]", warnings.filters)):
                if any(f is entry for f in filters):
                    filters.remove(entry)
            self._where = []
            warnings._filters_mutated()  # type: ignore[attr-defined]  # (its cache of seen warnings)


global_hook_warning = _HookWarningFilter()


def is_compiled_module(module: Any) -> bool:
    """Whether ``module`` is the wrapper ``torch.compile(module)`` returns (an ``OptimizedModule``)."""
    dynamo = sys.modules.get("torch._dynamo")
    return dynamo is not None and isinstance(module, dynamo.OptimizedModule)


def original_module(module: Any) -> Any:
    """The module ``torch.compile(module)`` wrapped (its ``_orig_mod``), or ``module`` itself: names
    and parameters are the user's (``model.fc2``, not ``model._orig_mod.fc2``)."""
    if not is_compiled_module(module):
        return module
    inner = vars(module).get("_modules", {}).get("_orig_mod")  # no __getattr__: the wrapper forwards it
    return inner if isinstance(inner, torch.nn.Module) else module


_WRAPPER_CODE: list[Optional[types.CodeType]] = []


def _wrapper_code() -> Optional[types.CodeType]:
    """The code object of dynamo's ``compile_wrapper``, the frame every compiled call runs through
    (None if a torch release renamed it: compiled calls are then not named in the report)."""
    if not _WRAPPER_CODE:
        from torch._dynamo.eval_frame import _TorchDynamoContext

        codes = [c for c in _TorchDynamoContext.__call__.__code__.co_consts
                 if isinstance(c, types.CodeType) and c.co_name == "compile_wrapper"]
        _WRAPPER_CODE.append(codes[0] if codes else None)
    return _WRAPPER_CODE[0]


def compiled_callables(frame: Optional[types.FrameType], limit: int = 64) -> Iterator[Any]:
    """The callables that torch.compile wrapped, for each compiled call on the stack above ``frame`` (a
    module forward pre-hook's caller), up to the call of the module that encloses this one: the compiled
    calls above it were found when its own pre-hook ran. At top level (no enclosing module call) the whole
    stack, up to ``limit`` frames. (The whole stack at every module call costs in proportion to its
    depth: a notebook cell's is deep.)"""
    code = _wrapper_code()
    if code is None:
        return
    call_impl = torch.nn.Module._call_impl.__code__
    module_calls = 0
    depth = 0
    while frame is not None and depth < limit:
        if frame.f_code is code:
            fn = frame.f_locals.get("fn")
            if fn is not None:
                yield _unwrap(fn)
        elif frame.f_code is call_impl:
            module_calls += 1
            if module_calls == 2:  # the first is this module's own call
                return
        frame = frame.f_back
        depth += 1


def _unwrap(fn: Any) -> Any:
    """The user's callable inside dynamo's wrappers (``wrap_inline`` and friends close over ``fn``)."""
    for _ in range(8):
        inner = getattr(fn, "__wrapped__", None)
        code = getattr(fn, "__code__", None)
        if inner is None and code is not None and "fn" in code.co_freevars and fn.__closure__:
            inner = fn.__closure__[code.co_freevars.index("fn")].cell_contents
        if inner is None:
            return fn
        fn = inner
    return fn


def unskip_dynamo_codes() -> list[types.CodeType]:
    """Let dynamo decide afresh for every code object it has seen; returns those code objects.

    For torch.compile first used while a dispatch mode was on: every frame dynamo saw was refused and
    marked "skip" for good. Resetting a frame dynamo would have skipped anyway only makes it ask again.
    """
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    from torch._dynamo.convert_frame import input_codes

    codes = [code for code in (ref() for ref in list(input_codes.seen)) if code is not None]
    for code in codes:
        set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.DEFAULT, _FrameAction.DEFAULT))
    return codes


# -- dispatch modes without dynamo's per-op wrapper -------------------------------------------
def _never_compile_setter() -> Optional[Callable[[types.CodeType], None]]:
    """Marks a code object so dynamo neither compiles it nor anything it calls (None on a torch without
    per-code strategies). A C-level setting: dynamo need not be imported, and it holds when it is later."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:
        return None
    strategy = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
    return lambda code: set_code_exec_strategy(code, strategy)


_NEVER_COMPILE = _never_compile_setter()


class EagerDispatchMode(TorchDispatchMode):
    """A :class:`TorchDispatchMode` whose handler dynamo never compiles, without a wrapper per op.

    TorchDispatchMode wraps every subclass's ``__torch_dispatch__`` in ``torch._disable_dynamo``: two
    more Python frames and two eval-frame switches on every op (a fifth of a no-op mode's cost on a
    small model), and an import of dynamo (about a second) on the first op. Here the handler's code
    object is marked once instead, with the strategy that wrapper applies per call (skip it and all
    it calls): when ``torch.compile`` is first used inside the block, dynamo still never traces the
    recorder. ``_should_skip_dynamo`` is the private switch TorchDispatchMode reads in
    ``__init_subclass__``; on a torch that cannot mark code objects the wrapper stays.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return _NEVER_COMPILE is None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        code = getattr(cls.__dict__.get("__torch_dispatch__"), "__code__", None)
        if _NEVER_COMPILE is not None and code is not None:
            _NEVER_COMPILE(code)


def op_output_aliases_input(func: Any) -> bool:
    """Whether an ATen overload's schema says a return may share an input's storage (views, in-place
    and ``out=`` ops), or the op is one of those known to return an alias without saying so.
    True when there is no schema to read: the caller then checks the inputs, which is always right."""
    schema = getattr(func, "_schema", None)
    if schema is None or getattr(func, "__name__", "").split(".")[0] in _UNANNOTATED_ALIASES:
        return True
    return any(r.alias_info is not None for r in schema.returns)


# Ops whose schema shows no alias but whose result may be a view of an input (``_unsafe_view`` is
# ``reshape``'s "view without a view's bookkeeping"; ``_reshape_alias`` likewise).
_UNANNOTATED_ALIASES = frozenset({"_unsafe_view", "_reshape_alias", "alias", "lift_fresh"})


def _storage_id_getter() -> Callable[[Any], int]:
    descriptor = vars(getattr(torch._C, "StorageBase", object)).get("_cdata")
    return descriptor.__get__ if descriptor is not None else storage_id


storage_id_of: Callable[[Any], int] = _storage_id_getter()
""":func:`storage_id` as the attribute's own C getter (no Python frame), for recorders that call it on
every op output; :func:`storage_id` itself where torch has no such descriptor."""


def global_module_hook_ids(skip_package: str = "") -> set[int]:
    """The ids of every global module hook (``register_module_forward_hook`` and friends), less those
    whose function is defined in ``skip_package`` (this package's own recorders, which keep out of a replay)."""
    from torch.nn.modules import module as m

    names = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
             "_global_backward_pre_hooks")
    return {key for name in names for key, hook in (getattr(m, name, {}) or {}).items()
            if not (skip_package and _defined_in(hook, skip_package))}


def _defined_in(hook: Any, package: str) -> bool:
    module = getattr(getattr(hook, "__func__", hook), "__module__", None) or ""
    return module == package or module.startswith(package + ".")


_AUTOCAST_DEVICES = ("cpu", "cuda")


def autocast_state() -> tuple[tuple[str, Any], ...]:
    """The devices autocast is on for now, with their dtypes (``torch.is_autocast_enabled(device)`` is
    2.4+; older releases had one function per device)."""
    state = []
    for device in _AUTOCAST_DEVICES:
        try:
            on, dtype = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
        except (TypeError, AttributeError, RuntimeError):  # pragma: no cover - torch < 2.4
            on = torch.is_autocast_cpu_enabled() if device == "cpu" else torch.is_autocast_enabled()
            dtype = torch.get_autocast_cpu_dtype() if device == "cpu" else torch.get_autocast_gpu_dtype()
        if on:
            state.append((device, dtype))
    return tuple(state)


def autocast_contexts(state: tuple[tuple[str, Any], ...]) -> list[Any]:
    """The ``torch.autocast`` contexts that make autocast as it was when ``state`` was taken (on or off
    per device, same dtype); the caller enters them."""
    wanted, now = dict(state), dict(autocast_state())
    contexts = []
    for device in _AUTOCAST_DEVICES:
        if device in wanted and now.get(device) != wanted[device]:
            contexts.append(torch.autocast(device, dtype=wanted[device]))
        elif device not in wanted and device in now:
            contexts.append(torch.autocast(device, enabled=False))
    return contexts


def failed_call_kwargs(module: torch.nn.Module) -> Optional[dict]:
    """The keyword arguments of ``module``'s call whose forward is raising right now, read from
    ``Module._call_impl``'s frame: torch calls ``always_call`` forward hooks with ``(module, args,
    None)`` only on that path, even when they were registered ``with_kwargs``. None when not found."""
    code = getattr(torch.nn.Module._call_impl, "__code__", None)
    frame: Optional[types.FrameType] = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code and frame.f_locals.get("self") is module:
            kwargs = frame.f_locals.get("kwargs")
            return dict(kwargs) if isinstance(kwargs, dict) else None
        frame = frame.f_back
    return None


def autocast_off() -> bool:
    """True when autocast is on for no device: :func:`autocast_state` is then ``()`` (two flag reads
    instead of four calls; nanwatch asks at every module call)."""
    try:
        return not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"))
    except (TypeError, AttributeError, RuntimeError):  # pragma: no cover - torch < 2.4
        return not autocast_state()


def saved_tensors_hooks_active() -> bool:
    """Whether a ``torch.autograd.graph.saved_tensors_hooks`` context is active on this thread (its
    pack hook runs for every tensor saved for backward now, its unpack hook when one is read back)."""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    except (AttributeError, TypeError, RuntimeError):  # pragma: no cover - another torch: assume hooks
        return True


def leaf_hooks(tensor: torch.Tensor, own: tuple[type, ...] = ()) -> bool:
    """Whether a leaf tensor has hooks of the user's that run in backward: ``register_hook`` (other than
    instances of the ``own`` classes) or ``register_post_accumulate_grad_hook`` (read from torch's dicts)."""
    hooks = getattr(tensor, "_backward_hooks", None) or {}
    return any(not isinstance(h, own) for h in hooks.values()) \
        or bool(getattr(tensor, "_post_accumulate_grad_hooks", None))


def replace_tensor_hook(tensor: torch.Tensor, handle_id: int, old: Any, new: Any) -> None:
    """Put ``new`` in the place of the tensor hook ``old`` registered under ``handle_id`` (the id of the
    ``RemovableHandle`` ``register_hook`` returned); nothing when the hook was removed or replaced."""
    hooks = getattr(tensor, "_backward_hooks", None)
    if hooks is not None and hooks.get(handle_id) is old:
        hooks[handle_id] = new


def embedding_pads(node: Any) -> bool:
    """Whether an ``EmbeddingBackward0`` node has a ``padding_idx`` (its backward zeroes that row's
    gradient; torch saves "none" as -1, read back as 2**64 - 1)."""
    try:
        return 0 <= int(node._saved_padding_idx) < 2**63
    except (AttributeError, RuntimeError, TypeError, ValueError):  # pragma: no cover - another torch: assume so
        return True


def hooks_in_modules(modules: Iterable[Any], own: Collection[int] = ()) -> bool:
    """Whether one of ``modules`` (a model's ``modules()``, listed by the caller) has hooks of its own
    (forward, forward pre, backward), or a global module hook is installed other than ``own`` (the
    caller's handle ids) and this package's: running the model again would run them again. Reads
    ``nn.Module``'s private hook dicts (no public accessor)."""
    for m in modules:  # (a loop, not a generator: it runs over every module of a model at every backward)
        try:
            if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
                return True
        except AttributeError:  # a module whose __init__ skipped nn.Module's: the ones it has
            names = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
            if any(getattr(m, name, None) for name in names):
                return True
    return bool(global_module_hook_ids("torch_nbdebug") - set(own))


def register_global_forward_hook(hook: Callable[..., Any], *, with_kwargs: bool = False,
                                 always_call: bool = False) -> Any:
    """``torch.nn.modules.module.register_module_forward_hook`` whose handle, once removed, leaves
    nothing behind. Torch's own handle forgets the ``with_kwargs`` flag of a removed hook, so
    ``_has_any_global_hook()`` stays true and every later ``torch.compile(module)`` call warns of global
    hooks that are long gone."""
    from torch.nn.modules import module as modules

    handle = modules.register_module_forward_hook(hook, with_kwargs=with_kwargs, always_call=always_call)
    flags = getattr(modules, "_global_forward_hooks_with_kwargs", None)
    if with_kwargs and isinstance(flags, dict):
        handle.extra_dict_ref = (*handle.extra_dict_ref, weakref.ref(flags))
    return handle


def autocast_may_be_on() -> bool:
    """False when autocast is on for no device (then :func:`autocast_state` is ``()``): one flag read
    where torch has it (``_is_any_autocast_enabled``, every device type), else :func:`autocast_off`.
    nanwatch's replay asks at every module call."""
    any_on = getattr(torch._C, "_is_any_autocast_enabled", None)
    return bool(any_on()) if any_on is not None else not autocast_off()


def hooked_leaves(tensors: Iterable[torch.Tensor], own: tuple[type, ...] = ()) -> bool:
    """:func:`leaf_hooks` for many tensors: whether one has hooks of the user's. A tensor that never had a
    hook has neither dict (both None): it is passed over without a call (a model's parameters, each step)."""
    return any(leaf_hooks(t, own) for t in tensors
               if t._backward_hooks is not None or getattr(t, "_post_accumulate_grad_hooks", None) is not None)


# TorchTidy's anti-patterns (torch.profiler._pattern_matcher, private), as report_all_anti_patterns lists
# them. Each needs Python stacks or input shapes (recorded only when asked: they are what makes the
# profiler dear), which is why %%profile runs them on request (--tidy).
_ANTI_PATTERNS = ("ExtraCUDACopyPattern", "FP32MatMulPattern", "OptimizerSingleTensorPattern",
                  "SynchronizedDataLoaderPattern", "GradNotSetToNonePattern", "Conv2dBiasFollowedByBatchNorm2dPattern",
                  "MatMulDimInFP16Pattern")


class _OneTree:
    """What a TorchTidy pattern reads of a ``torch.profiler.profile``, with the event tree built once
    (each pattern would otherwise build its own: the dearest part of matching)."""

    def __init__(self, prof: Any) -> None:
        tree = prof.profiler.kineto_results.experimental_event_tree()
        self.with_stack, self.record_shapes = prof.with_stack, prof.record_shapes
        self.profiler = types.SimpleNamespace(
            kineto_results=types.SimpleNamespace(experimental_event_tree=lambda: tree))


def profiler_anti_patterns(prof: Any) -> tuple[tuple[str, str, int], ...]:
    """``(name, description, matches)`` for each TorchTidy anti-pattern found in a stopped profile;
    ``()`` where this torch has no pattern matcher."""
    try:
        matcher = importlib.import_module("torch.profiler._pattern_matcher")  # not in every torch (2.14.1)

        shared = _OneTree(prof)
    except Exception:  # noqa: BLE001 - no matcher in this torch, or no result to match: nothing to list
        return ()
    found: list[tuple[str, str, int]] = []
    for name in _ANTI_PATTERNS:
        cls = getattr(matcher, name, None)
        if cls is None:
            continue
        try:
            pattern = cls(shared, False)
            matched = pattern.matched_events()
        except Exception:  # noqa: BLE001 - one pattern that does not fit this torch is left out
            continue
        if matched:
            found.append((str(pattern.name), str(pattern.description), len(matched)))
    return tuple(found)


def profiler_running() -> bool:
    """Whether a torch.profiler (or autograd profiler) session is active in this process: a second one
    would start silently and stopping it would end the first one's session too."""
    enabled = getattr(torch._C._autograd, "_profiler_enabled", None)
    return bool(enabled()) if callable(enabled) else False


# The utility ops torch.profiler leaves out of its own tables (torch.autograd.profiler_util._filter_name).
_PROFILER_UTILITY = frozenset({"[memory]", "[OutOfMemory]", "profiler::_record_function_enter",
                               "profiler::_record_function_enter_new", "profiler::_record_function_exit",
                               "aten::is_leaf", "aten::output_nr", "aten::_version"})


def profiler_events(prof: Any) -> list[tuple[str, int, int, int, bool, bool, bool, int, int]]:
    """A stopped ``torch.profiler.profile``'s raw Kineto events, without building torch's Python
    ``FunctionEvent`` tree (most of what ``prof.events()`` and ``key_averages()`` cost): per event
    ``(name, start ns, end ns, thread, user annotation, Python function, on a device, correlation id,
    linked correlation id)``, times from the trace's start. A device kernel and a CUDA runtime call are
    linked to the op that launched them (their linked id is that op's correlation id)."""
    result = prof.profiler.kineto_results
    start = result.trace_start_ns()
    cpu = torch.autograd.DeviceType.CPU
    out = []
    for e in result.events():
        name = e.name()
        if name in _PROFILER_UTILITY or getattr(e, "is_hidden_event", lambda: False)():
            continue
        out.append((name, e.start_ns() - start, e.end_ns() - start, e.start_thread_id(), bool(e.is_user_annotation()),
                    bool(e.is_python_function()), e.device_type() != cpu, e.correlation_id(), e.linked_correlation_id()))
    return out
