"""``%%explain``: run a cell and explain its PyTorch error; ``%explain``: explain the last one."""
from __future__ import annotations

import sys
from typing import Any, Optional

from IPython.core.error import UsageError
from IPython.core.magic import line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display

from torch_nbdebug.api.explain import Diagnosis, explain, explain_exception
from torch_nbdebug.magics import explain_hook
from torch_nbdebug.magics._common import ToolMagics, parse_args, report_options, require_body, run_body


# (id of the exception, its diagnosis) of the last %%explain run that failed: %explain shows that one
_recorded: tuple[int, Optional[Diagnosis]] = (0, None)


@magics_class
class ExplainMagics(ToolMagics):
    @magic_arguments()
    @argument("--check-indices", action="store_true",
              help="check index arguments (embedding ids, class targets, gather/index_select indices) before "
                   "each op runs: an out-of-range index stops at its line with its value, before a CUDA "
                   "device-side assert")
    @argument("--auto", choices=("on", "off"),
              help="turn the automatic one-paragraph explanation under every PyTorch traceback on or off")
    @report_options("the diagnosis", "the explanation", "_explain", dest="return_diagnosis")
    @line_cell_magic
    def explain(self, line: str, cell: Optional[str] = None) -> Any:
        """Explain a PyTorch error: which op, module and line, the culprit, the operands and the fix.

        %%explain             on the first line of a cell: run it with a light recorder; if it
                              raises, the explanation card is shown under the traceback and your
                              exception is re-raised unchanged
        %explain              on its own line: explain the last exception post mortem (like
                              %debug; nothing is re-run)
        %explain --auto off   stop the automatic paragraph under PyTorch tracebacks

        Python twins:  with torch_nbdebug.explain() as ex: ...
                       torch_nbdebug.explain_exception(exc)
        """
        __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the user's traceback
        args = parse_args(self.explain, line)
        if args.auto is not None:
            return self._set_auto(args.auto == "on", cell)
        if cell is None:
            if args.check_indices:
                raise UsageError("--check-indices needs a cell to run: put `%%explain --check-indices` (two %) "
                                 "on the first line of the cell that failed")
            return self._post_mortem(args)
        body = require_body(cell, "explain")
        scope = explain(check_indices=args.check_indices, namespace=self.user_ns)
        try:
            with scope:
                value = run_body(self.shell, body)
        except Exception as exc:
            self._show_failure(exc, scope.result.diagnosis, args.quiet)
            raise
        self.user_ns["_explain"] = None
        if scope.result.note and not args.quiet:
            print(f"%%explain: {scope.result.note}")
        if value is not None:
            display(value)
        return None

    def _show_failure(self, exc: BaseException, diagnosis: Optional[Diagnosis], quiet: bool) -> None:
        global _recorded
        self.user_ns["_explain"] = diagnosis
        _recorded = (id(exc), diagnosis)
        shown = None if quiet else diagnosis
        if explain_hook.active(self.shell) is not None:
            explain_hook.queue_card(exc, shown)  # shown under the traceback
        elif shown is not None:
            display(shown)

    def _post_mortem(self, args: Any) -> Any:
        exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
        if exc is None:
            raise UsageError("%explain: no exception yet. Run the failing cell first (or put %%explain, two %, "
                             "on its first line to run it with the recorder)")
        if _recorded[0] == id(exc) and _recorded[1] is not None:
            diagnosis: Optional[Diagnosis] = _recorded[1]  # a %%explain run recorded it: keep the culprit
        else:
            diagnosis = explain_exception(exc, namespace=self.user_ns)
        self.user_ns["_explain"] = diagnosis
        if diagnosis is None:
            print(f"%explain: the last exception ({type(exc).__name__}) is not a PyTorch error; nothing to add")
            return None
        if args.return_diagnosis:
            return diagnosis
        if not args.quiet:
            display(diagnosis)
        return None

    def _set_auto(self, on: bool, cell: Optional[str]) -> None:
        if cell is not None:
            raise UsageError("%explain --auto on|off is a line magic: write it on a line of its own")
        auto = explain_hook.active(self.shell)
        if auto is None:
            auto = explain_hook.install(self.shell)
        auto.enabled = on
        print(f"torch_nbdebug: automatic explanations {'on' if on else 'off'}")


def load(shell: Any) -> None:
    """Install the automatic explanation (``%load_ext torch_nbdebug``)."""
    explain_hook.install(shell)


def unload(shell: Any) -> None:
    """Remove it and restore the previous custom exception handler (``%unload_ext``)."""
    explain_hook.uninstall(shell)


MAGICS = ExplainMagics
