"""``%%nanwatch``'s recorder, by strategy: ``core/`` (rules, log, events, ops, params, storage, the
per-layer table) imports no strategy; ``checks/`` (the per-op watch, immediate or deferred), ``modules/``
(module-mode checks) and ``replay/`` (forward, kept outputs, backward) import core and see the recorder only
through the typed protocols of ``context``; ``recorder`` composes them."""
from torch_nbdebug.record.nanwatch.modules.tracker import not_traced
from torch_nbdebug.record.nanwatch.context import uses_replay
from torch_nbdebug.record.nanwatch.recorder import NanRecorder
from torch_nbdebug.record.nanwatch.recording import NanRecording

__all__ = ["NanRecorder", "NanRecording", "not_traced", "uses_replay"]
