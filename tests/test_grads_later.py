"""The exact last step of a recording computed when first read (issue 27's decision), from a copy of its
gradients taken at the block's end: the same numbers as computing it at the end, for every reader; the copy
bounded, never the user's tensors, dropped once used, at most one in a process; failures said in the view."""
from __future__ import annotations

import gc
import json
import math
import weakref
from typing import Any, Iterator

import numpy as np
import pytest
import torch
from torch import nn

from host_syncs import counting_host_syncs
from torch_nbdebug.api.grads import GradRecording, record_gradients
from torch_nbdebug.api.tensorboard import write_grads
from torch_nbdebug.data.grads import FIELD
from torch_nbdebug.record.grads import last as last_mod
from torch_nbdebug.record.grads import recorder as rec_mod
from torch_nbdebug.record.grads.last import COPY_SHARE_OF_FREE, LazyTrace, copy_fits


class Odd(nn.Module):
    """Sampled and whole parameters, a matrix with dead units, a nearly constant gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(64, 96)     # 6144 weights: sampled with sample=512
        self.mid = nn.Linear(96, 8)      # 768 weights: whole
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mid(torch.tanh(self.emb(x)))))


def _train(model: nn.Module, steps: int, spoil: Any = None) -> None:
    """``steps`` SGD steps; ``spoil(step, model)`` may change the gradients before each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 64)).pow(2).sum().backward()
        if spoil is not None:
            spoil(step, model)
        opt.step()


def _nan_in_sampled(step: int, model: nn.Module) -> None:
    model.emb.weight.grad[3, 7] = math.nan
    model.emb.weight.grad[1, 2] = math.inf


def _huge(step: int, model: nn.Module) -> None:
    model.emb.weight.grad.mul_(1e20)  # finite, but its float32 sum of squares overflows
    model.mid.weight.grad[:2] = 0.0   # dead units of a whole matrix
    model.head.bias.grad.fill_(0.5)   # constant: its variance taken again in float64


def _pair(model: nn.Module, steps: int, spoil: Any = None, **options: Any) -> tuple[GradRecording, GradRecording]:
    """Two recordings of the very same steps: one computing the exact last step at the block's end (no
    copy allowed), one when first read."""
    lazy = record_gradients(model, name="m", **options)
    eager = record_gradients(model, name="m", **options)
    eager._recorder.copy_limit = 0  # type: ignore[union-attr]
    with lazy, eager:
        _train(model, steps, spoil)
    assert isinstance(lazy._later, LazyTrace) and lazy._later.pending and eager._later is None
    return lazy, eager


def _same(lazy: GradRecording, eager: GradRecording) -> None:
    """Every reader gets the same numbers: the trace's arrays, its export, the flags, the text view."""
    a, b = lazy.trace, eager.trace
    for name in ("stats", "exact", "hist", "hist_range"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert a.notes == b.notes and a.steps == b.steps and a.hist_rows == b.hist_rows
    assert json.dumps(a.to_dict()) == json.dumps(b.to_dict())
    assert json.loads(lazy.to_json())["ranks"][0]["report"] == json.loads(eager.to_json())["ranks"][0]["report"]
    assert lazy.flags == eager.flags and lazy.start_layer == eager.start_layer
    assert lazy.text() == eager.text() and lazy.html() == eager.html()
    assert _tensorboard(lazy) == _tensorboard(eager)


class _Writer:
    """What a TensorBoard writer is asked to write, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: self.calls.append((name, args, sorted(kwargs.items())))


def _tensorboard(rec: GradRecording) -> list[tuple[str, Any, Any]]:
    writer = _Writer()
    write_grads(writer, rec.trace)
    assert writer.calls
    return writer.calls


@pytest.mark.parametrize("spoil", [None, _nan_in_sampled, _huge], ids=["finite", "nan-inf", "overflow-dead-constant"])
def test_the_last_step_made_exact_when_first_read_equals_the_one_made_at_the_end(spoil: Any) -> None:
    torch.manual_seed(0)
    lazy, eager = _pair(Odd(), 3, spoil, sample=512, bins=16)
    assert lazy.trace.exact[-1].all()
    _same(lazy, eager)
    if spoil is _huge:  # the numbers this case is about
        w = lazy.layer("mid").param("weight")
        assert w.dead_units == 2 and math.isfinite(lazy.layer("emb").param("weight").norm)


def test_the_copy_is_no_reference_to_the_users_gradients() -> None:
    """The model's gradients freed, then changed in place after the block: the last step is still the step's."""
    torch.manual_seed(0)
    model = Odd()
    lazy, eager = _pair(model, 2, sample=512)
    grad = weakref.ref(model.emb.weight.grad)
    model.zero_grad(set_to_none=True)
    gc.collect()
    assert grad() is None  # the recording holds none of them
    _train(model, 1)
    model.emb.weight.grad.mul_(3.0)
    _same(lazy, eager)


def _recorded() -> tuple[GradRecording, LazyTrace]:
    """Three steps recorded, the trace not read yet."""
    torch.manual_seed(0)
    model = Odd()
    with record_gradients(model, name="m", sample=512) as rec:
        _train(model, 3)
    assert isinstance(rec._later, LazyTrace)
    return rec, rec._later


def test_reading_the_steps_and_layers_computes_nothing_the_trace_does_once() -> None:
    rec, later = _recorded()
    with counting_host_syncs() as counted:
        assert rec.steps == (0, 1, 2) and rec.layers == ("m.emb", "m.mid", "m.head")
        assert rec.step_kind == "optimizer" and len(rec.params) == 6
    assert counted.count == 0 and later.pending
    with counting_host_syncs() as counted:
        first = rec.trace
        assert rec.trace is first and rec.stats is first.stats
    assert counted.count == 2 and not later.pending and rec._later is None


def test_a_failure_when_first_read_is_a_note_in_the_view_not_an_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    """A device error surfacing at the first read: the view shows the recording, the last step as sampled,
    and says why it is not exact; the copy is dropped."""
    rec, later = _recorded()

    def device_error(tensors: list[torch.Tensor]) -> list[np.ndarray]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(last_mod, "to_host", device_error)
    text = rec.text()  # no exception
    assert not later.pending
    note = [n for n in rec.trace.notes if "exact statistics of the last step could not be computed" in n]
    assert len(note) == 1 and "RuntimeError: CUDA error: an illegal memory access" in note[0]
    assert "could not be computed" in text and rec.steps == (0, 1, 2)
    assert not rec.trace.exact[-1, rec.trace.params.index(next(p for p in rec.trace.params
                                                                   if p.name == "m.emb.weight"))]
    assert np.isfinite(rec.trace.stats[:, :, FIELD["norm"]]).all()  # the rest of the recording shows
    assert rec.html() and rec.widget() is not None and json.loads(rec.to_json())


def test_a_copy_that_does_not_fit_or_fails_makes_the_last_step_exact_at_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    model = Odd()
    size = sum(p.numel() * 4 for p in model.parameters())
    monkeypatch.setattr(rec_mod, "COPY_LIMIT", size - 1)  # a byte too small
    with record_gradients(model, name="m", sample=512) as rec:
        _train(model, 2)
    assert rec._later is None and rec.trace.exact[-1].all()
    monkeypatch.setattr(rec_mod, "COPY_LIMIT", size)
    clone = torch.Tensor.clone

    def out_of_memory(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    with record_gradients(model, name="m", sample=512) as rec:
        _train(model, 2)
        monkeypatch.setattr(torch.Tensor, "clone", out_of_memory)
    monkeypatch.setattr(torch.Tensor, "clone", clone)
    assert rec._later is None and rec.trace.exact[-1].all() and not any("could not" in n for n in rec.trace.notes)


def test_the_bound_counts_bytes_and_a_share_of_the_free_cuda_memory() -> None:
    t = torch.zeros(1000)  # 4000 bytes
    assert copy_fits([t, t], 8000) and not copy_fits([t, t], 7999)
    meta = torch.empty(1000, device="meta")
    # A CUDA tensor without a GPU: the device's type is all the bound reads (with its free memory).
    fake = type("Fake", (), {"device": torch.device("cuda", 0), "numel": lambda self: 1000,
                             "element_size": lambda self: 4})()
    assert copy_fits([fake], 1 << 20, free=lambda d: int(4000 / COPY_SHARE_OF_FREE))
    assert not copy_fits([fake], 1 << 20, free=lambda d: int(4000 / COPY_SHARE_OF_FREE) - 4)
    assert not copy_fits([meta], 1 << 20)  # a device whose free memory is not known: never kept


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[list["weakref.ref[torch.Tensor]"]]:
    """Weak references to every copy of gradients the recorder makes."""
    made: list["weakref.ref[torch.Tensor]"] = []

    class Watched(last_mod.LastCopy):
        def __init__(self, copies: list[torch.Tensor], *args: Any) -> None:
            made.extend(weakref.ref(c) for c in copies)
            super().__init__(copies, *args)

    monkeypatch.setattr(rec_mod, "LastCopy", Watched)
    yield made


def test_recordings_kept_unread_hold_one_copy_at_most(copies: list["weakref.ref[torch.Tensor]"]) -> None:
    """A long session keeping every recording, none read: each new block's end makes the previous one
    exact first, so one copy at most is alive; each kept recording reads as exact."""
    torch.manual_seed(0)
    model = Odd()
    kept = []
    for _ in range(12):
        with record_gradients(model, name="m", sample=512) as rec:
            _train(model, 2)
        kept.append(rec)
        gc.collect()
        alive = {id(ref()) for ref in copies if ref() is not None}
        assert 0 < len(alive) <= 6  # the six gradients of the last recording alone
        assert sum(r._later is not None and r._later.pending for r in kept) == 1
    assert all(r.trace.exact[-1].all() for r in kept)
    gc.collect()
    assert all(ref() is None for ref in copies)


def test_a_copy_failing_at_the_end_drops_the_copy_with_its_traceback_kept(
        copies: list["weakref.ref[torch.Tensor]"], monkeypatch: pytest.MonkeyPatch) -> None:
    """The end's flush fails after the copy was made: the error reaches the user, and the traceback (kept,
    as a notebook keeps it) holds neither the user's gradients nor their copy."""
    def device_error(tensors: list[torch.Tensor]) -> list[np.ndarray]:
        raise RuntimeError("CUDA error: device-side assert triggered")

    torch.manual_seed(0)
    model = Odd()
    monkeypatch.setattr(rec_mod, "to_host", device_error)
    with pytest.raises(RuntimeError, match="device-side assert") as failed:
        with record_gradients(model, name="m", sample=512):
            _train(model, 2)
    assert failed.value.__traceback__ is not None and copies
    gc.collect()
    assert all(ref() is None for ref in copies)
    assert torch.is_grad_enabled()
