"""``python -m torch_nbdebug TOOL [options] script.py [args]``: a tool around a script, on every rank.

A layer beside magics/ (DESIGN.md section 11): each rank runs the tool's recorder unchanged, with the
rank's session of :mod:`torch_nbdebug.api.ranks`; the script runs as ``__main__`` and its exit status is
the process's. Bad input is argparse's: a message, a usage line and status 2.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import traceback
import types
from typing import Any, Optional, Sequence

from torch_nbdebug.cli.tools import TOOLS

PROG = "python -m torch_nbdebug"


def _top_parser() -> argparse.ArgumentParser:
    tools = "\n".join(f"  {name:<10} {tool.help}" for name, tool in TOOLS.items())
    parser = argparse.ArgumentParser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=f"{PROG} TOOL [options] (script.py | -m module) [args ...]",
        description="Run a script (or torchrun's ranks) under a torch_nbdebug tool; the report is written to "
                    "--out DIR (report.json, report.html, one rank-R.json per rank).",
        epilog=f"tools:\n{tools}\n\n{PROG} TOOL --help lists a tool's options.\n"
               f"Under torchrun: torchrun --nproc-per-node N -m torch_nbdebug nanwatch --out DIR train.py")
    parser.add_argument("tool", choices=sorted(TOOLS), metavar="TOOL", help="one of: " + ", ".join(TOOLS))
    return parser


def tool_parser(name: str) -> argparse.ArgumentParser:
    tool = TOOLS[name]
    parser = argparse.ArgumentParser(prog=f"{PROG} {name}", usage=f"{PROG} {name} [options] (script.py | -m module) "
                                                                  f"[args ...]", description=tool.help)
    for argument in tool.arguments():
        argument.add_to_parser(parser, None)
    for args, kwargs in tool.extra:
        parser.add_argument(*args, **kwargs)
    parser.add_argument("--out", default="nbdebug-report", metavar="DIR",
                        help="where the report goes (default: ./nbdebug-report)")
    parser.add_argument("--hang-timeout", type=float, default=None, metavar="S",
                        help="when a rank waits S seconds in a collective: write every rank's stacks and the "
                             "collective it waits in, then end the run (status 124)")
    parser.add_argument("-m", dest="module", default=None, metavar="MODULE", help="run a module, as python -m does")
    parser.add_argument("script", nargs="?", help="the script to run as __main__")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return parser


def parse(argv: Sequence[str]) -> tuple[str, Any]:
    argv = list(argv)
    if not argv or argv[0].startswith("-"):
        _top_parser().parse_args(argv)  # --help lists the tools; anything else: usage and status 2
        _top_parser().error("name a tool first")
    _top_parser().parse_args(argv[:1])
    name, rest = argv[0], argv[1:]
    parser = tool_parser(name)
    if "-m" in rest:  # everything after -m MODULE is the module's: argparse must not read it
        i = rest.index("-m")
        head = parser.parse_args(rest[:i])
        if head.script is None:
            if i + 1 >= len(rest):
                parser.error("-m needs a module name")
            head.module, head.args = rest[i + 1], rest[i + 2:]
            return name, head
    args = parser.parse_args(rest)
    if args.script is None:
        parser.error("name the script to run (or -m module)")
    if not os.path.isfile(args.script):
        parser.error(f"no such script: {args.script}")
    if args.hang_timeout is not None and args.hang_timeout <= 0:
        parser.error("--hang-timeout must be a positive number of seconds")
    return name, args


def _code(args: Any, parser: argparse.ArgumentParser) -> tuple[types.CodeType, types.ModuleType, list[str]]:
    main = types.ModuleType("__main__")
    if args.module is not None:
        try:
            spec = importlib.util.find_spec(args.module)
            if spec is not None and spec.submodule_search_locations is not None:
                spec = importlib.util.find_spec(args.module + ".__main__")
        except (ImportError, ValueError) as exc:
            parser.error(f"cannot run module {args.module}: {exc}")
        if spec is None or spec.loader is None:
            parser.error(f"no module named {args.module}")
        code = spec.loader.get_code(spec.name)  # type: ignore[attr-defined]
        main.__spec__, main.__package__ = spec, spec.parent
        main.__file__ = spec.origin or args.module
        return code, main, [main.__file__] + list(args.args)
    with open(args.script, "rb") as f:
        source = f.read()
    try:
        code = compile(source, os.path.abspath(args.script), "exec")
    except SyntaxError as exc:
        parser.error(f"{args.script} has a syntax error at line {exc.lineno}: {exc.msg}")
    main.__file__ = os.path.abspath(args.script)
    return code, main, [args.script] + list(args.args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (the script's)."""
    from torch_nbdebug.api.ranks import RankSession
    from torch_nbdebug.errors import InputError

    name, args = parse(sys.argv[1:] if argv is None else argv)
    code, main_module, script_argv = _code(args, tool_parser(name))
    main_module.__builtins__ = __builtins__  # type: ignore[attr-defined]
    try:
        started = TOOLS[name].start(args, main_module.__dict__)
    except InputError as exc:
        tool_parser(name).error(str(exc))
    if args.hang_timeout is not None:
        from torch_nbdebug.record.collectives import turn_on_flight_recorder

        turn_on_flight_recorder()
    session = RankSession(name, args.out, started.context, births=started.births, iteration=started.iteration,
                          hang_timeout=args.hang_timeout)
    saved = sys.argv, sys.modules.get("__main__"), list(sys.path)
    sys.argv = script_argv
    sys.modules["__main__"] = main_module
    sys.path.insert(0, os.path.dirname(main_module.__file__ or "") if args.module is None else os.getcwd())
    status, error = 0, None  # type: tuple[int, Optional[BaseException]]
    try:
        session.start()
        try:
            exec(code, main_module.__dict__)
        except SystemExit as exc:
            status = _exit_status(exc)
        except KeyboardInterrupt as exc:
            error, status = exc, 130
        except BaseException as exc:  # noqa: BLE001 - the script's error: its traceback and status 1
            error, status = exc, 1
            _print_traceback(exc, code.co_filename)
        report = session.finish(error, status)
    finally:
        sys.argv, sys.path[:] = saved[0], saved[2]
        if saved[1] is not None:
            sys.modules["__main__"] = saved[1]
    if report is not None:
        from torch_nbdebug.render.ranks import finding_lines

        lines = finding_lines(report.document)
        lines.append(f"report: {os.path.join(args.out, 'report.html')} (and report.json; "
                     f"torch_nbdebug.load({args.out!r}) in Python)")
        print("\n".join(lines), file=sys.stderr, flush=True)
    return status


def _exit_status(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _print_traceback(exc: BaseException, filename: str) -> None:
    """The script's traceback as Python prints it, starting at the script's own frame."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != filename:
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb or exc.__traceback__, file=sys.stderr)
