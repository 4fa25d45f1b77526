"""``%cudamem`` (memory now) and ``%%cudamem`` (run the cell, show its memory timeline)."""
from __future__ import annotations

from typing import Any, Optional

from IPython.core.error import UsageError
from IPython.core.magic import line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display

from torch_nbdebug.errors import InputError
from torch_nbdebug.magics._common import CellBody, ToolMagics, live_view, parse_args, tensorboard_dir, write_tensorboard
from torch_nbdebug.magics._live import MemoryProgress


@magics_class
class MemoryMagics(ToolMagics):
    @magic_arguments()
    @argument("-o", "--output", action="store_true",
              help="return the MemoryState / MemoryTimeline object (like %%timeit -o)")
    @argument("--device", default=None,
              help="cpu or cuda (default: cuda when available, else the CPU tensors with a note)")
    @argument("--tensorboard", default=None, metavar="DIR",
              help="cell magic (%%%%cudamem) only: also write the timeline (bytes by category) as TensorBoard "
                   "event files to DIR")
    @argument("--top", type=int, default=10, help="how many of the largest tensors/allocations to list")
    @argument("--export", default=None, metavar="FILE.pickle",
              help="cell magic (%%%%cudamem) only: write a snapshot that PyTorch's memory viewer "
                   "(pytorch.org/memory_viz) opens; on CPU the same format PyTorch uses for CPU profiles")
    @argument("--no-lines", action="store_true", help="cell magic (%%%%cudamem) only: skip recording source lines (faster)")
    @line_cell_magic
    def cudamem(self, line: str, cell: Optional[str] = None) -> Any:
        """Memory by category: parameters, gradients, optimizer state, activations, temporaries, other.

        %cudamem           the state now: bytes by category, largest tensors named by their holder
        %%cudamem          run the cell; show its memory timeline, the peak and any leaked tensors
        """
        __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the user's traceback
        from torch_nbdebug.api.memory import memory_state, memory_timeline, write_snapshot

        args = parse_args(self.cudamem, line)
        if args.top < 0:
            raise UsageError(f"--top {args.top}: pass a positive count, e.g. --top 10")
        try:
            if cell is None or not cell.strip():
                if args.export or args.tensorboard:
                    raise UsageError("--export and --tensorboard need a cell to record: use them on %%cudamem, e.g. %%cudamem --tensorboard runs")
                result = memory_state(self.user_ns, device=args.device, top=args.top)
                return result if args.output else display(result)
            logdir = tensorboard_dir(args.tensorboard, "%%cudamem")
            body = CellBody(self.shell, cell, "cudamem")  # a bad cell is a UsageError before recording
            scope = memory_timeline(self.user_ns, device=args.device, top=args.top,
                                    record_lines=not args.no_lines)
        except InputError as exc:
            raise UsageError(str(exc)) from None
        tl, finished, progress = None, False, MemoryProgress(scope)
        with live_view(self.shell, "%%cudamem", progress, display,
                       enabled=not args.output) as live:  # -o returns the timeline instead of showing it
            try:
                with scope as tl:
                    progress.follow_forward(live)  # an evaluation loop makes no optimizer step
                    body.run()  # like %%timeit: the timeline is shown, not the cell's value
                finished = True
            finally:
                # With -o the returned timeline is the cell's output; if the cell raised, show it here.
                if tl is not None and len(tl.steps) and not (finished and args.output):
                    live.show(tl)
        write_tensorboard(tl, logdir)
        if args.export:
            try:
                path = write_snapshot(tl, args.export)
            except InputError as exc:
                raise UsageError(str(exc)) from None
            print(f"snapshot written to {path}: open it at https://pytorch.org/memory_viz")
        return tl if args.output else None


MAGICS = MemoryMagics
