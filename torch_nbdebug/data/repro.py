"""What ``%%repro`` found: frozen records of one op per run, the first divergence, and the report.

Fingerprints are plain numbers (shape, dtype, an exact sum of the bits and a few sampled values),
never tensors. The table of ops PyTorch documents as nondeterministic lives here, once,
so the recorder and the processors read the same rule.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Optional

Phase = Literal["forward", "backward", "optimizer"]
Cause = Literal["rng", "uninitialized", "external", "nondeterministic_op", "unknown"]
Kind = Literal["output", "input", "sequence", "state", "exception"]
Status = Literal["ok", "warn", "info"]
Origin = Literal["python_data", "changed_outside_torch", "not_in_snapshot", "uninitialized", "state"]

CAUSES: tuple[str, ...] = ("rng", "uninitialized", "external", "nondeterministic_op", "unknown")

# Ops documented as nondeterministic (``torch.use_deterministic_algorithms``), by ATen name -> devices.
# Most use atomic adds on CUDA; on CPU only a few (duplicate indices written in thread order).
_CUDA = frozenset({"cuda"})
_BOTH = frozenset({"cpu", "cuda"})
NONDETERMINISTIC_OPS: dict[str, frozenset[str]] = {
    **{name: _CUDA for name in (
        "index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
        "scatter", "scatter_", "index_put", "index_put_", "_index_put_impl_", "put", "put_",
        "embedding_dense_backward", "_embedding_bag_backward", "_embedding_bag_dense_backward",
        "avg_pool3d_backward", "_adaptive_avg_pool2d_backward", "_adaptive_avg_pool3d_backward",
        "max_pool3d_with_indices_backward", "adaptive_max_pool2d_backward",
        "fractional_max_pool2d_backward", "fractional_max_pool3d_backward",
        "upsample_linear1d_backward", "upsample_bilinear2d_backward", "upsample_bicubic2d_backward",
        "upsample_trilinear3d_backward", "reflection_pad1d_backward", "reflection_pad2d_backward",
        "reflection_pad3d_backward", "replication_pad1d_backward", "replication_pad2d_backward",
        "replication_pad3d_backward", "nll_loss2d_forward", "_ctc_loss_backward", "histc", "bincount",
        "kthvalue", "median", "nanmedian", "grid_sampler_2d_backward", "grid_sampler_3d_backward", "cumsum",
        "convolution_backward", "cudnn_convolution", "cudnn_convolution_transpose",
        "_scaled_dot_product_efficient_attention_backward", "_efficient_attention_backward",
    )},
    **{name: _BOTH for name in ("index_copy", "index_copy_", "max_unpool2d", "max_unpool3d")},
}


def nondeterministic_on(op_name: str, device: str) -> bool:
    """Whether PyTorch lists ``op_name`` (``aten.index_add_.default`` or ``index_add_``) as
    nondeterministic on ``device`` (``cuda``, ``cpu``, ``cuda:1``)."""
    base = op_name.split(".")[1] if op_name.startswith("aten.") else op_name.split(".")[0]
    return device.split(":")[0] in NONDETERMINISTIC_OPS.get(base, frozenset())


@dataclass(frozen=True)
class Fingerprint:
    """A tensor summarised by one exact reduction and a few sampled values: equal fingerprints mean
    equal bits (barring a 2**-32 hash collision)."""

    shape: tuple[int, ...]
    dtype: str
    bits: int = 0                       # sum of the raw bits viewed as integers (exact, wraps)
    sample: tuple[float, ...] = ()      # evenly spaced values (floats only): size a difference

    def same(self, other: "Fingerprint") -> bool:
        return (self.shape, self.dtype, self.bits) == (other.shape, other.dtype, other.bits) and \
            len(self.sample) == len(other.sample) and all(map(_same_float, self.sample, other.sample))

    def numel(self) -> int:
        return math.prod(self.shape)


def _same_float(a: float, b: float) -> bool:
    return a == b or (a != a and b != b)


def diff_size(a: Fingerprint, b: Fingerprint) -> Optional[float]:
    """The largest difference among the sampled values: a lower bound of ``max|a - b|`` (exact for
    tensors of up to 32 elements). None when it cannot be told: other shapes, or the sampled values
    agree and only other elements differ."""
    if a.shape != b.shape or a.dtype != b.dtype or not a.sample or len(a.sample) != len(b.sample):
        return None
    gaps = [abs(x - y) for x, y in zip(a.sample, b.sample) if not _same_float(x, y)]
    return max(gaps) if gaps else None


@dataclass(frozen=True)
class OpTrace:
    """One op of one run, as the comparison needs it."""

    op: str
    phase: Phase
    scalars: int                                  # hash of the non-tensor arguments
    inputs: tuple[Optional[Fingerprint], ...]     # None: a tensor without data (meta, fake, sparse)
    outputs: tuple[Optional[Fingerprint], ...]
    input_names: tuple[str, ...] = ()             # schema names of the tensor inputs (self, other, ...)
    input_origins: tuple[Optional[str], ...] = () # where an input not made by an earlier op came from
    random: bool = False                          # draws from a random generator
    reads_uninitialized: Optional[int] = None     # index of the torch.empty-like op whose memory it read
    device: str = "cpu"


@dataclass(frozen=True)
class OpPlace:
    """Where an op ran in the user's program (recorded in the second run, for the reported op)."""

    module: Optional[str] = None
    filename: Optional[str] = None
    lineno: Optional[int] = None
    line: str = ""


@dataclass(frozen=True)
class Divergence:
    """The first place the two runs differ, before any explanation."""

    index: int
    kind: Kind
    slot: Optional[int] = None   # which input/output
    detail: str = ""


@dataclass(frozen=True)
class ReproOp:
    """The first op whose output differs although its inputs agreed (or whose input came from outside)."""

    op: str
    module: Optional[str]
    filename: Optional[str]
    lineno: Optional[int]
    line: str
    phase: Phase
    max_abs_diff: Optional[float]
    input: Optional[str] = None          # the input that differed, when the difference came from upstream
    kind: Kind = "output"
    index: int = 0
    allocated_at: Optional[str] = None   # for 'uninitialized': the line that allocated the memory

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class NondeterministicUse:
    op: str
    device: str
    count: int
    filename: Optional[str] = None
    lineno: Optional[int] = None
    line: str = ""


@dataclass(frozen=True)
class PreflightItem:
    name: str
    value: str
    status: Status
    advice: str = ""


@dataclass(frozen=True)
class Settings:
    """Global settings that decide determinism, read before the runs."""

    deterministic: bool = False
    deterministic_warn_only: bool = False
    cublas_workspace: Optional[str] = None
    matmul_tf32: bool = False
    cudnn_tf32: bool = True
    cudnn_benchmark: bool = False
    cudnn_deterministic: bool = False
    cuda_used: bool = False
    loaders: tuple[str, ...] = ()    # DataLoaders with workers and no seeded generator / worker_init_fn


@dataclass(frozen=True)
class ReproSummary:
    identical: bool = True
    first: Optional[ReproOp] = None
    cause: Optional[Cause] = None
    hint: str = ""
    nondeterministic_ops: tuple[NondeterministicUse, ...] = ()
    preflight: tuple[PreflightItem, ...] = ()
    ops: tuple[int, int] = (0, 0)       # ops recorded in run 1, and compared in run 2
    state: tuple[str, ...] = ()         # what was snapshotted and restored before run 2
    restore_rng: bool = True
    notes: tuple[str, ...] = field(default_factory=tuple)
    # The first op (of the second run) that read memory a torch.empty-like op allocated before anything
    # wrote it - reported even when both runs happened to agree, since garbage can match by chance.
    uninitialized: Optional[ReproOp] = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
