"""Weak references whose callbacks cannot swallow Jupyter's Stop.

Python runs weakref callbacks (like ``__del__`` and ``gc.callbacks``) where an exception cannot
propagate: it prints "Exception ignored in ..." and carries on. Jupyter's Stop is an asynchronous
``KeyboardInterrupt``, raised at whatever bytecode the main thread runs next; when that is a callback
of ours the interrupt is lost and the cell runs on. A ``try`` inside the callback cannot fix it: the
interrupt is also raised on the callback's first instruction, before the ``try`` is entered, and
re-delivering it with ``_thread.interrupt_main()`` from inside gets it raised again right after
that call returns, still inside the callback (tests/test_interrupts.py shows both).

The rule here is therefore: **no Python code of ours runs in a weakref callback**.

- :class:`CallbackQueue` gives Python a C function, ``deque.append``, as the callback: no bytecode
  runs, so a pending interrupt stays pending and is raised in the next code that does run, the
  user's or one of our hooks, where it propagates like any exception. The work the callback stands
  for runs in :meth:`CallbackQueue.drain`, which a recorder calls from its hooks, in event order.
- :class:`WeakIdMap` replaces ``WeakKeyDictionary``/``WeakSet`` (whose removal callbacks are Python
  code in the standard library) with callback-free weak references checked when read.
- :class:`deferred_interrupts` is the other half of "Stop leaves nothing installed": installing or
  removing a set of hooks is several steps, and a Stop between two of them would leave one behind.
  Inside the block a Stop is held, and raised when the block ends (in ordinary code, where it
  propagates); the steps run to completion first.
- :class:`no_grad_held` is ``torch.no_grad()`` for a tool's own work inside the user's run (a hook,
  a snapshot): ``torch.no_grad()`` switches grad mode off in ``__enter__`` and back in ``__exit__``,
  and a Stop landing right after the switch (still inside ``__enter__``, so ``__exit__`` never runs)
  or before the switch back (on ``__exit__``'s first instruction) would leave autograd off for the
  rest of the kernel. Every grad-mode switch of the tools goes through it.

Imports the standard library, and torch for :class:`no_grad_held`.
"""
from __future__ import annotations

import _signal
import sys
import threading
import weakref
from collections import deque
from types import FrameType
from typing import Any, Callable, Generic, Iterator, Optional, TypeVar

import torch

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")

__all__ = ["CallbackQueue", "WeakIdMap", "deferred_interrupts", "no_grad_held"]


class CallbackQueue(Generic[T]):
    """Weakref callbacks deferred to :meth:`drain`: ``weakref.ref(obj, queue.callback)``.

    ``callback`` is the bound C method ``deque.append`` (atomic under the GIL, so a callback fired
    on another thread, e.g. an autograd device thread freeing a tensor, is safe too); ``drain`` runs
    ``handle(item)`` for every queued item in the order they were queued.
    """

    __slots__ = ("_queue", "_handle", "callback")

    def __init__(self, handle: Callable[[T], None]) -> None:
        self._queue: deque[T] = deque()
        self._handle = handle
        self.callback: Callable[[T], None] = self._queue.append

    def drain(self) -> None:
        """Handle what was queued. An item is taken off before it is handled, so an interrupt
        raised meanwhile propagates and leaves the rest queued for the next drain."""
        queue, handle = self._queue, self._handle
        while queue:
            handle(queue.popleft())

    def clear(self) -> None:
        """Forget what is queued (the recorder stopped; references it handed out are dropped)."""
        self._queue.clear()

    def __len__(self) -> int:
        return len(self._queue)


class WeakIdMap(Generic[K, V]):
    """A map keyed weakly by object identity, with no callback: a dead key's entry is ignored when
    read and dropped when the next new key is added. Keys must support weak references."""

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: dict[int, tuple[weakref.ref[Any], V]] = {}

    def __setitem__(self, key: K, value: V) -> None:
        if id(key) not in self._data:
            self._prune()
        self._data[id(key)] = (weakref.ref(key), value)

    def get(self, key: K, default: Optional[V] = None) -> Optional[V]:
        entry = self._data.get(id(key))
        if entry is None or entry[0]() is not key:  # never set, or set for a dead object with this id
            return default
        return entry[1]

    def __getitem__(self, key: K) -> V:
        entry = self._data.get(id(key))
        if entry is None or entry[0]() is not key:
            raise KeyError(key)
        return entry[1]

    def __contains__(self, key: object) -> bool:
        entry = self._data.get(id(key))
        return entry is not None and entry[0]() is key

    def keys(self) -> Iterator[K]:
        """The keys still alive (a list is taken first: safe while the map changes)."""
        for ref, _ in list(self._data.values()):
            key = ref()
            if key is not None:
                yield key

    def clear(self) -> None:
        self._data.clear()

    def __len__(self) -> int:
        return sum(1 for _ in self.keys())

    def _prune(self) -> None:
        dead = [k for k, (ref, _) in self._data.items() if ref() is None]
        for k in dead:
            del self._data[k]


class deferred_interrupts:
    """``with deferred_interrupts():`` holds a Stop (SIGINT) that arrives inside the block and raises
    it when the block ends, so a few steps that must all run (removing every hook) are not cut short.

    Keep the block short: the user waits for it. Only the main thread receives Stop, so elsewhere
    (or when SIGINT has no Python handler) this does nothing. A Stop held while an exception is
    already propagating is dropped: the cell is ending anyway, and the user's exception stays the
    one they see. Nests: an inner block hands a held Stop to the outer one.
    """

    __slots__ = ("_previous", "_held")

    def __init__(self) -> None:
        self._previous: Any = None
        self._held: Optional[tuple[int, Optional[FrameType]]] = None

    # ``_signal`` is what ``signal`` wraps: the same handlers, without the enum conversions of every
    # call (this block runs twice per watch, and a one-step cell starts and stops a watch per step).
    def __enter__(self) -> "deferred_interrupts":
        if threading.get_ident() != threading.main_thread().ident:
            return self
        previous = _signal.getsignal(_signal.SIGINT)
        if callable(previous):
            self._held = None
            _signal.signal(_signal.SIGINT, self._hold)
            self._previous = previous
        return self

    def _hold(self, signum: int, frame: Optional[FrameType]) -> None:
        self._held = (signum, frame)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        previous, self._previous = self._previous, None
        if previous is None:
            return
        _signal.signal(_signal.SIGINT, previous)
        held, self._held = self._held, None
        if held is not None and exc_type is None and sys.exc_info()[0] is None:
            previous(*held)  # Python's default handler raises KeyboardInterrupt, here


class no_grad_held:
    """``with no_grad_held():`` is ``with torch.no_grad():`` with a Stop held (:class:`deferred_interrupts`)
    from before grad mode is switched off until after it is switched back, so a Stop never parts the
    two switches (and is raised when the block ends). The block's own work holds a Stop too: keep it
    short (a few batched ops per step, one snapshot)."""

    __slots__ = ("_held", "_previous")

    def __init__(self) -> None:
        self._held = deferred_interrupts()
        self._previous = True

    def __enter__(self) -> None:
        if not torch.compiler.is_compiling():  # traced into a compiled hook: no bytecode of ours runs there
            self._held.__enter__()
        self._previous = torch.is_grad_enabled()
        torch.set_grad_enabled(False)

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            torch.set_grad_enabled(self._previous)
        finally:
            self._held.__exit__(exc_type, exc, tb)
