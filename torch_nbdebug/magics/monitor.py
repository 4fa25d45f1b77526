"""``%%monitor loss, opt.param_groups[0]["lr"]``: plot values live at every optimizer step of the cell."""
from __future__ import annotations

import ast
import re
from typing import Any, Callable, Optional, TypeVar

from IPython.core.error import UsageError
from IPython.core.magic import line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import display

from torch_nbdebug.api.monitor import Monitor, Rules, monitor
from torch_nbdebug.errors import InputError
from torch_nbdebug.magics._common import (CellBody, ToolMagics, keep_report, parse_args, report_options,
                                          require_body, show_last, unquote, usage_errors)
from torch_nbdebug.render.live import LiveDisplay

# Options that take a value, and flags: the expressions after them are kept as written (quotes
# included), which argparse's shell-style splitting would not do.
_VALUED = ("--every", "--spike", "--spike-window", "--plateau", "--plateau-tol", "--vanishing", "--exploding",
           "--tensorboard")
_FLAGS = ("--no-layers", "--no-ratio", "-o", "-q", "--quiet")
_TOKEN = re.compile(r"""\s*("[^"]*"|'[^']*'|\S+)""")
_OPTION_LATE = re.compile(r"(?:^|\s)(" + "|".join(re.escape(o) for o in _VALUED + _FLAGS) + r")(?=[\s=]|$)")
# The alert rules' options: the Rules field each sets and what it does (its default is the field's).
_RULE_OPTIONS = (
    ("--spike", "spike_factor", "alert when a value exceeds this many times its running median"),
    ("--spike-window", "spike_window", "points in the running median"),
    ("--plateau", "plateau_window", "alert when the first value has not improved for this many points"),
    ("--plateau-tol", "plateau_tol", "relative improvement that counts"),
    ("--vanishing", "vanishing", "alert when a layer's gradient norm is below this"),
    ("--exploding", "exploding", "alert when a layer's gradient norm is above this"),
)
F = TypeVar("F", bound=Callable[..., Any])


def _dest(flag: str) -> str:
    """argparse's name for an option's value: ``--spike-window`` -> ``spike_window``."""
    return flag.lstrip("-").replace("-", "_")


def _rule_options(func: F) -> F:
    """One ``@argument`` per alert rule, in the table's order, typed and defaulted as its :class:`Rules` field."""
    for flag, field, purpose in reversed(_RULE_OPTIONS):
        default = getattr(Rules, field)
        func = argument(flag, type=type(default), default=default, help=f"{purpose} (default {default:g})")(func)
    return func


@magics_class
class MonitorMagics(ToolMagics):
    @magic_arguments()
    @argument("expressions", nargs="*",
              help="what to watch, comma-separated Python expressions: loss, opt.param_groups[0]['lr'] "
                   "(after the options)")
    @argument("--every", type=int, default=1, help="record every N optimizer steps (default 1)")
    @_rule_options
    @argument("--no-layers", action="store_true", help="do not record per-layer gradient norms")
    @argument("--no-ratio", action="store_true",
              help="do not record the update/parameter ratio (sampled: 1024 elements per parameter per step)")
    @argument("--tensorboard", default=None, metavar="DIR", help="also write TensorBoard event files to DIR")
    @report_options("the monitor object", "the final view", "_monitor")
    @line_cell_magic
    def monitor(self, line: str, cell: Optional[str] = None) -> Any:
        """Run the cell and plot the expressions at every optimizer step, live, with alerts.

        %%monitor [options] loss, opt.param_groups[0]["lr"]
            on the first line of a cell: evaluate the expressions in the notebook's namespace after
            each optimizer.step() (or every --every N), with each layer's gradient norm and
            update/parameter ratio
        %monitor
            on a line of its own: show the last run again (-o returns it)

        Under Jupyter the view appears when the cell starts and updates while it runs; the final
        view (smoothing, log scale, zoom) replaces it, also when the cell is stopped or fails.
        Alerts: a non-finite value, a spike, a plateau, a vanishing or exploding layer.
        Python twin:  with torch_nbdebug.monitor("loss", ...) as mon: ...   then mon.history
        """
        __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the user's traceback
        options, rest = split_line(line)
        args = parse_args(self.monitor, options)
        if cell is None:
            if rest.strip():  # an unknown option is argparse's UsageError; expressions need a cell
                parse_args(self.monitor, line)
                raise UsageError(f"%monitor on its own line shows the last run again (-o returns it) and takes no "
                                 f"expressions ({rest.strip()!r}): put %%monitor {rest.strip()} (two %) on the first "
                                 f"line of the cell that trains")
            return show_last(self.user_ns.get("_monitor"), args, "monitor", "watch a training loop", display)
        expressions = split_expressions(rest)
        body = CellBody(self.shell, require_body(cell, "monitor"), "monitor")  # bad cells fail before recording
        try:
            rules = Rules(**{field: getattr(args, _dest(flag)) for flag, field, _ in _RULE_OPTIONS})
            mon = monitor(*expressions, every=args.every, namespace=self.user_ns, rules=rules,
                          layers=not args.no_layers, ratio=not args.no_ratio, tensorboard=unquote(args.tensorboard))
        except (InputError, ImportError) as exc:
            raise UsageError(str(exc)) if isinstance(exc, ImportError) else usage_errors(exc) from None
        return self._run(mon, body, args, expressions)

    def _run(self, mon: Monitor, body: CellBody, args: Any, expressions: list[str]) -> Any:
        __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the user's traceback
        live = LiveDisplay("%%monitor " + ", ".join(expressions), mon.progress, fallback=display, shell=self.shell)
        mon.live = live
        failed = True
        try:
            with mon:
                value = body.run()
            failed = False
        finally:
            try:  # the final view replaces the live one (kept data also when stopped or failed)
                keep_report(self.shell, "_monitor", mon, args, failed, live.show)
            finally:
                live.close()
        if value is not None:
            display(value)
        return mon if args.return_report else None


def split_line(line: str) -> tuple[str, str]:
    """The leading options, and the expressions after them exactly as written."""
    pos, options = 0, []
    while True:
        match = _TOKEN.match(line, pos)
        if match is None:
            break
        token = match.group(1)
        name = token.split("=", 1)[0]
        if name not in _VALUED and name not in _FLAGS:
            break
        options.append(token)
        pos = match.end()
        if name in _VALUED and "=" not in token:
            value = _TOKEN.match(line, pos)
            if value is None:
                raise UsageError(f"%%monitor: {name} needs a value; see %monitor? for the options")
            options.append(value.group(1))
            pos = value.end()
    rest = line[pos:]
    late = _OPTION_LATE.search(rest)
    if late is not None:
        raise UsageError(f"%%monitor: options go before the expressions, e.g. %%monitor --every 10 loss "
                         f"({late.group(1)} came after them)")
    return " ".join(options), rest


def split_expressions(text: str) -> list[str]:
    """``loss, opt.param_groups[0]["lr"]`` → the two expressions, as written."""
    text = text.strip()
    if not text:
        raise UsageError('%%monitor needs something to watch: %%monitor loss  or  %%monitor loss, '
                         'opt.param_groups[0]["lr"]')
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError as exc:
        raise UsageError(f"%%monitor: {text!r} is not a comma-separated list of Python expressions ({exc.msg})") from None
    parts = tree.elts if isinstance(tree, ast.Tuple) and not text.startswith("(") else [tree]
    return [(ast.get_source_segment(text, part) or ast.unparse(part)).strip() for part in parts]


def load(shell: Any) -> None:
    """At ``%load_ext``: import the drawing modules in the background (the first report is drawn sooner)."""
    from torch_nbdebug.render.figures import warm_up

    warm_up()


MAGICS = MonitorMagics
