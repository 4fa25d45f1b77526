"""``%%repro``: run the cell twice from the same state and say whether, where and why the runs differ."""
from __future__ import annotations

from functools import partial
from typing import Any, Optional

from IPython.core.magic import line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display

from torch_nbdebug.api.repro import ReproReport, last_report, run_twice
from torch_nbdebug.errors import InputError
from torch_nbdebug.magics._common import (CellBody, ToolMagics, keep_report, parse_args, report_options,
                                          require_body, run_body, show_last, usage_errors)


@magics_class
class ReproMagics(ToolMagics):
    @magic_arguments()
    @argument("--no-restore-rng", action="store_true",
              help="do not restore the random generators before the second run (find unseeded randomness)")
    @report_options("the report object", "the report", "_repro")
    @line_cell_magic
    def repro(self, line: str, cell: Optional[str] = None) -> Any:
        """Run the cell twice from the same starting state and report whether the two runs agree.

        Before each run the state is restored: the modules, optimizers, LR schedulers, GradScalers,
        tensors, torch.Generators and DataLoaders in the namespace (parameters, buffers, gradients,
        optimizer state), the names the cell rebinds, and the random generators (torch CPU and CUDA,
        NumPy, Python's random) unless --no-restore-rng. Afterwards the state is as if the cell had
        run once: an optimizer stepped in the cell has stepped once per step. Side effects outside
        torch (prints, files, appends to Python lists) happen twice.

        If the runs differ, the report names the first op whose output differs although its inputs
        agreed (or whose input came from outside torch): op, module, line, phase, size of the
        difference, and the cause - rng, uninitialized, external, nondeterministic_op or unknown -
        with the fix, the ops PyTorch lists as nondeterministic on the device, and a preflight of the
        determinism settings. Stored as _repro; %repro alone shows the last report again.

        Python twin:  torch_nbdebug.repro(fn, state=(model, opt), restore_rng=True)
        """
        __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the user's traceback
        args = parse_args(self.repro, line)
        if cell is None:
            return self._show_last(args)
        # syntax, an empty cell and a top-level await are checked before anything runs (compiled once)
        body = CellBody(self.shell, require_body(cell, "repro"), "repro")
        failed, previous = True, last_report()
        report: Optional[ReproReport] = None
        try:
            report, value = run_twice(partial(run_body, self.shell, body), restore_rng=not args.no_restore_rng,
                                      namespace=self.user_ns)
            failed = False
        except InputError as exc:
            raise usage_errors(exc) from None
        finally:
            report = report or last_report()
            if report is not None and report is not previous:
                keep_report(self.shell, "_repro", report, args, failed, display)
        if value is not None:
            display(value)
        return report if args.return_report else None

    def _show_last(self, args: Any) -> Any:
        return show_last(last_report(), args, "repro", "run that cell twice and compare", display)


MAGICS = ReproMagics
