"""Helpers shared by the magics: argument parsing that never exits, and running a cell body."""
from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import types
from typing import Any, Callable, Iterator, Optional, TypeVar

from IPython.core.error import UsageError
from IPython.core.magic import Magics
from IPython.core.magic_arguments import argument, parse_argstring
from torch.optim.optimizer import register_optimizer_step_post_hook

from torch_nbdebug.errors import InputError
from torch_nbdebug.record.interrupts import deferred_interrupts
from torch_nbdebug.record.source import running_cell_number
from torch_nbdebug.render.live import LiveDisplay, Progress

F = TypeVar("F", bound=Callable[..., Any])


class ToolMagics(Magics):
    """The magics of one tool: ``Magics`` with the user's namespace typed (IPython's ``shell`` is
    ``Optional``; a magic registered by ``%load_ext`` always has one)."""

    @property
    def user_ns(self) -> dict[str, Any]:
        if self.shell is None:
            raise UsageError("these magics are not registered with an IPython shell: run %load_ext torch_nbdebug")
        namespace: dict[str, Any] = self.shell.user_ns
        return namespace


def report_options(returned: str, shown: str, key: str, dest: str = "return_report") -> Callable[[F], F]:
    """The ``-o`` and ``-q`` options of a recording magic: ``-o`` returns ``returned`` (stored as ``key``
    either way), ``-q`` does not display ``shown``. Apply it where the two ``@argument`` lines would go."""
    def apply(func: F) -> F:
        quiet = argument("-q", "--quiet", action="store_true", help=f"do not display {shown} (still stored as {key})")
        output = argument("-o", dest=dest, action="store_true", help=f"return {returned} (it is also stored as {key})")
        return output(quiet(func))
    return apply


def parse_args(func: Callable[..., Any], line: str) -> Any:
    """``parse_argstring`` with argparse's exit turned into a ``UsageError`` naming the magic's help."""
    try:
        return parse_argstring(func, line)
    except UsageError:
        raise
    except SystemExit as exc:  # argparse exits on --help or errors in some IPython versions
        name = getattr(func, "__name__", "magic")
        raise UsageError(f"bad arguments to %{name}: {line!r}; see %{name}? for the options") from exc


def require_body(cell: Optional[str], magic: str) -> str:
    """The cell body, or a ``UsageError`` saying what to write when it is empty."""
    if cell is None or not cell.strip():
        raise UsageError(f"%%{magic} needs code below it: put the code to run in the same cell, "
                         f"under the %%{magic} line")
    return cell


def evaluate(shell: Any, expression: str, what: str) -> Any:
    """Evaluate a user expression in the user namespace, or say clearly why it cannot be."""
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the user's traceback
    expression = expression.strip()
    if not expression:
        raise UsageError(f"{what}: name a variable or write an expression")
    try:
        return eval(expression, shell.user_global_ns, shell.user_ns)
    except NameError as exc:
        raise UsageError(f"{what}: {exc} (run the cell that defines it first)") from None
    except SyntaxError as exc:
        raise UsageError(f"{what}: {expression!r} is not a Python expression ({exc.msg})") from None


def usage_errors(exc: InputError) -> UsageError:
    """Turn the API's input errors into IPython usage errors (no internal traceback)."""
    return UsageError(str(exc))


class CellBody:
    """A cell body compiled the way IPython compiles a cell, ready to run in the user namespace.

    Compiling first means a syntax error, an empty body or an ``await`` that cannot run here is a
    ``UsageError`` before any tool starts watching; :meth:`run` then only runs the user's code, whose
    exception propagates unchanged.
    """

    def __init__(self, shell: Any, cell: str, magic: str = "") -> None:
        self.shell = shell
        self._prefix = f"%%{magic}: " if magic else ""
        source = shell.transform_cell(cell)
        try:
            tree = ast.parse(source)
        except SyntaxError as exc:
            raise UsageError(f"{self._prefix}the cell has a syntax error at line {exc.lineno}: {exc.msg}") from None
        if not tree.body:
            where = f"under the %%{magic} line" if magic else "in the cell"
            raise UsageError(f"{self._prefix}the cell has no code to run (only comments): put the code {where}")
        filename = shell.compile.cache(source, running_cell_number() or shell.execution_count, raw_code=cell)
        last = tree.body.pop().value if isinstance(tree.body[-1], ast.Expr) else None
        self._body = self._compile(ast.Module(tree.body, []), filename, "exec") if tree.body else None
        self._last = self._compile(ast.Expression(last), filename, "eval") if last is not None else None

    def _compile(self, tree: ast.AST, filename: str, mode: str) -> types.CodeType:
        """Compiled with top-level ``await`` allowed when IPython allows it (``%autoawait``)."""
        flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT if getattr(self.shell, "autoawait", False) else 0
        try:
            with self.shell.compile.extra_flags(flags):
                code = self.shell.compile(tree, filename, mode)
        except SyntaxError as exc:  # 'await' outside function, when %autoawait is off
            raise UsageError(f"{self._prefix}{exc.msg} (line {exc.lineno}); turn on %autoawait or move the "
                             f"await out of this cell") from None
        if code.co_flags & inspect.CO_COROUTINE and _loop_running():
            raise UsageError(f"{self._prefix}this cell uses top-level `await`, which cannot run inside a magic "
                             f"while Jupyter's event loop is running: run the `await` line in its own cell "
                             f"first (e.g. `batch = await fetch()`), then run the magic on the synchronous code")
        return code

    def run(self) -> Any:
        """Run the body, returning the value of its last expression (None if it ends in a statement)."""
        __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the user's traceback
        if self._body is not None:
            self._execute(self._body)
        return self._execute(self._last) if self._last is not None else None

    def _execute(self, code: types.CodeType) -> Any:
        __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the user's traceback
        value = eval(code, self.shell.user_global_ns, self.shell.user_ns)
        if code.co_flags & inspect.CO_COROUTINE:  # top-level await: run it the way IPython runs the cell
            value = self.shell.loop_runner(value)
        return value


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def run_body(shell: Any, cell: "str | CellBody", magic: str = "") -> Any:
    """Run a cell body in the user namespace the way IPython would, returning its last expression.

    The body is transformed (so ``%magics`` and ``!shell`` lines inside it work), compiled through
    IPython's caching compiler (so tracebacks and ``linecache`` show the real cell lines), with
    top-level ``await`` where IPython allows it, and run: the user's exception propagates unchanged.
    Pass a :class:`CellBody` compiled before the tool starts to report bad cells first.
    """
    __tracebackhide__ = True  # noqa: F841 - IPython leaves this frame out of the user's traceback
    body = cell if isinstance(cell, CellBody) else CellBody(shell, cell, magic)
    return body.run()


def keep_report(shell: Any, key: str, report: Any, args: Any, failed: bool, show: Callable[[Any], Any]) -> None:
    """Store a recording magic's report as ``key`` in the user namespace and show it: always when the
    cell failed (the report is why the user ran it), else unless ``-q`` or ``-o`` (which returns it)."""
    shell.user_ns[key] = report
    if not args.quiet and (failed or not args.return_report):
        show(report)


def show_last(report: Any, args: Any, magic: str, purpose: str, show: Callable[[Any], Any]) -> Any:
    """``%magic`` without a cell: the last report again (returned with ``-o``), or what to write."""
    if report is None:
        raise UsageError(f"%{magic}: no report yet. Put %%{magic} (two %) on the first line of a cell "
                         f"to {purpose}")
    if args.return_report:
        return report
    show(report)
    return None


@contextlib.contextmanager
def live_view(shell: Any, title: str, progress: Callable[[], Progress], show: Callable[[Any], Any],
              enabled: bool = True) -> Iterator[LiveDisplay]:
    """A live view of the running cell (see ``render/live.py``), counting optimizer steps.

    Under an ipykernel front end (and ``enabled``: not when the magic will not show its report) the view
    is shown now and every ``optimizer.step()`` of any optimizer ticks it (torch's global step post hook:
    a counter and a clock read; ``progress()`` runs only when an update is due). Show the final report
    with ``live.show`` inside the block: it replaces the view, or is shown with ``show`` when there is
    none. Elsewhere nothing is shown or installed. The hook is removed and the view closed on exit,
    also when the cell raised or was stopped.
    """
    live = LiveDisplay(title, progress, fallback=show, shell=shell, enabled=enabled)
    handle = None
    try:
        with deferred_interrupts():  # a Stop while starting is raised once the hook is in place...
            if live.active:
                live.start()
                handle = register_optimizer_step_post_hook(lambda optimizer, args, kwargs: live.tick())
        yield live
    finally:
        try:
            if handle is not None:
                handle.remove()  # ...so that it is always removed here
        finally:
            live.close()


def unquote(value: Optional[str]) -> Optional[str]:
    """IPython's argument splitting keeps the quotes of ``--tensorboard "my runs"``: drop one pair."""
    if value is not None and len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


def tensorboard_dir(value: Optional[str], magic: str) -> Optional[str]:
    """The ``--tensorboard DIR`` of a magic, checked before the cell runs (a missing TensorBoard, or a
    directory that cannot be made, is a UsageError saying so, not a failure after a long training cell)."""
    path = unquote(value)
    if path is None:
        return None
    if not path.strip():
        raise UsageError(f"{magic} --tensorboard needs a directory, e.g. --tensorboard runs/exp1")
    from torch_nbdebug.api.tensorboard import check_logdir, require_tensorboard

    try:
        require_tensorboard()
        return check_logdir(path)
    except (ImportError, InputError) as exc:
        raise UsageError(str(exc)) from None


def write_tensorboard(result: Any, path: Optional[str]) -> None:
    """Write ``result`` (a trace with ``to_tensorboard``) to ``path`` and say where."""
    if path is None or result is None:
        return
    try:
        result.to_tensorboard(path)
    except InputError as exc:
        raise usage_errors(exc) from None
    print(f"TensorBoard event files written to {path}: tensorboard --logdir {path}")
