"""Tensor identity shared by the recorders.

``storage_key`` reads a private attribute, so it lives in :mod:`torch_nbdebug.record.compat`; the
recorders keep importing it from here.
"""
from __future__ import annotations

from torch_nbdebug.record.compat import storage_key

__all__ = ["storage_key"]
