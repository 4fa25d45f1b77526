"""``%grads model`` (after a backward) and ``%%grads model`` (around a training loop)."""
from __future__ import annotations

from typing import Any, Callable, Optional

from IPython.core.error import UsageError
from IPython.core.magic import line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display
from torch import nn

from torch_nbdebug.api.grads import grads as grads_snapshot
from torch_nbdebug.api.grads import record_gradients
from torch_nbdebug.errors import InputError
from torch_nbdebug.magics._common import (CellBody, ToolMagics, evaluate, live_view, parse_args, require_body,
                                          tensorboard_dir, usage_errors, write_tensorboard)
from torch_nbdebug.magics._live import GradsProgress


@magics_class
class GradsMagics(ToolMagics):
    """The gradient stepper: per-layer gradient statistics, flags and histograms."""

    @magic_arguments()
    @argument("model", help="the nn.Module whose gradients to show (a variable name or expression)")
    @argument("-l", "--layer", default=None, help="open the stepper at this layer (model.fc2, fc2 or an index)")
    @argument("-a", "--activations", action="store_true",
              help="%%grads only: also record activation statistics (mean, std, zeros) with forward hooks")
    @argument("-s", "--sample", type=int, default=4096,
              help="%%grads only: elements per parameter used for histograms and counts (default 4096)")
    @argument("-b", "--bins", type=int, default=64, help="histogram bins (default 64)")
    @argument("--tensorboard", default=None, metavar="DIR",
              help="also write the gradients as TensorBoard event files to DIR (per-layer norms per step, histograms)")
    @argument("-o", "--output", action="store_true", help="return the result object instead of only showing it")
    @line_cell_magic
    def grads(self, line: str, cell: Optional[str] = None) -> Any:
        """Show per-layer gradients of a model: norms, update ratios, vanishing/exploding/dead flags.

        %grads model      after loss.backward(): the current .grad of every parameter
        %%grads model     above a training loop: statistics at every optimizer step (or every
                          backward when no optimizer steps), with a stepper to move through them

        Python twin:  with torch_nbdebug.record_gradients(model) as trace: ...
        """
        __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the user's traceback
        args = parse_args(self.grads, line)
        model = evaluate(self.shell, args.model, "%grads")
        if not issubclass(type(model), nn.Module):  # type(): a proxy's __class__ may raise
            raise UsageError(f"%grads needs an nn.Module (your model); {args.model} is a {type(model).__name__}")
        layer = _layer_arg(args.layer)
        logdir = tensorboard_dir(args.tensorboard, "%grads")
        if cell is None:
            try:
                result = grads_snapshot(model, namespace=self.user_ns, layer=layer, bins=args.bins)
            except InputError as exc:
                raise usage_errors(exc) from None
            write_tensorboard(result, logdir)
            return _show(result, args.output)
        body = CellBody(self.shell, require_body(cell, "grads"), "grads")  # bad cells fail before recording
        try:
            recording = record_gradients(model, namespace=self.user_ns, layer=layer, bins=args.bins,
                                         sample=args.sample, activations=args.activations)
        except InputError as exc:
            raise usage_errors(exc) from None
        shown = None
        with live_view(self.shell, f"%%grads {args.model}", GradsProgress(recording), display,
                       enabled=not args.output) as live:  # -o returns the result instead of showing it
            try:
                with recording:
                    body.run()
            finally:
                # Show what was recorded even when the loop raised: the failure may be why the user looks.
                if recording.trace is not None:
                    shown = _show(recording, args.output, live.show)
        if recording.trace is not None:  # after a finished cell: a failed one re-raised above
            write_tensorboard(recording, logdir)
        return shown


def _layer_arg(value: Optional[str]) -> Any:
    if value is None:
        return None
    return int(value) if value.lstrip("-").isdigit() else value


def _show(result: Any, output: bool, show: Optional[Callable[[Any], Any]] = None) -> Any:
    if output:
        return result
    (show or display)(result)
    return None


MAGICS = GradsMagics
