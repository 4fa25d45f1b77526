"""The frames of a finished traceback, read without running user code: a frame's locals, the module
whose ``forward`` a frame runs, the modules a ``forward`` made for itself, and the loss an error came
through. Shared by :mod:`torch_nbdebug.record.explain.trace`."""
from __future__ import annotations

import inspect
import os
import re
import sys
import types
from typing import Any, Mapping, Optional

import torch
from torch import nn

from torch_nbdebug.data.explain import OpSite
from torch_nbdebug.record.source import frame_locals, line_of

Frames = list[tuple[types.FrameType, int]]
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def user_locals(frame: types.FrameType) -> Mapping[str, Any]:
    """A frame's locals: the real objects, so operands are told apart by identity.

    A function frame that is still running (the ``with explain()`` block's, the cell's caller) is read
    with :func:`frame_locals`: up to Python 3.12 a plain ``f_locals`` read would attach a snapshot
    to the frame that keeps every local alive until the function returns, even after the user deletes
    it; the copy returned lives only as long as the scan using it. Finished frames (the traceback
    below the handler) and module-level code (a notebook cell, whose locals are its globals) are read
    directly.
    """
    if not frame.f_code.co_flags & inspect.CO_OPTIMIZED:
        return frame.f_locals
    running: Optional[types.FrameType] = sys._getframe(1)
    while running is not None:
        if running is frame:
            local = frame_locals(frame)
            return {} if local is None else local
        running = running.f_back
    return frame.f_locals


def module_of(frame: types.FrameType) -> Optional[nn.Module]:
    """The module whose ``forward`` this frame runs (its first argument, whatever it is called)."""
    code = frame.f_code
    if code.co_name != "forward" or code.co_argcount == 0:
        return None
    me = user_locals(frame).get(code.co_varnames[0])
    return me if isinstance(me, nn.Module) else None


def assignment_site(frames: Frames, names: dict[int, str], var: str, owner: str = "") -> Optional[OpSite]:
    """Where a module's ``forward`` in the traceback assigned ``var`` (the innermost such forward): the line
    that made a module or tensor for itself, read from the source above the line that was running. With
    ``owner`` (a module's name), ``var`` is an attribute its forward assigned (``self.head = ...``)."""
    for frame, lineno in reversed(frames):
        me = module_of(frame)
        if me is None or (names.get(id(me), "") != owner if owner else var not in user_locals(frame)):
            continue
        target = f"{frame.f_code.co_varnames[0]}.{var}" if owner else var
        pattern = re.compile(rf"^\s*{re.escape(target)}\s*(?::[^=]*)?=(?!=)\s*(.*)")
        filename = frame.f_code.co_filename
        for n in range(lineno, frame.f_code.co_firstlineno, -1):
            text = line_of(filename, n).text
            match = pattern.match(text)
            if match:
                call = re.match(r"([\w.]+)\s*\(", match.group(1))
                return OpSite(op=call.group(1) if call else "", module=names.get(id(me), ""), filename=filename,
                              lineno=n, line=text)
        return None
    return None


def call_site(frame: types.FrameType, lineno: int, callees: tuple[str, ...]) -> Optional[OpSite]:
    """The nearest line at or above ``lineno`` in ``frame``'s code that calls one of ``callees``
    (``net(x)``, ``model.backbone(x)``): where a frozen module's output entered the computation."""
    if not callees:
        return None
    pattern = re.compile(r"(?<![\w.])(" + "|".join(re.escape(c) for c in callees) + r")\s*\(")
    filename = frame.f_code.co_filename
    for n in range(lineno, max(frame.f_code.co_firstlineno, 1) - 1, -1):
        text = line_of(filename, n).text
        match = pattern.search(text)
        if match and not text.lstrip().startswith(("#", "for ", "def ")):
            return OpSite(op=match.group(1), module=match.group(1), filename=filename, lineno=n, line=text)
    return None


def made_facts(frames: Frames, names: dict[int, str], module: str, made: dict[int, str],
                tensors: tuple[str, ...]) -> dict[str, Any]:
    """Whether the failing module was made by a forward (a local, or ``self.head = ...`` there, after
    ``model.to(device)`` ran), or an operand was: the line that made it."""
    owner, _, attr = module.rpartition(".")
    if module and module in made.values():
        return {"module_made_in_forward": True, "made_site": assignment_site(frames, names, attr)}
    site = assignment_site(frames, names, attr, owner=owner) if owner else None
    if site is not None:
        return {"module_made_in_forward": True, "made_site": site}
    return {"made_site": assignment_site(frames, names, tensors[0])} if tensors else {}


def module_locals(frames: Frames, names: dict[int, str]) -> dict[int, str]:
    """Names for the modules a ``forward`` made for itself (``proj = nn.Linear(4, 4)`` inside it, so
    ``model.to(device)`` never reached them), as the model's: ``model.proj``. Read from the local
    variables of each named module's ``forward`` frame in the traceback, outermost first."""
    found: dict[int, str] = {}
    for frame, _ in frames:
        me = module_of(frame)
        owner = names.get(id(me), found.get(id(me), "")) if me is not None else ""
        if not owner:
            continue
        for var, value in user_locals(frame).items():
            if isinstance(value, nn.Module) and value is not me and id(value) not in names:
                found.setdefault(id(value), f"{owner}.{var}")
    return found


# Losses that compare an input and a target of the same shape (not class-index losses like cross_entropy).
_SAME_SHAPE_LOSSES = frozenset({
    "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
    "binary_cross_entropy_with_logits", "soft_margin_loss", "kl_div", "poisson_nll_loss", "gaussian_nll_loss",
    "multilabel_soft_margin_loss"})


def made_in_forward(frame: types.FrameType, operand_names: tuple[str, ...]) -> tuple[str, ...]:
    """The operands a module's ``forward`` made itself from no input (``mask = torch.ones(...)``): plain
    local names, not its arguments, holding tensors outside autograd -- ``model.to(device)`` and
    ``model.double()`` never reach them."""
    me = module_of(frame)
    if me is None:
        return ()
    code = frame.f_code
    args = set(code.co_varnames[:code.co_argcount + code.co_kwonlyargcount])
    local = user_locals(frame)
    return tuple(name for name in operand_names if name.isidentifier() and name not in args
                 and isinstance(local.get(name), torch.Tensor) and local[name].grad_fn is None
                 and not local[name].requires_grad and not isinstance(local[name], nn.Parameter))


def loss_facts(frames: Frames) -> dict[str, Any]:
    """The same-shape loss of ``torch.nn.functional`` the error came through, with its input's and
    target's shapes (from that finished frame's arguments)."""
    for frame, _ in frames:
        code = frame.f_code
        if code.co_name in _SAME_SHAPE_LOSSES and code.co_filename.startswith(_TORCH_DIR):
            local = user_locals(frame)
            shapes = tuple(tuple(t.shape) for t in (local.get("input"), local.get("target"))
                           if isinstance(t, torch.Tensor))
            return {"loss": code.co_name, "loss_shapes": shapes if len(shapes) == 2 else ()}
    return {}


