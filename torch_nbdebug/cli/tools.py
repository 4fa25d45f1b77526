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
    extra: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = ()  # (args, kwargs) of options of its own

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


class LazyGradients:
    """``record_gradients`` on the script's model, started at the model's first call: a script makes its model
    after it starts, so the model is found by name in its globals (a global module pre-hook looks until it is
    there, then removes itself)."""

    def __init__(self, args: Any, namespace: Mapping[str, Any]) -> None:
        self.args, self.namespace = args, namespace
        self.recording: Any = None
        self._hook: Any = None
        self.error: Optional[str] = None

    def __enter__(self) -> "LazyGradients":
        from torch.nn.modules.module import register_module_forward_pre_hook

        self._hook = register_module_forward_pre_hook(self._look)
        return self

    def _look(self, module: Any, args: Any) -> None:
        from torch import nn

        from torch_nbdebug.api.grads import record_gradients
        from torch_nbdebug.errors import InputError

        model = self.namespace.get(self.args.model)
        if not isinstance(model, nn.Module):
            return
        self._unhook()
        layer = int(self.args.layer) if self.args.layer and self.args.layer.isdigit() else self.args.layer
        try:
            self.recording = record_gradients(model, name=self.args.model, namespace=self.namespace, layer=layer,
                                              bins=self.args.bins, sample=self.args.sample,
                                              activations=self.args.activations)
            self.recording.__enter__()
        except InputError as exc:
            self.recording, self.error = None, str(exc)

    def _unhook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def __exit__(self, *exc: Any) -> None:
        self._unhook()
        if self.recording is not None:
            self.recording.__exit__(*exc)

    def to_dict(self) -> Optional[dict[str, Any]]:
        if self.recording is None or self.recording.trace is None:
            return None
        return self.recording.trace.to_dict()

    def note(self) -> Optional[str]:
        if self.recording is not None:
            return None
        return self.error or (f"no nn.Module named {self.args.model!r} was ever called in the script's globals: "
                              f"name the global that holds the model with --model")


def _profile(args: Any, namespace: Mapping[str, Any]) -> Started:
    from torch_nbdebug.api.profile import profile

    return Started(profile(namespace, steps=args.steps, warmup=args.warmup, trace=args.trace, tidy=args.tidy))


def _grads(args: Any, namespace: Mapping[str, Any]) -> Started:
    return Started(LazyGradients(args, namespace))


TOOLS: dict[str, Tool] = {
    "nanwatch": Tool("nanwatch", "where the first NaN/Inf was born (%%nanwatch)",
                     ("torch_nbdebug.magics.nanwatch", "NanwatchMagics", "nanwatch"), _nanwatch,
                     skip=("-o", "-q", "--tensorboard", "--load")),
    "cudamem": Tool("cudamem", "the memory timeline by category, per rank (%%cudamem)",
                    ("torch_nbdebug.magics.memory", "MemoryMagics", "cudamem"), _cudamem,
                    skip=("-o", "--output", "--tensorboard")),
    "grads": Tool("grads", "per-layer gradients at every optimizer step, per rank (%%grads)",
                  ("torch_nbdebug.magics.grads", "GradsMagics", "grads"), _grads,
                  skip=("model", "-o", "--tensorboard"),
                  extra=((("--model",), dict(required=True, metavar="NAME",
                                             help="the global variable of the script that holds the model")),)),
    "profile": Tool("profile", "why a training step is slow: verdict, line and module, per rank (%%profile)",
                    ("torch_nbdebug.magics.profile", "ProfileMagics", "profile"), _profile),
}
