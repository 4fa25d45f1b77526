"""``%%profile``: why is my step slow — a verdict, the statement and the module, from torch.profiler."""
from __future__ import annotations

import contextlib
from typing import Any, Optional

from IPython.core.error import UsageError
from IPython.core.magic import line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display

from torch_nbdebug.api.profile import profile
from torch_nbdebug.errors import InputError
from torch_nbdebug.magics._common import (CellBody, ToolMagics, keep_report, live_view, parse_args, report_options,
                                          show_last, tensorboard_dir, unquote, usage_errors)
from torch_nbdebug.magics._live import ProfileProgress


@magics_class
class ProfileMagics(ToolMagics):
    @magic_arguments()
    @argument("--steps", type=int, default=20,
              help="profile this many steps after the warm-up, then let the cell run on unprofiled (default 20; "
                   "0: every step)")
    @argument("--warmup", type=int, default=1, help="steps left out at the start (default 1)")
    @argument("--trace", default=None, metavar="FILE",
              help="also write the profiled steps as a Chrome/Perfetto trace to FILE (open it at ui.perfetto.dev)")
    @argument("--tensorboard", default=None, metavar="DIR",
              help="also write the time by category per step (and the trace) for TensorBoard to DIR")
    @argument("--tidy", action="store_true",
              help="also record shapes and Python stacks and list torch's TorchTidy anti-patterns (dearer)")
    @report_options("the profile", "the report", "_profile")
    @line_cell_magic
    def profile(self, line: str, cell: Optional[str] = None) -> Any:
        """Run the cell under torch.profiler and say why a step is slow.

        %%profile [--steps N] [--warmup K] [--trace FILE] [--tensorboard DIR] [-o]
            on the first line of a cell that trains: a verdict (data, host, launch, sync, compute,
            memory or balanced) with its share of the step and the fix, the time per step by category
            (data loading, forward, backward, optimizer, host syncs, Python outside torch ops), the
            statements and modules that take it
        %profile
            on a line of its own: show the last report again (-o returns it)

        Steps are the optimizer's steps (else the DataLoader's batches, else the cell is one step).
        Python twin:  with torch_nbdebug.profile() as prof: ...   then prof.verdict, prof.by_line
        """
        __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the user's traceback
        args = parse_args(self.profile, line)
        if cell is None:
            return show_last(self.user_ns.get("_profile"), args, "profile", "profile a training step", display)
        if args.steps < 0:
            raise UsageError(f"%%profile --steps {args.steps}: pass a number of steps, e.g. --steps 20 (0: all)")
        if args.warmup < 0:
            raise UsageError(f"%%profile --warmup {args.warmup}: pass a number of steps to skip, e.g. --warmup 1")
        trace = unquote(args.trace)
        if trace is not None and not trace.strip():
            raise UsageError("%%profile --trace needs a file name, e.g. --trace step.json")
        logdir = tensorboard_dir(args.tensorboard, "%%profile")
        body = CellBody(self.shell, cell, "profile")  # a bad cell is a UsageError before profiling
        try:
            prof = profile(self.user_ns, steps=args.steps or None, warmup=args.warmup, trace=trace,
                           tensorboard=logdir, tidy=args.tidy)
        except InputError as exc:
            raise usage_errors(exc) from None
        failed = True
        with live_view(self.shell, "%%profile", ProfileProgress(prof), display,
                       enabled=not (args.quiet or args.return_report)) as live:
            try:
                with contextlib.ExitStack() as scope:
                    try:
                        scope.enter_context(prof)
                    except InputError as exc:  # e.g. another torch.profiler is running: before the cell runs
                        raise usage_errors(exc) from None
                    value = body.run()
                failed = False
            finally:
                if prof._data is not None:  # the report replaces the live view
                    keep_report(self.shell, "_profile", prof, args, failed, live.show)
        if trace is not None:
            print(f"trace written to {trace}: open it at https://ui.perfetto.dev")
        if value is not None:
            display(value)
        return prof if args.return_report else None


MAGICS = ProfileMagics
