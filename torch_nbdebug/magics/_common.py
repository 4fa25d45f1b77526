"""Helpers shared by the magics: argument parsing that never exits, and running a cell body."""
from __future__ import annotations

import ast
from typing import Any, Callable, Optional, TypeVar

from IPython.core.error import UsageError
from IPython.core.magic_arguments import parse_argstring

from torch_nbdebug.errors import InputError

F = TypeVar("F", bound=Callable[..., Any])


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


def run_body(shell: Any, cell: str) -> Any:
    """Run a cell body in the user namespace the way IPython would, returning its last expression.

    The body is transformed (so ``%magics`` and ``!shell`` lines inside it work), compiled through
    IPython's caching compiler (so tracebacks and ``linecache`` show the real cell lines) and run
    with ``exec``: the user's exception propagates unchanged to the caller.
    """
    source = shell.transform_cell(cell)
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise UsageError(f"the cell has a syntax error at line {exc.lineno}: {exc.msg}") from None
    if not tree.body:
        raise UsageError("the cell has no code to run")
    filename = shell.compile.cache(source, shell.execution_count, raw_code=cell)
    last: Optional[ast.expr] = None
    if isinstance(tree.body[-1], ast.Expr):
        last = tree.body.pop().value
    if tree.body:
        exec(shell.compile(tree, filename, "exec"), shell.user_global_ns, shell.user_ns)
    if last is not None:
        expr = ast.Expression(last)
        return eval(shell.compile(expr, filename, "eval"), shell.user_global_ns, shell.user_ns)
    return None
