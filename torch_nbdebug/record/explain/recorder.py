"""The light recorder behind ``%%explain``: where autograd nodes were made, in-place ops, cut chains.

One ``TorchFunctionMode`` (Python-level torch calls only: autograd's backward and the ATen ops below a
call never reach it) plus the global module hooks of :class:`ModuleTracker`. For each call it keeps
ints and short strings: the sequence number of the autograd node an op made, with the user's line
and module (to name the line that made a graph later reused, or the op that saved a tensor); in-place
ops with their target's version (to name the op that modified a saved tensor); and the places where
a tensor that required grad gave one that does not (``no_grad``, ``.detach()``, ``.data``, ``.item()``).

No ``saved_tensors_hooks``: they switch off autograd's "modified by an inplace operation" check, and
the user must get the same error they would get without us. No tensor is kept.
"""
from __future__ import annotations

import bisect
import sys
import weakref
from typing import Any, Callable, Mapping, Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode

from torch_nbdebug.data.explain import CutEvent, InplaceEvent, OpSite, OptimizerStep, Recording
from torch_nbdebug.record.compat import (view_base, function_mode_at, function_stack_len, next_sequence_nr, node_sequence_nr,
                                         pop_function_mode, push_function_mode, tensor_version)
from torch_nbdebug.record.explain.indices import check_index_arguments
from torch_nbdebug.record.lifecycle import HookScope
from torch_nbdebug.record.modules import ModuleTracker
from torch_nbdebug.record.source import is_user_code, line_of

_MAX_SITES = 100_000  # spans of about 200 bytes: at most ~20 MB; the oldest half is dropped past it
_MAX_INPLACE = 10_000
_CUTS = {"detach": "detach", "item": "item", "numpy": "numpy", "tolist": "tolist", "__get__": "data",
         "tensor": "tensor"}  # torch.tensor(t): a copy with no history
_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__",
                    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__ifloordiv__"}
_Where = tuple[str, int]
_INF = float("inf")


def _call_kind(func: Callable[..., Any]) -> tuple[str, str]:
    """``(kind, name)`` of a torch callable: 'inplace', a cut kind from ``_CUTS``, or 'op'."""
    name = getattr(func, "__name__", "") or str(func)
    if name == "__get__":  # a property: ``.data`` cuts the chain; ``.shape``, ``.grad``... are plain reads
        prop = getattr(getattr(func, "__self__", None), "__name__", "") or "attribute"
        return ("data" if prop == "data" else "skip"), prop
    if name in _CUTS:
        return _CUTS[name], name
    if name == "backward":
        return "backward", name
    if name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("_")):
        return "inplace", name
    return "op", name


def _outside_forward(frame: Optional[Any]) -> Optional[Any]:
    """The first user frame that is not a module's ``forward``: the line that called the model."""
    while frame is not None and (not is_user_code(frame.f_code) or frame.f_code.co_name == "forward"):
        frame = frame.f_back
    return frame


def _user_where(frame: Optional[Any]) -> _Where:
    while frame is not None:
        if is_user_code(frame.f_code):
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
    return "", 0


class _ExplainMode(TorchFunctionMode):
    """Sees each Python-level torch call once; the common path (an out-of-place op) costs two reads of
    the autograd sequence counter and, when the op made autograd nodes, one span appended."""

    def __init__(self, recorder: "ExplainRecorder") -> None:
        super().__init__()
        self.recorder = recorder
        self.kinds: dict[Any, tuple[str, str]] = {}

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the user's traceback
        if kwargs is None:
            kwargs = {}
        rec = self.recorder
        kind = self.kinds.get(func)
        if kind is None:
            kind = self.kinds[func] = _call_kind(func)
        if kind[0] == "skip" or rec.paused:  # property reads, optimizer steps: nothing to record
            return func(*args, **kwargs)
        if rec.check_indices:
            check_index_arguments(func, args, kwargs)
        if kind[0] == "op" and kwargs.get("inplace") is not True:
            start = next_sequence_nr()
            out = func(*args, **kwargs)
            end = next_sequence_nr()
            if end != start:  # the call made autograd nodes start..end-1
                rec.made(start, end, kind[1], sys._getframe(1))
            elif not torch.is_grad_enabled():
                rec.maybe_no_grad_cut(kind[1], args, sys._getframe(1))
            return out
        return self._special(func, kind, args, kwargs)

    def _special(self, func: Any, kind: tuple[str, str], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the user's traceback
        rec = self.recorder
        if kind[0] in ("inplace", "op"):  # an in-place op, or F.relu(x, inplace=True)
            name = kind[1] if kind[0] == "inplace" else f"{kind[1]}(inplace=True)"
            return rec.inplace_call(func, name, args, kwargs, sys._getframe(2))
        if kind[0] == "backward":
            rec.backward_called(args, sys._getframe(2))
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        source = args[0] if args else None
        if kind[0] == "tensor" and isinstance(source, (list, tuple)):  # torch.tensor([a, b]) of 0-d tensors
            source = next((t for t in source if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if isinstance(source, torch.Tensor) and source.requires_grad:
            rec.cut(kind[0], kind[1], sys._getframe(2))
        return out


class ExplainRecorder:
    """Record where autograd nodes were made, in-place ops and cut chains; ``start``/``stop`` own it all."""

    def __init__(self, namespace: Optional[Mapping[str, Any]] = None, *, check_indices: bool = False) -> None:
        self.check_indices = check_indices
        self.tracker = ModuleTracker(namespace, on_enter=self._entered, on_exit=self._left)
        self._mode: Optional[_ExplainMode] = None
        # (first, last + 1 node sequence number, op, module, where, outer): what each call made, in order;
        # outer: the user's line outside every forward that led to it (the line that called the model)
        self.spans: list[tuple[int, int, str, str, _Where, _Where]] = []
        self._outer: _Where = ("", 0)  # while a model's forward runs: the line that called it
        self._start_seq = 0  # nodes numbered below it were made before the recording began
        self.inplace: list[tuple[str, str, _Where, int, tuple[int, ...], str, int]] = []
        self.cuts: list[tuple[str, str, str, _Where]] = []
        self._cut_lines: set[tuple[str, _Where]] = set()
        self.backward_marks: list[int] = []  # the next node sequence number at each .backward() call
        self.backward_sites: list[_Where] = []  # the user's line of each .backward() call
        self._roots: list[Optional["weakref.ref[torch.Tensor]"]] = []  # the last two backward roots, weakly
        self.paused = False  # inside optimizer.step()
        self._popped = False  # the mode is off the stack for an optimizer step
        self._scope = HookScope()
        self.steps: list[tuple[str, _Where, tuple[tuple[int, ...], ...]]] = []

    def start(self) -> None:
        self._scope.open(self._install)

    def _install(self, scope: HookScope) -> None:
        self._start_seq = next_sequence_nr()
        scope.enter(self.tracker)
        scope.hook(register_optimizer_step_pre_hook(self._pre_step))
        scope.hook(register_optimizer_step_post_hook(self._post_step))
        scope.callback(self._end_pause)
        mode = _ExplainMode(self)
        mode.__enter__()
        self._mode = mode  # only once it is on the stack: the undo takes off nothing it did not push
        scope.callback(self._exit_mode)

    def stop(self) -> None:
        self._scope.close()

    def _exit_mode(self) -> None:
        mode, popped, self._mode, self._popped = self._mode, self._popped, None, False
        if mode is not None and not popped:  # popped: a step raised, it is off the stack already
            mode.__exit__(None, None, None)

    def _end_pause(self) -> None:
        self.paused = False

    # -- optimizer steps: not recorded op by op (their in-place updates run under no_grad) -----------
    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Step without the mode: an optimizer makes hundreds of torch calls a mode would slow down."""
        self.paused = True
        depth = function_stack_len()
        if self._mode is not None and depth and function_mode_at(depth - 1) is self._mode:
            pop_function_mode()
            self._popped = True

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._popped:
            push_function_mode(self._mode)
            self._popped = False
        self.paused = False
        shapes = {tuple(p.shape) for group in optimizer.param_groups for p in group["params"]}
        where = _user_where(sys._getframe(1))
        self.steps.append((f"{type(optimizer).__name__}.step", where, tuple(sorted(shapes))[:256]))
        if len(self.steps) > 1000:
            del self.steps[:500]

    # -- module boundaries (the tracker's callbacks) --------------------------------------------
    def _entered(self, path: str, module: Any) -> None:
        if len(self.tracker.stack) == 1:  # a model called from user code: once per call, not per op
            self._outer = _user_where(_outside_forward(sys._getframe(1)))

    def _left(self, path: str, module: Any, output: Any) -> None:
        if not self.tracker.stack:
            self._outer = ("", 0)

    # -- called by the mode ------------------------------------------------------------------
    def made(self, start: int, end: int, name: str, frame: Any) -> None:
        stack = self.tracker.stack
        where = _user_where(frame)
        self.spans.append((start, end, name, stack[-1] if stack else "", where,
                           self._outer if stack and self._outer[1] else where))
        if len(self.spans) > _MAX_SITES:
            del self.spans[: _MAX_SITES // 2]

    def maybe_no_grad_cut(self, name: str, args: tuple[Any, ...], frame: Any) -> None:
        """An op under no_grad that got a tensor requiring grad: the chain is cut here (the optimizer's
        own no_grad updates are not cuts)."""
        if "torch/optim/" in frame.f_code.co_filename.replace("\\", "/"):
            return
        if any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            self.cut("no_grad", name, _outside_forward(frame), outer=True)

    def site_of(self, seq: int) -> Optional[tuple[str, str, _Where, _Where]]:
        """Where the autograd node numbered ``seq`` was made: (op, module, (filename, lineno), and the
        line outside every forward that led to it)."""
        i = bisect.bisect_right(self.spans, (seq, _INF)) - 1
        if i >= 0 and self.spans[i][0] <= seq < self.spans[i][1]:
            return self.spans[i][2], self.spans[i][3], self.spans[i][4], self.spans[i][5]
        return None

    def inplace_call(self, func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], frame: Any) -> Any:
        __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the user's traceback
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if target is None or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        node = target.grad_fn
        base = view_base(target)
        if base is not None and base.grad_fn is not None:
            node = base.grad_fn
        # A tensor outside autograd that gets a value requiring grad (``h[:, t] = out`` into zeros) is
        # recorded too: a later op may save a view of it, and the next assignment is then the culprit.
        grows = node is None and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args[1:])
        out = func(*args, **kwargs)
        if node is not None or grows:
            where = _user_where(frame)
            self.inplace.append((name, self.tracker.current or "", where, tensor_version(target),
                                 tuple(target.shape), type(node).__name__ if node is not None else "",
                                 node_sequence_nr(node) if node is not None else -1))
            if len(self.inplace) > _MAX_INPLACE:
                del self.inplace[: _MAX_INPLACE // 2]
        return out

    def cut(self, how: str, name: str, frame: Any, outer: bool = False) -> None:
        where = _user_where(frame)
        if (how, where) not in self._cut_lines:  # one event per line and kind (loops repeat them)
            self._cut_lines.add((how, where))
            stack = self.tracker.stack
            module = (stack[0] if outer else stack[-1]) if stack else ""
            self.cuts.append((how, f"{name} under no_grad" if how == "no_grad" else name, module, where))

    def backward_called(self, args: tuple[Any, ...], frame: Any) -> None:
        self.backward_marks.append(next_sequence_nr())
        self.backward_sites.append(_user_where(frame))
        if len(self.backward_marks) > 1000:
            del self.backward_marks[:500], self.backward_sites[:500]
        root = args[0] if args and isinstance(args[0], torch.Tensor) else None
        self._roots = [*self._roots[-1:], weakref.ref(root) if root is not None else None]

    def backward_root(self) -> Optional[torch.Tensor]:
        """The tensor the last ``.backward()`` was called on, if it is still alive (held weakly)."""
        return self._roots[-1]() if self._roots and self._roots[-1] is not None else None

    def repeated_root(self) -> bool:
        """Whether the last two ``.backward()`` calls were on the same tensor (else: two losses)."""
        if len(self._roots) < 2 or self._roots[0] is None or self._roots[1] is None:
            return False
        return self._roots[0]() is not None and self._roots[0]() is self._roots[1]()

    def old_graph_before(self) -> Optional[int]:
        """Nodes numbered below this were made before the previous ``.backward()`` -- or, when the failing
        one is the first this recording saw, before the recording began (None: no backward seen)."""
        if len(self.backward_marks) >= 2:
            return self.backward_marks[-2]
        return self._start_seq if self.backward_marks else None

    # -- results -------------------------------------------------------------------------------
    def recording(self, wanted_seqs: tuple[int, ...] = ()) -> Recording:
        """The events as data; ``wanted_seqs``: the nodes whose sites the diagnosis asks for."""
        inplace = tuple(InplaceEvent(site=_site(name, module, where), version=version, shape=shape,
                                     node=node, node_seq=seq)
                        for name, module, where, version, shape, node, seq in self.inplace[-500:])
        seqs = set(wanted_seqs) | {e.node_seq for e in inplace}
        found = [(seq, self.site_of(seq)) for seq in sorted(seqs) if seq >= 0]
        sites = tuple((seq, _site(*where[:3])) for seq, where in found if where is not None)
        outer = tuple((seq, _site("", "", where[3])) for seq, where in found
                      if where is not None and where[3] != where[2])
        backwards = tuple(_site("backward", "", where) for where in self.backward_sites[-2:])
        cuts = tuple(CutEvent(how=how, site=_site(name, module, where))  # type: ignore[arg-type]
                     for how, name, module, where in self.cuts[-100:])
        steps = tuple(OptimizerStep(site=_site(op, "", where), shapes=shapes) for op, where, shapes in self.steps[-20:])
        return Recording(inplace=inplace, cuts=cuts, sites=sites, steps=steps, outer=outer, backwards=backwards,
                         repeated_root=self.repeated_root())

    def clear(self) -> None:
        self.spans.clear()
        self.inplace.clear()
        self.cuts.clear()
        self._cut_lines.clear()
        self.backward_marks.clear()
        self.backward_sites.clear()
        self.steps.clear()
        self._roots = []


def _site(op: str, module: str, where: Any) -> OpSite:
    filename, lineno = where
    text = line_of(filename, lineno).text if filename else ""
    return OpSite(op=op, module=module, filename=filename, lineno=lineno, line=text)
