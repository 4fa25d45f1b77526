"""``%%repro``: the recorder of one run (recorder.py) with its op fingerprints (ops.py) and out-of-place writes
(write.py), the state restored between the runs (state.py) and the settings compared (settings.py)."""
from torch_nbdebug.record.repro.recorder import ReproRecorder
from torch_nbdebug.record.repro.settings import end_state, read_settings
from torch_nbdebug.record.repro.state import StateSnapshot, is_state, state_in

__all__ = ["ReproRecorder", "StateSnapshot", "end_state", "is_state", "read_settings", "state_in"]
