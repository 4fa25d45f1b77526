"""``%%nanwatch``: run the cell and show where the first NaN/Inf was born."""
from __future__ import annotations

from typing import Any, Optional

from IPython.core.error import UsageError
from IPython.core.magic import line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display

from torch_nbdebug.api.nanwatch import NanReport, last_report, nanwatch
from torch_nbdebug.errors import InputError
from torch_nbdebug.magics._common import (CellBody, ToolMagics, keep_report, live_view, parse_args, report_options,
                                          require_body, run_body, show_last, tensorboard_dir, usage_errors, write_tensorboard)
from torch_nbdebug.magics._live import NanwatchProgress


@magics_class
class NanwatchMagics(ToolMagics):
    @magic_arguments()
    @argument("--mode", choices=("op", "module"), default="op",
              help="op (default): check every op that can create NaN/Inf and name it; "
                   "module: check only module outputs (cheaper, names the module)")
    @argument("--no-replay", action="store_true",
              help="op mode: keep the per-op watch on inside models too, instead of checking module outputs "
                   "and replaying a call that went non-finite under it (slower, same report)")
    @argument("--no-backward", action="store_true", help="do not watch the backward pass")
    @argument("--no-optimizer", action="store_true", help="do not watch optimizer.step()")
    @argument("--ignore-inf", action="store_true", help="report NaN only, not Inf")
    @argument("--raise", dest="raise_on_birth", action="store_true",
              help="stop at the first birth with NanBirthError pointing at your line (the report is still shown)")
    @argument("--max-events", type=int, default=50, help="keep at most this many births (default 50)")
    @argument("--tensorboard", default=None, metavar="DIR",
              help="also write the births as TensorBoard event files to DIR (text and a count)")
    @report_options("the report object", "the report", "_nanwatch")
    @argument("--load", default=None, metavar="DIR",
              help="line magic: show the report a script run wrote (python -m torch_nbdebug nanwatch --out DIR)")
    @line_cell_magic
    def nanwatch(self, line: str, cell: Optional[str] = None) -> Any:
        """Run the cell and report where the first NaN/Inf was born: the op, module and line of yours.

        %%nanwatch [options]   on the first line of a cell: watch forward ops, the backward pass
                               and optimizer steps while the cell runs
        %nanwatch              on a line of its own: show the last report again (-o returns it)

        The report is displayed (also when the cell raises; your exception is re-raised unchanged)
        and stored as _nanwatch.
        Python twin:  with torch_nbdebug.nanwatch(mode="op", raise_on_birth=False) as report: ...
        """
        __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the user's traceback
        args = parse_args(self.nanwatch, line)
        if cell is None:
            return self._load(args) if args.load else self._show_last(args)
        # syntax, an empty cell and a top-level await are checked before anything is watched
        body = CellBody(self.shell, require_body(cell, "nanwatch"), "nanwatch")
        logdir = tensorboard_dir(args.tensorboard, "%%nanwatch")
        try:
            watch = nanwatch(mode=args.mode, backward=not args.no_backward, optimizer=not args.no_optimizer,
                             ignore_inf=args.ignore_inf, raise_on_birth=args.raise_on_birth,
                             namespace=self.user_ns, max_events=args.max_events,
                             replay=False if args.no_replay else None)
        except InputError as exc:
            raise usage_errors(exc) from None
        report: NanReport = watch.report
        failed = True
        # The live view shows births as they come; the report replaces it (not with -q/-o: no report shown)
        with live_view(self.shell, "%%nanwatch", NanwatchProgress(watch), display,
                       enabled=not (args.quiet or args.return_report)) as live:
            try:
                with watch:
                    value = run_body(self.shell, body)
                failed = False
            finally:
                keep_report(self.shell, "_nanwatch", report, args, failed, live.show)
                if failed and logdir is not None:  # the user's exception stays the one they see
                    try:
                        write_tensorboard(report, logdir)
                    except Exception as exc:  # noqa: BLE001
                        print(f"TensorBoard export skipped: {exc}")
        if logdir is not None:
            write_tensorboard(report, logdir)
        if value is not None:
            display(value)
        return report if args.return_report else None

    def _load(self, args: Any) -> Any:
        from torch_nbdebug.api.ranks import load

        try:
            report = load(args.load)
        except (OSError, ValueError) as exc:
            raise UsageError(f"%nanwatch --load: {exc}") from None
        self.user_ns["_nanwatch"] = report
        if not args.quiet:
            display(report)
        return report if args.return_report else None

    def _show_last(self, args: Any) -> Any:
        return show_last(last_report(), args, "nanwatch", "run that cell under the watch", display)


MAGICS = NanwatchMagics
