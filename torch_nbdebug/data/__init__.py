"""Plain, frozen data produced by the recorders: statistics, ids, shapes and dtypes, never tensors."""
from torch_nbdebug.data.stats import TensorStats

__all__ = ["TensorStats"]
