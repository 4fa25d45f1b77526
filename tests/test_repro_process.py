"""The pure decisions of %%repro on hand-built traces: every cause, including the CUDA-only ones (fakes)."""
from __future__ import annotations

from typing import Any

import pytest

from torch_nbdebug.data.repro import Fingerprint, OpPlace, OpTrace, Settings, diff_size, nondeterministic_on
from torch_nbdebug.process.repro import (compare_op, explain, find_divergence, first_op, hint, missing_ops,
                                         nondeterministic_uses, preflight, summarize)


def fp(bits: int, *sample: float, shape: tuple[int, ...] = (4,)) -> Fingerprint:
    return Fingerprint(shape=shape, dtype="float32", bits=bits, sample=sample)


def op(name: str, inputs: tuple[Any, ...] = (), outputs: tuple[Any, ...] = (), **kw: Any) -> OpTrace:
    names = kw.pop("input_names", tuple(f"in{i}" for i in range(len(inputs))))
    origins = kw.pop("input_origins", tuple(None for _ in inputs))
    return OpTrace(op=name, phase=kw.pop("phase", "forward"), scalars=kw.pop("scalars", 0), inputs=inputs,
                   outputs=outputs, input_names=names, input_origins=origins, **kw)


def run(*ops: OpTrace) -> list[OpTrace]:
    return list(ops)


MM = op("aten.mm.default", ((0, 0), fp(5, 1.0)), (fp(7, 2.0),))


def test_identical_runs_have_no_divergence() -> None:
    a = run(op("aten.randn.default", (), (fp(1),), random=True), MM)
    assert find_divergence(a, list(a)) is None and missing_ops(a, a) is None
    summary = summarize(None, None, None, restore_rng=True)
    assert summary.identical and summary.cause is None and summary.hint == ""


def test_nondeterministic_op_cuda_atomics_fake() -> None:
    """index_add_ on CUDA: same inputs, different last bits -> nondeterministic_op, with its size."""
    ins = (fp(3, 0.0, shape=(100, 64)), (0, 0), fp(9, 5.0, shape=(1000, 64)))
    a = run(op("aten.index_add_.default", ins, (fp(11, 10.0, 2.0, shape=(100, 64)),), device="cuda"))
    b = run(op("aten.index_add_.default", ins, (fp(12, 10.0 + 1e-6, 2.0, shape=(100, 64)),), device="cuda"))
    d = find_divergence(a, b)
    assert d is not None and (d.index, d.kind, d.slot) == (0, "output", 0)
    assert explain(d, a, b, restore_rng=True) == "nondeterministic_op"
    first = first_op(d, a, b, OpPlace("emb", "<cell>", 3), "out.index_add_(0, idx, rows)")
    assert first is not None and (first.op, first.module, first.lineno, first.phase) == \
        ("aten.index_add_.default", "emb", 3, "forward")
    assert first.max_abs_diff == pytest.approx(1e-6, rel=1e-3) and first.input is None
    assert "use_deterministic_algorithms(True)" in hint("nondeterministic_op", first, True)


def test_nondeterministic_table_by_device() -> None:
    assert nondeterministic_on("aten.index_add_.default", "cuda:0")
    assert not nondeterministic_on("aten.index_add_.default", "cpu")
    assert nondeterministic_on("aten.index_copy_.default", "cpu")
    assert nondeterministic_on("scatter_add_", "cuda")
    uses = nondeterministic_uses({("aten.scatter_add_.default", "cuda"): [3, OpPlace(None, "<cell>", 7)],
                                  ("aten.mm.default", "cuda"): [1, None]},
                                 {("aten.scatter_add_.default", "cuda"): "y.scatter_add_(0, i, v)"})
    assert [(u.op, u.count, u.lineno, u.line) for u in uses] == \
        [("aten.scatter_add_.default", 3, 7, "y.scatter_add_(0, i, v)")]


def test_backward_op_keeps_its_phase() -> None:
    a = run(MM, op("aten.embedding_dense_backward.default", ((0, 0),), (fp(1),), phase="backward", device="cuda"))
    b = run(MM, op("aten.embedding_dense_backward.default", ((0, 0),), (fp(2),), phase="backward", device="cuda"))
    d = find_divergence(a, b)
    first = first_op(d, a, b, OpPlace("model.wte", "<cell>", 2), "")  # type: ignore[arg-type]
    assert first is not None and (first.index, first.phase, first.module) == (1, "backward", "model.wte")


def test_rng_random_op_differs() -> None:
    a = run(op("aten.bernoulli_.float", ((0, 0),), (fp(1, 4.0),), random=True))
    b = run(op("aten.bernoulli_.float", ((0, 0),), (fp(2, 2.0),), random=True))
    d = find_divergence(a, b)
    assert d is not None and explain(d, a, b, restore_rng=False) == "rng"
    assert "--no-restore-rng" in hint("rng", None, restore_rng=False)
    assert "torch.Generator" in hint("rng", None, restore_rng=True)


def test_uninitialized_read() -> None:
    a = run(op("aten.empty.memory_format", (), ("uninitialized@0",)),
            op("aten.add_.Tensor", (fp(1),), (fp(2),), input_origins=("uninitialized",), reads_uninitialized=0))
    b = run(a[0], op("aten.add_.Tensor", (fp(8),), (fp(9),), input_origins=("uninitialized",), reads_uninitialized=0))
    d = find_divergence(a, b)
    assert d is not None and (d.index, d.kind, d.slot) == (1, "input", 0)
    assert explain(d, a, b, True) == "uninitialized"
    first = first_op(d, a, b, None, "", allocated_at="line 1: buf = torch.empty(4)")
    assert first is not None and first.input is not None and "torch.empty" in first.input
    assert first.allocated_at == "line 1: buf = torch.empty(4)"


@pytest.mark.parametrize("origin, cause", [("python_data", "external"), ("not_in_snapshot", "external"),
                                           (None, "external"), ("state:model.w", "unknown")])
def test_input_from_outside(origin: Any, cause: str) -> None:
    a = run(op("aten.mul.Tensor", (fp(1), (0, 0)), (fp(3),), input_origins=(origin, None)))
    b = run(op("aten.mul.Tensor", (fp(2), (0, 0)), (fp(4),), input_origins=(origin, None)))
    d = find_divergence(a, b)
    assert d is not None and d.kind == "input" and explain(d, a, b, True) == cause


def test_python_number_argument_is_external() -> None:
    a, b = run(op("aten.mul.Tensor", ((0, 0),), (fp(1, 1.0),), scalars=1)), run(op("aten.mul.Tensor", ((0, 0),), (fp(2, 3.0),), scalars=2))
    d = compare_op(0, a[0], b[0])
    assert d is not None and d.kind == "input" and d.slot is None
    assert explain(d, a, b, True) == "external"
    first = first_op(d, a, b, None, "")
    assert first is not None and first.max_abs_diff == pytest.approx(2.0)  # sized by the outputs


def test_control_flow_divergence() -> None:
    a, b = run(MM, op("aten.relu.default")), run(MM, op("aten.tanh.default"))
    d = find_divergence(a, b)
    assert d is not None and (d.index, d.kind) == (1, "sequence") and explain(d, a, b, True) == "external"
    d = missing_ops(a, a[:1])
    assert d is not None and d.kind == "sequence" and d.index == 1


def test_diff_size_is_a_lower_bound() -> None:
    assert diff_size(fp(1, 4.0, 1.0), fp(2, 0.0, 1.5)) == 4.0  # the largest sampled gap
    assert diff_size(fp(1, 4.0), fp(2, 4.0)) is None  # only unsampled elements differ
    assert diff_size(fp(1, shape=(2,)), fp(1, shape=(3,))) is None
    assert fp(1, float("nan")).same(fp(1, float("nan")))


def test_preflight() -> None:
    gpu = {p.name: p for p in preflight(Settings(cuda_used=True, cudnn_benchmark=True, loaders=("train_loader",)))}
    assert gpu["torch.use_deterministic_algorithms"].status == "warn"
    assert gpu["CUBLAS_WORKSPACE_CONFIG"].status == "warn" and gpu["torch.backends.cudnn.benchmark"].status == "warn"
    assert gpu["DataLoader train_loader"].status == "warn"
    cpu = {p.name: p for p in preflight(Settings(deterministic=True, cublas_workspace=":4096:8"))}
    assert cpu["torch.use_deterministic_algorithms"].status == "ok" and cpu["CUBLAS_WORKSPACE_CONFIG"].status == "ok"
