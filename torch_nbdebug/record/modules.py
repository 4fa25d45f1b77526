"""Qualified module names as the user writes them, and which module is running now.

``model.blocks.3.attn`` is built from the user's variable name (``model``) and ``named_modules``.
:class:`ModuleTracker` keeps a stack of the modules whose forward is running, through the global
handle-based hooks (``register_module_forward_pre_hook``/``register_module_forward_hook`` with
``always_call=True``), so nothing is patched and everything is removed on exit.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional

from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from torch_nbdebug.record import compat
from torch_nbdebug.record.source import UserNamespace


def module_roots(namespace: Optional[Mapping[str, Any]]) -> list[tuple[str, nn.Module]]:
    """The ``nn.Module`` values of a namespace, largest first, skipping private names like ``_``.

    ``type()`` decides what is a module (``isinstance`` would run a proxy's ``__class__``). A
    ``torch.compile`` wrapper counts as the model it runs, and the plain name wins a tie: with
    ``cm = torch.compile(m)`` the layers are ``m.fc2``; with only ``cm`` they are ``cm.fc2``.
    """
    if namespace is None:
        return []
    found: list[tuple[int, bool, str, nn.Module]] = []
    for key, value in list(namespace.items()):
        if type(key) is not str or key.startswith("_") or not issubclass(type(value), nn.Module):
            continue
        inner = compiled_original(value)
        try:
            size = sum(1 for _ in (inner if inner is not None else value).modules())
        except Exception:  # noqa: BLE001 - a module we cannot walk is left out, and said so
            _skip(namespace, key)
            continue
        found.append((size, inner is not None, key, value))
    found.sort(key=lambda r: (-r[0], r[1], r[2]))
    return [(key, value) for _, _, key, value in found]


def _walked_roots(namespace: Optional[Mapping[str, Any]]) -> list[tuple[str, list[tuple[str, nn.Module]]]]:
    """:func:`module_roots` in its order, each root with its :func:`user_named_modules` walk: one walk per
    root (the size the roots are sorted by is the walk's count of distinct modules, a compile wrapper's own
    not counted, as ``module_roots`` counts the model it runs)."""
    if namespace is None:
        return []
    found: list[tuple[int, bool, str, list[tuple[str, nn.Module]]]] = []
    for key, value in list(namespace.items()):
        if type(key) is not str or key.startswith("_") or not issubclass(type(value), nn.Module):
            continue
        compiled = compiled_original(value) is not None
        try:
            walk = (None if compiled else _plain_named_walk(value)) or list(user_named_modules(value))
        except Exception:  # noqa: BLE001 - a module we cannot walk is left out, and said so
            _skip(namespace, key)
            continue
        found.append((len({id(m) for _, m in walk}) - compiled, compiled, key, walk))
    found.sort(key=lambda r: (-r[0], r[1], r[2]))
    return [(key, walk) for _, _, key, walk in found]


_WALK_CAP = 100_000  # modules listed by one plain walk (more: a cycle, left to named_modules' own walk)


def _plain_named_walk(root: nn.Module) -> Optional[list[tuple[str, nn.Module]]]:
    """``list(root.named_modules(remove_duplicate=False))``, the same pairs in the same order, in one loop over
    the ``_modules`` dicts (the generator chain of ``named_modules`` costs several times as much, at every
    watch's start); None when a class in the tree lists its modules its own way (its ``named_modules`` is
    then the one to run)."""
    own = nn.Module.named_modules
    out: list[tuple[str, nn.Module]] = []
    stack: list[tuple[str, nn.Module]] = [("", root)]
    while stack:
        prefix, module = stack.pop()
        if type(module).named_modules is not own or len(out) > _WALK_CAP:
            return None
        out.append((prefix, module))
        children = compat.child_module_dict(module)
        if children:
            dot = prefix + "." if prefix else ""
            stack += [(dot + name, child) for name, child in reversed(children.items()) if child is not None]
    return out


def compiled_original(module: Any) -> Optional[nn.Module]:
    """The module a ``torch.compile`` wrapper (``OptimizedModule``) runs, else None."""
    inner = compat.original_module(module)  # the one rule for unwrapping lives in compat
    return inner if inner is not module else None


def user_named_modules(root: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``named_modules`` as the user spells the paths: a compile wrapper and the model it runs
    both have the root's name, and ``_orig_mod`` never appears."""
    inner = compiled_original(root)
    if inner is None:
        yield from root.named_modules(remove_duplicate=False)
        return
    yield "", root
    yield from user_named_modules(inner)


def user_named_parameters(root: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``named_parameters`` without the ``_orig_mod.`` of a ``torch.compile`` wrapper."""
    inner = compiled_original(root)
    yield from (inner if inner is not None else root).named_parameters(remove_duplicate=False)


def qualified_names(roots: Iterable[tuple[str, nn.Module]]) -> dict[int, str]:
    """Map ``id(module)`` to its shortest user-facing path; the largest root claims shared modules."""
    names: dict[int, str] = {}
    for root_name, root in roots:
        for sub_name, module in _safely(user_named_modules, root):
            names.setdefault(id(module), f"{root_name}.{sub_name}" if sub_name else root_name)
    return names


def module_at(roots: Iterable[tuple[str, nn.Module]], path: str) -> Optional[nn.Module]:
    """The module a user-facing path (``model.norm``) names among ``roots``, or None."""
    for root_name, root in roots:
        if path == root_name or path.startswith(root_name + "."):
            sub = path[len(root_name) + 1:]
            found = next((m for name, m in _safely(user_named_modules, root) if name == sub), None)
            if found is not None:
                return found
    return None


def parameter_names(roots: Iterable[tuple[str, nn.Module]]) -> dict[int, str]:
    """Map ``id(parameter)`` to ``model.fc.weight``; shared parameters keep their first name."""
    names: dict[int, str] = {}
    for root_name, root in roots:
        for name, param in _safely(user_named_parameters, root):
            names.setdefault(id(param), f"{root_name}.{name}")
    return names


def _safely(walk: Callable[[nn.Module], Iterator[tuple[str, Any]]], root: nn.Module) -> list[tuple[str, Any]]:
    """The whole walk, or what it yielded before a module of the user's raised."""
    out: list[tuple[str, Any]] = []
    try:
        out.extend(walk(root))
    except Exception:  # noqa: BLE001 - a broken user module must not break the tool
        pass
    return out


def _skip(namespace: Mapping[str, Any], name: str) -> None:
    if isinstance(namespace, UserNamespace):  # it tells the user what could not be read
        namespace.skip(name)


class ModuleNamer:
    """Names modules lazily: from the namespace first, else by class for modules created inline.

    A module that the namespace does not know and that runs at top level becomes a root named after
    its class in lower case (``resnet``), so its children still get readable paths. Names are kept
    by ``id(module)`` with a weak reference: a model created inline and freed leaves its id to the
    next module, which must not inherit the dead model's path.
    """

    def __init__(self, namespace: Optional[Mapping[str, Any]] = None) -> None:
        self._namespace = namespace
        self._names: dict[int, tuple[weakref.ref, str]] = {}
        self._add_walks(_walked_roots(namespace))

    def name(self, module: nn.Module, parent: Optional[str] = None) -> str:
        entry = self._names.get(id(module))  # (_lookup inlined: this runs at every module call)
        if entry is not None and entry[0]() is module:
            return entry[1]
        found = self._lookup(module)  # (a dead module's entry goes)
        if found is not None:
            return found
        if parent is None:
            # The namespace may have gained the model since we were created (``model = Net()`` in the cell).
            self._add_walks(_walked_roots(self._namespace))
            found = self._lookup(module)
            if found is None:
                self._add_roots([(type(module).__name__.lower(), module)])
                found = self._lookup(module)
            assert found is not None
            return found
        # A child the parent's named_modules did not list (created during forward): name it by class.
        path = f"{parent}.{type(module).__name__.lower()}"
        self._remember(module, path)
        return path

    def clear(self) -> None:
        self._names.clear()
        self._namespace = None

    def _add_roots(self, roots: Iterable[tuple[str, nn.Module]]) -> None:
        self._add_walks([(root_name, _safely(user_named_modules, root)) for root_name, root in roots])

    def _add_walks(self, walks: Iterable[tuple[str, list[tuple[str, nn.Module]]]]) -> None:
        for root_name, walk in walks:
            for sub_name, module in walk:
                if self._lookup(module) is None:  # the largest root claims shared modules
                    self._remember(module, f"{root_name}.{sub_name}" if sub_name else root_name)

    def _remember(self, module: nn.Module, path: str) -> None:
        self._names[id(module)] = (weakref.ref(module), path)

    def _lookup(self, module: nn.Module) -> Optional[str]:
        entry = self._names.get(id(module))
        if entry is None:
            return None
        if entry[0]() is not module:  # the module named so died and a new one got its id
            del self._names[id(module)]
            return None
        return entry[1]


class ModuleTracker:
    """Context manager that knows the qualified path of the module whose forward is running.

    ``on_enter(path, module)`` and ``on_exit(path, module, output)`` callbacks let recorders act at
    module boundaries (the cheap module-level NaN check, module nesting of graph nodes).
    """

    def __init__(self, namespace: Optional[Mapping[str, Any]] = None, *,
                 on_enter: Optional[Callable[[str, nn.Module], None]] = None,
                 on_exit: Optional[Callable[[str, nn.Module, Any], None]] = None) -> None:
        self.namer = ModuleNamer(namespace)
        self.stack: list[str] = []
        self._on_enter = on_enter
        self._on_exit = on_exit
        self._handles: list[Any] = []
        self._warned = False  # holds compat.global_hook_warning

    @property
    def current(self) -> Optional[str]:
        """The innermost running module's path, or None outside any module."""
        return self.stack[-1] if self.stack else None

    def __enter__(self) -> "ModuleTracker":
        compat.global_hook_warning.acquire()  # torch's warning about our hooks and compiled modules
        self._warned = True
        self._handles = [
            register_module_forward_pre_hook(self._pre),
            register_module_forward_hook(self._post, always_call=True),
        ]
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.stack.clear()
        self.namer.clear()
        if self._warned:
            self._warned = False
            compat.global_hook_warning.release()

    def _pre(self, module: nn.Module, args: Any) -> None:
        path = self.namer.name(module, self.current)
        self.stack.append(path)
        if self._on_enter is not None:
            self._on_enter(path, module)

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        path = self.stack.pop() if self.stack else self.namer.name(module)
        if self._on_exit is not None:
            self._on_exit(path, module, output)


def global_hook_counts() -> dict[str, int]:
    """How many global module/optimizer hooks are installed (tests use it to prove cleanup)."""
    from torch.nn.modules import module as m
    from torch.optim import optimizer as o

    # Every ``_global_*`` dict, flags included: torch leaves a removed ``with_kwargs`` hook's flag behind.
    counts = {name: len(getattr(m, name)) for name in dir(m)
              if name.startswith("_global_") and isinstance(getattr(m, name), dict)}
    counts.update({name: len(getattr(o, name)) for name in dir(o)
                   if name.startswith("_global_optimizer") and isinstance(getattr(o, name), dict)})
    counts["torch_dispatch_modes"] = compat.dispatch_stack_len()
    counts["torch_function_modes"] = compat.function_stack_len()
    return counts
