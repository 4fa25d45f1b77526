"""The tools the command line runs: one :class:`Tool` entry each.

A tool names its magic (whose ``@argument`` definitions become its command-line options, less the
notebook-only ones in ``skip``) and ``start(args, namespace)``, which returns the recorder's context
manager (its ``__enter__`` gives the result object, filled in on exit) and, for nanwatch, where the births
so far and the recorder's iteration are read. Adding a tool is adding one entry to :data:`TOOLS`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional


@dataclass(frozen=True)
class Started:
    context: Any
    births: Optional[Callable[[], list[Any]]] = None
    iteration: Optional[Callable[[], int]] = None


@dataclass(frozen=True)
class Tool:
    name: str
    help: str
    magic: tuple[str, str, str]  # (module, class, method) of the magic whose options it takes
    start: Callable[[Any, Mapping[str, Any]], Started]
    skip: tuple[str, ...] = ("-o", "-q", "--tensorboard")

    def arguments(self) -> list[Any]:
        """The magic's ``@argument`` definitions, in the order its help lists them."""
        module, cls, method = self.magic
        func = getattr(getattr(importlib.import_module(module), cls), method)
        return [d for d in reversed(getattr(func, "decorators", [])) if d.args and d.args[0] not in self.skip]


def _nanwatch(args: Any, namespace: Mapping[str, Any]) -> Started:
    from torch_nbdebug.api.nanwatch import nanwatch

    watch = nanwatch(mode=args.mode, backward=not args.no_backward, optimizer=not args.no_optimizer,
                     ignore_inf=args.ignore_inf, raise_on_birth=args.raise_on_birth, namespace=namespace,
                     max_events=args.max_events, replay=False if args.no_replay else None)
    return Started(watch, births=lambda: list(watch._recorder.log.events),
                   iteration=lambda: _next_iteration(watch._recorder.clock))


def _next_iteration(clock: Any) -> int:
    """The number nanwatch gives the next loop iteration: its clock moves on at the first forward op after a
    backward (an optimizer's own ops can already have moved it when the step's post-hook runs)."""
    return clock.iteration + (1 if clock.saw_backward else 0)


def _cudamem(args: Any, namespace: Mapping[str, Any]) -> Started:
    from torch_nbdebug.api.memory import memory_timeline

    return Started(memory_timeline(namespace, device=args.device, export=args.export, top=args.top,
                                   record_lines=not args.no_lines))


TOOLS: dict[str, Tool] = {
    "nanwatch": Tool("nanwatch", "where the first NaN/Inf was born (%%nanwatch)",
                     ("torch_nbdebug.magics.nanwatch", "NanwatchMagics", "nanwatch"), _nanwatch,
                     skip=("-o", "-q", "--tensorboard", "--load")),
    "cudamem": Tool("cudamem", "the memory timeline by category, per rank (%%cudamem)",
                    ("torch_nbdebug.magics.memory", "MemoryMagics", "cudamem"), _cudamem,
                    skip=("-o", "--output", "--tensorboard")),
}
