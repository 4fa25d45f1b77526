"""Which storages were produced inside the watch (so a non-finite tensor from outside is "input" data).

Keys are storage addresses held through *weak* storage references: the tensor data is freed as
usual, but the address cannot be reused by another storage while we hold the weak count, so a
live storage found here really is the one an op produced. Expired entries are purged as we go.
"""
from __future__ import annotations

from typing import Any

import torch

from torch_nbdebug.record import compat
from torch_nbdebug.record.tensors import tensors_in

_expired = compat.storage_expired
_free = compat.free_storage_weak_ref
_PURGE_EVERY = 8192


class StorageRegistry:
    def __init__(self) -> None:
        self._keys: dict[int, int] = {}
        self._adds = 0

    def __len__(self) -> int:
        return len(self._keys)

    def add_all(self, out: Any) -> None:
        if isinstance(out, torch.Tensor):  # (the common case, at every op: no list)
            self.add(out)
        else:
            for t in tensors_in(out):
                self.add(t)

    def add(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested: no single storage
            return
        key = compat.storage_id(storage)
        if key in self._keys:
            return
        self._keys[key] = compat.storage_weak_ref(storage)
        self._adds += 1
        if self._adds >= _PURGE_EVERY:
            self.purge()

    def discard_all(self, out: Any) -> None:
        """Forget outputs written from outside data (an in-place copy_ into a produced buffer)."""
        for t in tensors_in(out):
            try:
                weak = self._keys.pop(compat.storage_id(t.untyped_storage()), None)
            except (RuntimeError, NotImplementedError):
                continue
            if weak is not None:
                _free(weak)

    def contains(self, t: torch.Tensor) -> bool:
        try:
            return compat.storage_id(t.untyped_storage()) in self._keys
        except (RuntimeError, NotImplementedError):
            return False

    def purge(self) -> None:
        """Forget storages that were freed (their addresses may then be reused)."""
        self._adds = 0
        for key, weak in list(self._keys.items()):
            if _expired(weak):
                _free(weak)
                del self._keys[key]

    def clear(self) -> None:
        for weak in self._keys.values():
            _free(weak)
        self._keys.clear()
