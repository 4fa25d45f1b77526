"""``%cudamem`` / ``memory_timeline``: the recorder of every storage (recorder.py) with its op and holder
helpers (ops.py, holders.py), memory now (state.py) and CUDA's own allocator history (cuda.py)."""
from torch_nbdebug.record.memory.cuda import CudaHistory, recording_from_snapshot
from torch_nbdebug.record.memory.recorder import MemoryRecorder
from torch_nbdebug.record.memory.state import capture_state

__all__ = ["CudaHistory", "MemoryRecorder", "capture_state", "recording_from_snapshot"]
