"""Python twin of ``%grads``: ``grads(model)`` after a backward, ``with record_gradients(model) as trace:``.

Both give a displayable result (text, static HTML with the flow plot and heatmap, the stepper widget)
over a plain :class:`GradTrace`. The stepper opens at ``layer=`` if given, else at the layer where the
last ``nanwatch`` report found a NaN born inside this model, else at the first flagged layer.
"""
from __future__ import annotations

import ast
import dataclasses
import linecache
from typing import Any, Mapping, Optional, Union

import torch
from torch import nn

from torch_nbdebug.data.grads import Flag, GradTrace, LayerGrads
from torch_nbdebug.errors import InputError
from torch_nbdebug.process.grads import Thresholds, layer_for_module, step_flags, trace_flags
from torch_nbdebug.record.grads import GradRecorder, LazyTrace, exact_rows, layers_of
from torch_nbdebug.record.modules import compiled_original, module_roots, qualified_names
from torch_nbdebug.record.source import caller_frame, caller_namespace, skipped_note
from torch_nbdebug.render.bundle import Displayable

__all__ = ["grads", "record_gradients", "GradTrace", "GradReport", "GradRecording", "Thresholds"]


# What a trace whose last step is made exact when first read has already: read without making it exact.
_SETTLED = frozenset({"model", "params", "step_kind", "order", "sample", "layer_index"})


class GradReport(Displayable):
    """A :class:`GradTrace` with its flags, shown as the gradient stepper."""

    _trace: GradTrace

    def __init__(self, trace: "GradTrace | LazyTrace", layer: Union[int, str, None] = None,
                 limits: Thresholds = Thresholds(), skipped: tuple[str, ...] = ()) -> None:
        self._layer_request = layer
        self._limits = limits
        self._skipped = skipped
        self._set(trace)

    def _set(self, trace: "GradTrace | LazyTrace") -> None:
        # A recording's last step may be made exact when the trace is first read (LazyTrace): until
        # then its steps, layers and parameters are those of its partial trace.
        self._later = trace if isinstance(trace, LazyTrace) else None
        self._trace = self._noted(trace.partial if isinstance(trace, LazyTrace) else trace)
        self._flags: Optional[tuple[Flag, ...]] = None  # judged when first read (the view reads them)
        # The layer to open on: an asked-for layer is checked now (a bad name is the block's error),
        # the last nanwatch birth is looked up now (a later watch must not move it); else the first
        # flagged layer, found with the flags.
        self._start: Optional[int] = _start_layer(self._trace, self._layer_request)

    def _noted(self, trace: GradTrace) -> GradTrace:
        if self._skipped:  # what the namespace held that could not be inspected, said once
            return dataclasses.replace(trace, notes=trace.notes + (skipped_note(self._skipped),))
        return trace

    @property
    def trace(self) -> GradTrace:
        """The recorded statistics. A recording's exact last step is computed when this is first read
        (from a copy of its gradients taken at the block's end: see ``record_gradients``)."""
        later = self._later
        if later is not None:
            self._trace = self._noted(later.resolve())
            self._later = None
        return self._trace

    @property
    def flags(self) -> tuple[Flag, ...]:
        """The vanishing/exploding/non-finite flags of every step (judged once, when first read)."""
        if self._flags is None:
            self._flags = trace_flags(self.trace, self._limits)
        return self._flags

    @property
    def start_layer(self) -> int:
        """The layer the stepper opens on."""
        if self._start is None:
            self._start = _first_flagged(self.trace, self.flags)
        return self._start

    # -- data access -----------------------------------------------------------------------
    @property
    def layers(self) -> tuple[str, ...]:
        """Layer names in forward order (``trace.layers`` has the full :class:`LayerInfo`)."""
        return self._trace.layer_names

    layer_names = layers  # the trace's own name for them

    @property
    def steps(self) -> tuple[int, ...]:
        return self._trace.steps

    def __getattr__(self, name: str) -> Any:
        """Everything else of the :class:`GradTrace` (``params``, ``stats``, ``to_json``...)."""
        if name.startswith("_") or name == "trace":
            raise AttributeError(name)
        if self.__dict__.get("_trace") is None:
            raise InputError("the recording is still running: use the result after the `with` block ends")
        return getattr(self._trace if name in _SETTLED else self.trace, name)

    def layer(self, layer: Union[int, str], step: int = -1) -> LayerGrads:
        """Statistics of one layer (index, ``model.fc1`` or ``fc1``) at one step (default: the last)."""
        try:
            return self.trace.layer(layer, step)
        except (KeyError, IndexError) as exc:
            raise InputError(str(exc.args[0])) from None

    def flags_at(self, step: int = -1) -> tuple[Flag, ...]:
        return step_flags(self.trace, step, self._limits)

    # -- display ---------------------------------------------------------------------------
    def text(self) -> str:
        from torch_nbdebug.render import grads as render

        return render.text(self.trace, self.flags)

    def html(self) -> str:
        from torch_nbdebug.render import grads as render

        return render.html(self.trace, self.flags, self.start_layer)

    def widget(self) -> Any:
        from torch_nbdebug.render import grads as render

        return render.widget(self.trace, self.flags, self.start_layer)

    def to_json(self) -> str:
        """The trace as the versioned JSON document a script run writes (``torch_nbdebug.load`` reads it; the
        bare trace is ``.trace.to_json()``)."""
        from torch_nbdebug.data.ranks import to_json

        return to_json("grads", self.trace.to_dict())

    def to_tensorboard(self, logdir: Any) -> str:
        """Write per-layer gradient norms and update ratios per step, and per-parameter histograms,
        as TensorBoard event files in ``logdir`` (returns it); needs
        ``pip install torch_nbdebug[tensorboard]``. See torch_nbdebug.api.tensorboard."""
        from torch_nbdebug.api.tensorboard import to_tensorboard

        return to_tensorboard(self, logdir)


class GradRecording(GradReport):
    """``with record_gradients(model) as trace:`` — filled when the block exits."""

    def __init__(self, recorder: GradRecorder, layer: Union[int, str, None], limits: Thresholds,
                 skipped: tuple[str, ...] = ()) -> None:
        self._recorder: Optional[GradRecorder] = recorder
        self._layer_request = layer
        self._limits = limits
        self._skipped = skipped
        self._trace = None  # type: ignore[assignment]  # until the block ends (``trace`` is None then)
        self._later = None

    def __enter__(self) -> "GradRecording":
        if self._recorder is None:
            raise InputError("this record_gradients(...) block was already used: call record_gradients again")
        self._recorder.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        recorder, self._recorder = self._recorder, None
        assert recorder is not None
        recorder.remove()  # first, so the hooks are gone even if summarising fails
        try:
            self._set(recorder.finish_later())
        except Exception:
            if exc[0] is None:
                raise  # otherwise the user's own exception propagates, not ours

    def __getattribute__(self, name: str) -> Any:
        if name in ("text", "html", "widget", "layer", "layers", "layer_names", "steps", "flags_at", "flags") and \
                object.__getattribute__(self, "_trace") is None:
            raise InputError("the recording is still running: use the result after the `with` block ends")
        return object.__getattribute__(self, name)


def grads(model: nn.Module, *, name: Optional[str] = None, namespace: Optional[Mapping[str, Any]] = None,
          layer: Union[int, str, None] = None, bins: int = 64, limits: Thresholds = Thresholds()) -> GradReport:
    """Snapshot of the model's current ``.grad``: call it after ``loss.backward()``.

    Every statistic covers every element (this runs once, so exactness beats speed).
    """
    name, skipped = _check_model(model, name, namespace, "grads")
    model = compiled_original(model) or model  # torch.compile's wrapper: its layers without `_orig_mod`
    _check_bins(bins)
    _, params, layers, infos, order = layers_of(model, name)
    if not any(p.grad is not None for p in params):
        raise InputError(f"{name} has no gradients yet: run loss.backward() first")
    stats, hist, rng = exact_rows(params, bins)
    import numpy as np

    trace = GradTrace(name, infos, layers, (0,), stats[None], np.ones((1, len(params)), bool), (0,), hist[None],
                      rng[None], step_kind="snapshot", order=order, sample=None)
    return GradReport(trace, layer, limits, skipped)


def record_gradients(model: nn.Module, *, name: Optional[str] = None, namespace: Optional[Mapping[str, Any]] = None,
                     sample: int = 4096, bins: int = 64, activations: bool = False, exact_last: bool = True,
                     layer: Union[int, str, None] = None, limits: Thresholds = Thresholds()) -> GradRecording:
    """Record per-layer gradient statistics at every step of the loop run inside the ``with`` block.

    A step is each ``optimizer.step()`` of an optimizer holding the model's parameters, else each
    backward pass. ``sample`` bounds the elements per parameter used for histograms and counts;
    ``activations=True`` also records output/input statistics of every layer from forward hooks.

    With ``exact_last`` (the default) the last step's statistics cover every element. They are computed
    when the recording is first read (its view, ``.trace``, ``to_json``, ``to_tensorboard``), from a copy
    of that step's gradients taken at the block's end, when that copy fits: at most 256 MiB and, on CUDA,
    a quarter of the device's free memory (on CUDA the copy is queued at the block's end, the computation
    deferred to that first read); otherwise at the block's end. A later failure there shows as a note.
    """
    name, skipped = _check_model(model, name, namespace, "record_gradients")
    _check_hookable(model, name)
    model = compiled_original(model) or model  # torch.compile's wrapper: its layers without `_orig_mod`
    if not isinstance(sample, int) or sample < 1:
        raise InputError(f"sample must be a positive number of elements per parameter, got {sample!r}")
    _check_bins(bins)
    recorder = GradRecorder(model, name, sample=sample, bins=bins, activations=activations, exact_last=exact_last)
    return GradRecording(recorder, layer, limits, skipped)


def _check_model(model: Any, name: Optional[str], namespace: Optional[Mapping[str, Any]],
                 what: str) -> tuple[str, tuple[str, ...]]:
    """The model's name and what in the namespace could not be inspected (for a note)."""
    if not issubclass(type(model), nn.Module):  # type(): a proxy's __class__ may raise
        raise InputError(f"{what} needs an nn.Module (your model); got {type(model).__name__}")
    if not any(True for _ in model.parameters()):
        raise InputError(f"{what}: this {type(model).__name__} has no parameters, so no gradients to show")
    return (name, ()) if name else _name_of(model, namespace)


def _check_hookable(model: nn.Module, name: str) -> None:
    """Recording needs forward hooks, which TorchScript modules refuse: say what works instead."""
    if isinstance(model, torch.jit.ScriptModule):
        raise InputError(
            f"record_gradients({name}): {name} is a TorchScript module (torch.jit.script or trace), which "
            f"does not allow the forward hooks recording needs. Record the original nn.Module instead: the "
            f"scripted module shares its parameters, so `with record_gradients(model): loss = {name}(x)...` "
            f"records the same gradients (%%grads model in the magic); grads({name}) after a backward works as is")


def _check_bins(bins: Any) -> None:
    if not isinstance(bins, int) or not 1 <= bins <= 1024:
        raise InputError(f"bins must be between 1 and 1024, got {bins!r}")


def _name_of(model: nn.Module, namespace: Optional[Mapping[str, Any]]) -> tuple[str, tuple[str, ...]]:
    """The user's name for the model and the names that could not be inspected: from ``namespace``
    (the magic passes the shell's), else as spelled on the caller's line (``grads(net)`` → ``net``,
    ``record_gradients(self.model)``), else from the caller's locals and globals, else ``model``."""
    if namespace is None:
        frame = caller_frame()
        spelled = _argument_text(frame) if frame is not None else None
        del frame
        if spelled is not None:
            return spelled, ()
    view = caller_namespace(namespace)
    try:
        return qualified_names(module_roots(view)).get(id(model)) or "model", view.skipped
    finally:
        if view is not namespace:
            view.release()  # keep neither the caller's frame nor its locals


def _argument_text(frame: Any) -> Optional[str]:
    """The first argument of a ``grads(...)``/``record_gradients(...)`` call on the caller's line."""
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    if line.endswith(":"):
        line += " pass"
    try:
        tree = ast.parse(line)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and _called_name(node.func) in ("grads", "record_gradients"):
            arg = node.args[0]
            if isinstance(arg, (ast.Name, ast.Attribute, ast.Subscript)):
                return ast.unparse(arg)
    return None


def _called_name(func: ast.expr) -> Optional[str]:
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else None


def _start_layer(trace: GradTrace, layer: Union[int, str, None]) -> Optional[int]:
    """The asked-for layer, else the layer of the last nanwatch birth; None: the first flagged one
    (:func:`_first_flagged`)."""
    if not trace.layers:
        return 0
    if layer is not None:
        try:
            return trace.layer_index(layer)
        except (KeyError, IndexError) as exc:
            raise InputError(str(exc.args[0])) from None
    for place in _nan_birth_places():
        born = layer_for_module(trace, place)
        if born is not None:
            return born
    return None


def _first_flagged(trace: GradTrace, flags: tuple[Flag, ...]) -> int:
    last = len(trace.steps) - 1
    flagged = [f.layer for f in flags if f.step == last and f.kind != "frozen"]
    return min(flagged) if flagged else 0


def _nan_birth_places() -> list[str]:
    """Where the last nanwatch report saw the first NaN born: its module, the forward module of a
    backward birth, the parameter of an optimizer birth (empty when there is no such report)."""
    try:
        from torch_nbdebug.api import nanwatch

        report = nanwatch.last_report()
        first = getattr(report, "first", None) if report is not None else None
        places = [getattr(first, key, None) for key in ("module", "forward_module", "param")]
        return [p for p in places if isinstance(p, str) and p]
    except Exception:  # nanwatch absent or without a report: no link, not an error
        return []
