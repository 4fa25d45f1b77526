"""``%grads`` / ``record_gradients``: the recorder (recorder.py), the layers it watches (layers.py), the per-step
rows it samples (steps.py) and the statistics made of them (stats.py, with cpu.py's faster CPU kernels)."""
from torch_nbdebug.record.grads.layers import layers_of
from torch_nbdebug.record.grads.recorder import GradRecorder
from torch_nbdebug.record.grads.stats import exact_rows

__all__ = ["GradRecorder", "exact_rows", "layers_of"]
