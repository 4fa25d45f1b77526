"""What ``%explain`` knows about a failure: the facts read from a traceback, what a recording saw,
and the diagnosis built from them. Plain frozen data: names, shapes and line numbers, never tensors."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal, Optional

Kind = Literal["shape", "device", "dtype", "inplace", "graph_reuse", "no_grad", "index", "other"]
KINDS: tuple[str, ...] = ("shape", "device", "dtype", "inplace", "graph_reuse", "no_grad", "index", "other")
CutHow = Literal["no_grad", "detach", "data", "item", "numpy", "tolist", "tensor"]


@dataclass(frozen=True)
class Operand:
    """A tensor the failing line handed to the op: its name as written there, and where it came from."""

    name: str
    shape: Optional[tuple[int, ...]]
    dtype: str
    device: str
    producer: str = ""  # the module (``model.conv``) or line (``cell line 4``) that produced it
    requires_grad: bool = False
    node_seq: int = -1  # sequence number of the autograd node that made it (-1: none)

    def describe(self) -> str:
        shape = "x".join(str(s) for s in self.shape) if self.shape is not None else "?"
        text = f"{self.name}: [{shape}] {self.dtype} on {self.device}"
        return f"{text} (from {self.producer})" if self.producer else text


@dataclass(frozen=True)
class OpSite:
    """Where an op ran: the op, the module whose forward was running, and the user's line."""

    op: str
    module: str = ""
    filename: str = ""
    lineno: int = 0
    line: str = ""


@dataclass(frozen=True)
class InplaceEvent:
    """An in-place op seen by the recorder, with what its target was before it ran."""

    site: OpSite
    version: int  # the target's version counter after the op
    shape: tuple[int, ...]
    node: str  # the target's (or its base's) autograd node before the op, e.g. ``SigmoidBackward0``
    node_seq: int  # that node's sequence number (-1 when the target had none)


@dataclass(frozen=True)
class CutEvent:
    """Where a tensor that required grad gave a result that does not (the gradient chain was cut)."""

    how: CutHow
    site: OpSite


@dataclass(frozen=True)
class OptimizerStep:
    """An ``optimizer.step()`` seen by the recorder: it updates parameters in place."""

    site: OpSite  # op: ``AdamW.step``; the user's line that called it
    shapes: tuple[tuple[int, ...], ...]  # the shapes of the parameters it updated


@dataclass(frozen=True)
class Recording:
    """What a ``%%explain`` run recorded, reduced to what the diagnosis can use."""

    inplace: tuple[InplaceEvent, ...] = ()
    cuts: tuple[CutEvent, ...] = ()
    steps: tuple[OptimizerStep, ...] = ()
    sites: tuple[tuple[int, OpSite], ...] = ()  # sequence number -> where that autograd node was made
    # sequence number -> the user's line outside every forward that led to it (the line calling the model),
    # where it differs from the site
    outer: tuple[tuple[int, OpSite], ...] = ()
    backwards: tuple[OpSite, ...] = ()  # the last two ``.backward()`` calls (the failing one last)
    repeated_root: bool = False  # those two were called on the same tensor (not two losses of one graph)

    def site_of(self, seq: int) -> Optional[OpSite]:
        return next((site for s, site in self.sites if s == seq), None)

    def outer_of(self, seq: int) -> Optional[OpSite]:
        """The line outside every ``forward`` that led to node ``seq`` (None: the site is that line)."""
        return next((site for s, site in self.outer if s == seq), None)


@dataclass(frozen=True)
class FailureFacts:
    """What a traceback tells, read post mortem from its frames (no code re-run)."""

    exc_type: str
    message: str
    from_torch: bool  # the traceback went through torch, or the message is one of torch's
    filename: str = ""  # the user's innermost line
    lineno: int = 0
    line: str = ""
    call: str = ""  # the name of the call on the innermost line that failed (``linear``, ``cat``)
    module: str = ""  # the innermost nn.Module whose forward was running, as the user writes it
    module_type: str = ""
    module_repr: str = ""  # ``Linear(in_features=288, out_features=10, bias=True)``
    operands: tuple[Operand, ...] = ()
    model_input: Optional[tuple[int, ...]] = None  # shape of the outermost module's first input
    model_has_conv: bool = False
    index_value: Optional[int] = None  # the out-of-range index and the size it must stay below
    index_size: Optional[int] = None
    backward_of: str = ""  # the expression ``.backward()`` was called on
    freed_nodes: tuple[tuple[str, int], ...] = ()  # old-graph nodes (name, sequence number) reached
    freed_users: tuple[int, ...] = ()  # the newer node that reached each of them (sequence number; -1: the root)
    freed_root: bool = False  # the tensor backward() was called on is itself in the freed graph (twice)
    frozen_models: tuple[str, ...] = ()  # models in the namespace with no parameter requiring grad
    frozen_call: Optional[OpSite] = None  # the nearest line above the failing one calling a frozen module
    inplace_modules: tuple[str, ...] = ()  # modules of the running model that work in place
    # parameters of the namespace's models that were modified in place (name, shape, version counter)
    param_versions: tuple[tuple[str, tuple[int, ...], int], ...] = ()
    module_made_in_forward: bool = False  # ``module`` was made inside its owner's forward (never moved by .to())
    made_in_forward: tuple[str, ...] = ()  # operands the running forward made from nothing (``torch.ones(...)``)
    made_site: Optional[OpSite] = None  # the line of that forward that made it (``proj = nn.Linear(4, 4)``)
    loss: str = ""  # the torch.nn.functional loss the error came through (``mse_loss``), when it wants same shapes
    loss_shapes: tuple[tuple[int, ...], ...] = ()  # that loss's (input, target) shapes


@dataclass(frozen=True)
class Diagnosis:
    """The explanation of one PyTorch error: what kind, where, the culprit, the operands and the fix."""

    kind: Kind
    message: str
    exc_type: str = ""
    op: str = ""
    module: str = ""
    filename: str = ""
    lineno: int = 0
    line: str = ""
    culprit_op: str = ""
    culprit_module: str = ""
    culprit_lineno: int = 0
    culprit_line: str = ""
    culprit_filename: str = ""
    operands: tuple[Operand, ...] = ()
    hint: str = ""
    warning: str = ""  # a tempting fix that would hide the error (``loss.requires_grad = True``), said apart
    summary: str = ""  # one sentence: what went wrong where
    recorded: bool = False  # built with a %%explain recording (culprits known), not post mortem only
    suggest_record: bool = False  # a %%explain run would tell more (the culprit of an in-place error)
    restart_needed: bool = False  # a CUDA device-side assert broke the context
    note: str = ""  # how the run differed from a plain one (compiled code ran eagerly under the recorder)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
