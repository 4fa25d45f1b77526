"""``%%explain``: the light recorder (recorder.py) with its index checks (indices.py), and the facts read
from a failure's traceback (trace.py, over the frames of frames.py)."""
from torch_nbdebug.record.explain.indices import IndexCheckError
from torch_nbdebug.record.explain.recorder import ExplainRecorder
from torch_nbdebug.record.explain.trace import failure_facts

__all__ = ["ExplainRecorder", "IndexCheckError", "failure_facts"]
