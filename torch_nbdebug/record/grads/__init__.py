"""``%grads`` / ``record_gradients``: the recorder (recorder.py), the layers it watches (layers.py), the per-step
rows it samples (steps.py), the statistics made of them (stats.py, with cpu.py's faster CPU kernels) and the
trace with its exact last step, made at the block's end or when first read (last.py)."""
from torch_nbdebug.record.grads.last import LazyTrace
from torch_nbdebug.record.grads.layers import layers_of
from torch_nbdebug.record.grads.recorder import GradRecorder
from torch_nbdebug.record.grads.stats import exact_rows

__all__ = ["GradRecorder", "LazyTrace", "exact_rows", "layers_of"]
