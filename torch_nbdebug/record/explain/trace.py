"""Read a failure post mortem from its traceback: the user's line, the module that was running, the
operands on the failing line, and the autograd facts behind backward errors. Nothing is re-run.

Operand expressions are evaluated without calling anything: only names, attributes found in an
object's own dictionary (a module's parameters, buffers and submodules) and constant subscripts of
lists, tuples and dicts. No property, ``__getattr__`` or ``__getitem__`` of the user's runs.
"""
from __future__ import annotations

import ast
import linecache
import os
import re
import types
from collections import ChainMap
from typing import Any, Iterator, Mapping, Optional

import torch
from torch import nn

from torch_nbdebug.data.explain import FailureFacts, Operand
from torch_nbdebug.record.compat import module_registries, node_sequence_nr, tensor_version
from torch_nbdebug.record.explain.frames import (Frames, call_site, loss_facts, made_facts, made_in_forward,
                                                 module_locals, module_of, user_locals)
from torch_nbdebug.record.modules import module_roots, qualified_names
from torch_nbdebug.record.source import is_user_file, line_of

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_MISSING = object()
_BACKWARD = re.compile(r"([\w.\[\]'\"]+)\s*\.backward\(|autograd\.(?:backward|grad)\(\s*([\w.\[\]'\"]+)")
_MAX_NODES = 20_000


def frames_of(exc: BaseException) -> Frames:
    """(frame, line number) pairs of the traceback, outermost first."""
    out: Frames = []
    tb = exc.__traceback__
    while tb is not None:
        out.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return out


def failure_facts(exc: BaseException, namespace: Optional[Mapping[str, Any]] = None,
                  old_graph_before: Optional[int] = None, backward_root: Optional[torch.Tensor] = None) -> FailureFacts:
    """Everything the traceback of ``exc`` tells about where and why it failed.

    old_graph_before: autograd nodes numbered below it were made before the previous backward (from a
    recording); the nodes of that old graph nearest the failing backward's root are then named.
    backward_root: the tensor the failing ``.backward()`` was called on, when a recording saw the call.
    """
    frames = [(f, n) for f, n in frames_of(exc) if not f.f_code.co_filename.startswith(_IGNORED)]
    user = next(((f, n) for f, n in reversed(frames) if is_user_file(f.f_code.co_filename)), None)
    if namespace is None:
        namespace = _user_globals(frames)
    names = qualified_names(module_roots(namespace))
    made = module_locals(frames, names)  # modules a forward made for itself: ``model.proj``
    names.update(made)
    operands = tuple(_operands(frames, names, user))
    facts: dict[str, Any] = dict(exc_type=type(exc).__name__, message=str(exc),
                                 from_torch=_from_torch(exc, frames, user, operands), operands=operands)
    facts.update(_where_facts(frames, user, names, _lasti_of(exc, frames[-1][0]) if frames else -1))
    if _INDEX_MESSAGE.search(str(exc)) and "CUDA error" not in str(exc):  # after an assert, no kernel may run
        facts.update(_index_facts(frames, facts.get("call", "")))
    if "inplace operation" in facts["message"]:
        if not facts.get("inplace_modules"):
            facts["inplace_modules"] = _inplace_modules(module_roots(namespace), names)
        facts["param_versions"] = _param_versions(module_roots(namespace))
    facts.update(loss_facts(frames))
    if user is not None:
        facts["made_in_forward"] = made_in_forward(user[0], tuple(o.name for o in operands))
    facts.update(made_facts(frames, names, facts.get("module", ""), made, facts.get("made_in_forward", ())))
    if user is not None:
        facts.update(_backward_facts(user[0], user[1], facts.get("line", ""), namespace, old_graph_before,
                                     backward_root))
    return FailureFacts(**facts)


def _user_globals(frames: "Frames") -> Mapping[str, Any]:
    """The globals of every user frame of the traceback, the innermost first: a user's own library
    installed in development mode (not under site-packages) is user code, but the model is named in the
    notebook's globals further out."""
    spaces: list[dict[str, Any]] = []
    for frame, _ in reversed(frames):
        if is_user_file(frame.f_code.co_filename) and all(frame.f_globals is not g for g in spaces):
            spaces.append(frame.f_globals)
    return ChainMap(*spaces) if len(spaces) > 1 else spaces[0] if spaces else {}


def _where_facts(frames: Frames, user: Optional[tuple[types.FrameType, int]], names: dict[int, str],
                 tb_lasti: int = -1) -> dict[str, Any]:
    """The user's line, the call that failed, the innermost running module and the model around it.
    ``tb_lasti``: the instruction of the innermost frame that raised (-1: unknown)."""
    facts: dict[str, Any] = {}
    if user is not None:
        src = line_of(user[0].f_code.co_filename, user[1], user[0].f_code.co_name)
        facts.update(filename=src.filename, lineno=src.lineno, line=src.text)
    if frames:
        facts["call"] = _raising_call(tb_lasti, frames[-1][0]) or \
            _last_call(line_of(frames[-1][0].f_code.co_filename, frames[-1][1]).text)
        if facts["call"].endswith(("Error", "Exception")):  # ``raise ValueError(...)``: the function raising
            facts["call"] = frames[-1][0].f_code.co_name
    modules = [m for m in (module_of(f) for f, _ in frames) if m is not None]
    if modules:
        module = modules[-1]
        facts.update(module=names.get(id(module), type(module).__name__.lower()),
                     module_type=type(module).__name__, module_repr=_short_repr(module))
        facts.update(_model_facts(modules[0], frames, names))
    return facts


_INDEX_MESSAGE = re.compile(r"out of bounds|out of range|INDICES element")
_C_ERRORS = (RuntimeError, IndexError, TypeError, ValueError, NotImplementedError)


def _from_torch(exc: BaseException, frames: Frames, user: Optional[tuple[types.FrameType, int]],
                operands: tuple[Operand, ...]) -> bool:
    """Whether torch raised it: from torch's code, a torch exception type, or a torch op (C++) called on
    tensors right from the user's line (no ``raise`` there)."""
    if type(exc).__module__.startswith("torch"):
        return True
    if frames and frames[-1][0].f_code.co_filename.startswith(_TORCH_DIR):
        return True
    if user is None or not frames or frames[-1] != user or not isinstance(exc, _C_ERRORS):
        return False
    text = line_of(user[0].f_code.co_filename, user[1]).text
    return bool(operands) and not text.startswith("raise")


_IGNORED = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)  # torch_nbdebug's own


def _short_repr(module: nn.Module) -> str:
    text = f"{type(module).__name__}({module.extra_repr()})"
    return text if len(text) <= 160 else text[:157] + "..."


_OPERATORS = {ast.Add: "add", ast.Sub: "sub", ast.Mult: "mul", ast.Div: "div", ast.MatMult: "matmul",
              ast.Pow: "pow", ast.FloorDiv: "floor_divide", ast.Mod: "remainder"}


def _lasti_of(exc: BaseException, frame: types.FrameType) -> int:
    """The instruction of ``frame`` that raised ``exc`` (its traceback entry's ``tb_lasti``), or -1."""
    tb, lasti = exc.__traceback__, -1
    while tb is not None:
        if tb.tb_frame is frame:
            lasti = tb.tb_lasti
        tb = tb.tb_next
    return lasti


def _raising_call(lasti: int, frame: types.FrameType) -> str:
    """The name of the operation that raised, from the exact expression Python points at (its
    column positions, as a traceback's ``^^^^`` marks): ``a + b.to(d)`` raising in ``+`` -> ``add``
    (the line's last call would say ``to``). "" when the positions or the source are not there."""
    if lasti < 0:
        return ""
    try:
        positions = list(frame.f_code.co_positions())[lasti // 2]
    except (AttributeError, IndexError):  # (before Python 3.11: no positions)
        return ""
    start, end, col, end_col = positions
    if start is None or end is None or col is None or end_col is None:
        return ""
    lines = [linecache.getline(frame.f_code.co_filename, n).rstrip("\n").encode() for n in range(start, end + 1)]
    if not lines or not lines[-1]:
        return ""
    # (columns count UTF-8 bytes; brackets let an expression run over several lines)
    lines[0], lines[-1] = (lines[0][col:end_col], lines[0][col:end_col]) if len(lines) == 1 else \
        (lines[0][col:], lines[-1][:end_col])
    try:
        node = ast.parse("(" + b"\n".join(lines).decode(errors="replace") + "\n)", mode="eval").body
    except SyntaxError:
        return ""
    if isinstance(node, ast.BinOp):
        return _OPERATORS.get(type(node.op), "")
    if isinstance(node, ast.Call):
        func = node.func
        return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return ""


def _last_call(line: str) -> str:
    """The name of the last call on a line: ``F.linear(x, w)`` -> ``linear``; ``a @ b`` -> ``matmul``."""
    calls = re.findall(r"(\w+)\s*\(", line)
    calls = [c for c in calls if c not in {"super", "len", "int", "float", "print", "tuple", "list", "range"}]
    if calls:
        return calls[-1]
    text = line.strip()
    for prefix in ("return ", "yield "):
        text = text[len(prefix):] if text.startswith(prefix) else text
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return ""
    ops = [_OPERATORS.get(type(n.op), "") for n in ast.walk(tree) if isinstance(n, (ast.BinOp, ast.AugAssign))]
    return next((op for op in ops if op), "")


# -- operands ----------------------------------------------------------------------------------
def _operands(frames: Frames, names: dict[int, str], user: Optional[tuple[types.FrameType, int]]) -> Iterator[Operand]:
    seen: set[int] = set()
    chosen = [user] if user is not None else []  # the user's names first (``tokens``, not ``input``)
    if frames and frames[-1] not in chosen:
        chosen.append(frames[-1])
    count = 0
    for frame, lineno in chosen:
        me = module_of(frame)
        prefix = names.get(id(me), "") if me is not None else ""
        own = frame.f_code.co_varnames[0] + "." if me is not None else ""
        for expr, value in _line_values(frame, lineno):
            if isinstance(value, torch.Tensor) and id(value) not in seen and count < 8:
                seen.add(id(value))
                count += 1
                shown = prefix + expr[len(own) - 1:] if prefix and expr.startswith(own) else expr
                yield describe_tensor(shown, value)


def describe_tensor(name: str, value: torch.Tensor) -> Operand:
    """An :class:`Operand` for a tensor: shape, dtype, device, and the autograd node that made it."""
    node = value.grad_fn
    producer = type(node).__name__ if node is not None else ""
    return Operand(name=name, shape=tuple(value.shape) if value.layout == torch.strided else None,
                   dtype=str(value.dtype).replace("torch.", ""), device=str(value.device),
                   producer=producer, requires_grad=bool(value.requires_grad),
                   node_seq=node_sequence_nr(node) if node is not None else -1)


def _line_values(frame: types.FrameType, lineno: int) -> Iterator[tuple[str, Any]]:
    text = line_of(frame.f_code.co_filename, lineno).text
    for expr in operand_expressions(text):
        value = safe_eval(expr, user_locals(frame), frame.f_globals)
        if value is not _MISSING:
            yield expr, value


def operand_expressions(line: str) -> list[str]:
    """The maximal name/attribute/subscript chains a line uses as values (not as the called function)."""
    text = line.strip().rstrip(":")
    for prefix in ("return ", "yield ", "if ", "elif ", "while ", "assert "):
        if text.startswith(prefix):
            text = text[len(prefix):]
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return list(dict.fromkeys(re.findall(r"\b[A-Za-z_][\w.]*\b", text)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    funcs = {id(n.func) for n in calls}
    receivers = {id(n.func.value) for n in calls if isinstance(n.func, ast.Attribute)}  # ``h`` in ``h.flatten(1)``
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, (ast.Attribute, ast.Subscript))} - receivers
    found = [n for n in ast.walk(tree) if isinstance(n, (ast.Name, ast.Attribute, ast.Subscript))
             and id(n) not in funcs and id(n) not in inner and isinstance(getattr(n, "ctx", None), ast.Load)]
    found.sort(key=lambda n: (n.lineno, n.col_offset))
    return list(dict.fromkeys(ast.unparse(n) for n in found))


def safe_eval(expr: str, local: Mapping[str, Any], glob: Mapping[str, Any]) -> Any:
    """Evaluate a name/attribute/subscript chain without running user code; ``_MISSING`` if it cannot."""
    try:
        node = ast.parse(expr, mode="eval").body
    except SyntaxError:
        return _MISSING
    return _eval(node, local, glob)


def _eval(node: ast.AST, local: Mapping[str, Any], glob: Mapping[str, Any]) -> Any:
    if isinstance(node, ast.Name):
        value = local.get(node.id, _MISSING)
        return glob.get(node.id, _MISSING) if value is _MISSING else value
    if isinstance(node, ast.Attribute) and not node.attr.startswith("__"):
        base = _eval(node.value, local, glob)
        return _MISSING if base is _MISSING else _static_attr(base, node.attr)
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        base = _eval(node.value, local, glob)
        if type(base) in (list, tuple, dict):
            try:
                return base[node.slice.value]
            except (KeyError, IndexError, TypeError):
                return _MISSING
    return _MISSING


def _static_attr(obj: Any, name: str) -> Any:
    """An attribute from the object's own storage, never through a descriptor or ``__getattr__``."""
    if isinstance(obj, nn.Module):
        for store in module_registries(obj):
            if name in store:
                return store[name]
    own = getattr(obj, "__dict__", None)
    if isinstance(own, dict) and name in own:
        return own[name]
    return _MISSING


# -- model, index and backward facts -----------------------------------------------------------
def _model_facts(root: nn.Module, frames: Frames, names: dict[int, str]) -> dict[str, Any]:
    frame = next(f for f, _ in frames if module_of(f) is root)
    varnames = frame.f_code.co_varnames[1:frame.f_code.co_argcount]
    first = user_locals(frame).get(varnames[0]) if varnames else None
    shape = tuple(first.shape) if isinstance(first, torch.Tensor) else None
    has_conv = any(isinstance(m, nn.modules.conv._ConvNd) for m in root.modules())
    inplace = _inplace_modules([("", root)], names)
    return {"model_input": shape, "model_has_conv": has_conv, "inplace_modules": inplace}


def _param_versions(roots: list[tuple[str, nn.Module]]) -> tuple[tuple[str, tuple[int, ...], int], ...]:
    """The parameters modified in place (an optimizer's step), by name, with shape and version counter."""
    found = [(f"{root}.{name}", tuple(p.shape), tensor_version(p)) for root, module in roots
             for name, p in module.named_parameters()]
    return tuple(f for f in found if f[2] > 0)[:512]


def _inplace_modules(roots: list[tuple[str, nn.Module]], names: dict[int, str]) -> tuple[str, ...]:
    """Modules that modify their input in place (``nn.ReLU(inplace=True)``...), by qualified name."""
    found = dict.fromkeys(names.get(id(m), type(m).__name__.lower()) for _, root in roots for m in root.modules()
                          if getattr(m, "inplace", False) is True)
    return tuple(found)[:8]


def _index_facts(frames: Frames, call: str) -> dict[str, Any]:
    """The out-of-range value and the size it had to stay below, from the failing frame's tensors."""
    if not frames:
        return {}
    local = user_locals(frames[-1][0])
    tensors = [v for v in local.values() if isinstance(v, torch.Tensor) and v.layout == torch.strided]
    index = next((t for t in tensors if not t.is_floating_point() and t.dtype != torch.bool and t.numel()), None)
    data = next((t for t in tensors if t.is_floating_point() and t.dim() > 0), None)
    if index is None or data is None or index.device.type == "meta":
        return {}
    size = data.shape[1] if call in {"cross_entropy", "cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d"} and data.dim() > 1 else data.shape[0]
    bad = index[(index < 0) | (index >= size)]  # an integer index: no autograd, no grad-mode switch needed
    if bad.numel() == 0:
        return {}
    return {"index_value": int(bad.flatten()[0].item()), "index_size": int(size)}


def _frozen(module: nn.Module) -> bool:
    """Whether a module has parameters and none of them requires grad."""
    params = list(module.parameters())
    return bool(params) and not any(p.requires_grad for p in params)


def _backward_facts(frame: types.FrameType, line_number: int, line: str, namespace: Mapping[str, Any],
                    old_graph_before: Optional[int], known_root: Optional[torch.Tensor]) -> dict[str, Any]:
    match = _BACKWARD.search(line)
    if match is None:
        return {}
    expr = match.group(1) or match.group(2)
    root = known_root if known_root is not None else safe_eval(expr, user_locals(frame), frame.f_globals)
    facts: dict[str, Any] = {"backward_of": expr}
    roots = module_roots(namespace)
    frozen = tuple(name for name, m in roots if _frozen(m))
    facts["frozen_models"] = frozen[:8]
    parts = tuple(f"{name}.{sub}" for name, m in roots if name not in frozen
                  for sub, child in m.named_children() if _frozen(child))  # a frozen backbone of a model
    facts["frozen_call"] = call_site(frame, line_number, (frozen + parts)[:32])
    if isinstance(root, torch.Tensor) and root.grad_fn is not None and old_graph_before is not None:
        old = old_graph_nodes(root.grad_fn, old_graph_before)
        facts["freed_nodes"] = tuple((type(n).__name__, node_sequence_nr(n)) for n, _ in old)[:16]
        facts["freed_users"] = tuple(user for _, user in old)[:16]
        facts["freed_root"] = bool(old) and old[0][0] is root.grad_fn  # the same graph a second time
    return facts


def old_graph_nodes(root: Any, before: int) -> list[tuple[Any, int]]:
    """The nodes numbered below ``before`` nearest ``root``, where its graph enters an older one, each
    with the sequence number of the newer node that reached it (-1 for the root itself)."""
    found: list[tuple[Any, int]] = []
    seen = {id(root)}
    todo = [(root, -1)]
    while todo and len(seen) < _MAX_NODES:
        node, user = todo.pop()
        if node_sequence_nr(node) < before and type(node).__name__ != "AccumulateGrad":
            found.append((node, user))
            continue
        for child, _ in getattr(node, "next_functions", ()):
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                todo.append((child, node_sequence_nr(node)))
    found.sort(key=lambda pair: node_sequence_nr(pair[0]), reverse=True)
    return found
