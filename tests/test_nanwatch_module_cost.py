"""The module layer's cost, counted in ATen ops and host reads, and that its table shows the precise numbers.

The layer table (min/max/mean of each module output and of the gradient into it) costs one ``aminmax``
and one ``sum`` per reading on every path: read at once on the CPU, left on the device and stacked with
the other waiting readings on the deferred (CUDA) path, computed when the model returns for the kept
outputs of ``replay=True``. Whatever the path, the numbers are those of reading each tensor on its own.
"""
from __future__ import annotations

import collections
import inspect
import math
from typing import Any, Callable, Optional

import pytest
import torch
from torch import nn

from host_syncs import OpCount, SmallGPT, counting_host_syncs
from torch_nbdebug.api.nanwatch import nanwatch
from torch_nbdebug.record import compat
from torch_nbdebug.record.modules import ModuleNamer, qualified_names
from torch_nbdebug.record.nanwatch.checks.deferred import _flags, reading_flags
from torch_nbdebug.record.nanwatch.core.layers import LayerRecorder, first_float_tensor, stat_values

def test_a_deferred_reading_is_two_reductions_and_the_readings_are_stacked_once() -> None:
    """On the device each reading is ``aminmax`` and ``sum`` (no casts, no division, no stack per
    reading); the flush stacks every waiting reading in one op before the one transfer."""
    rec = LayerRecorder(deferred=True)
    tensors = [torch.randn(4, 8) * (i + 1) for i in range(5)]
    with OpCount() as made:
        for i, t in enumerate(tensors):
            assert rec.forward(f"m{i}", t) is None
    assert made.ops == {"aminmax": 5, "sum": 5}
    assert rec.backlog == 5
    with OpCount() as flushed:
        taken = rec.take_pending()
    assert flushed.ops == {"stack": 1} and len(taken) == 1 and rec.backlog == 0
    assert all(row.fwd_min is None for row in rec.rows(set()))  # handed over: nothing applied yet
    flat = taken[0][1].tolist()
    rec.apply(taken, [flat])
    for i, t in enumerate(tensors):
        row = {r.module: r for r in rec.rows(set())}[f"m{i}"]
        assert [row.fwd_min, row.fwd_max, row.fwd_mean] == stat_values(t)


def test_deferred_readings_of_several_dtypes_are_grouped_and_exact() -> None:
    """float64 statistics stay float64; half types are summed in float32 (as read at once)."""
    rec = LayerRecorder(deferred=True)
    tensors = {"f32": torch.randn(3, 5), "f64": torch.randn(7, dtype=torch.float64) * 1e10,
               "bf16": (torch.randn(6) * 100).bfloat16(), "f16": torch.randn(9).half()}
    for path, t in tensors.items():
        rec.forward(path, t)
        rec.gradient(path, t * 2)
    taken = rec.take_pending()
    assert sorted(str(t.dtype) for _, t in taken) == ["torch.float32", "torch.float64"]
    rec.apply(taken, [t.tolist() for _, t in taken])
    rows = {row.module: row for row in rec.rows(set())}
    for path, t in tensors.items():
        row = rows[path]
        assert [row.fwd_min, row.fwd_max, row.fwd_mean] == stat_values(t)
        assert [row.grad_min, row.grad_max, row.grad_mean] == stat_values(t * 2)
        assert row.fwd_finite is True and row.grad_finite is True


def test_a_non_finite_deferred_reading_is_kept_as_the_first_bad_one() -> None:
    rec = LayerRecorder(deferred=True)
    rec.enter("m")
    rec.forward("m", torch.tensor([1.0, float("nan")]))
    rec.enter("m")
    rec.forward("m", torch.tensor([2.0, 4.0]))
    (row,) = rec.rows(set())
    assert (row.calls, row.fwd_finite, row.fwd_min, row.fwd_max, row.fwd_mean) == (2, False, None, None, None)


class Net(nn.Module):
    """Containers returning a child's output, an in-place ReLU after a layer, a tuple output."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.LayerNorm(16), nn.Linear(16, 16))
        self.split = Pair()
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.split(self.body(x))
        return self.head(a * b)


class Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.tanh(), x.sigmoid()


def _reference(model: nn.Module, run: Callable[[], None]) -> tuple[dict, dict]:
    """Each module's output and output-gradient statistics, read on their own as each module exits."""
    fwd: dict[str, list[float]] = {}
    grad: dict[str, list[float]] = {}
    names = {m: "model" + ("." + n if n else "") for n, m in model.named_modules()}
    handles = []

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        t = first_float_tensor(output)
        if t is not None:
            path = names[module]
            fwd[path] = stat_values(t)
            if t.requires_grad:
                def read(g: torch.Tensor) -> None:  # returns None: the gradient is left as it is
                    grad[path] = stat_values(g)
                t.register_hook(read)
    for module in model.modules():
        handles.append(module.register_forward_hook(hook))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return fwd, grad


@pytest.mark.parametrize("options", [dict(mode="module"), dict(mode="module", defer=True), dict(),
                                     dict(replay=False)], ids=["module", "module-deferred", "replay", "always"])
def test_the_table_shows_each_outputs_own_statistics(options: dict) -> None:
    """Batched, deferred or kept, every row is the statistics of that module's own output (read before
    the in-place ReLU that follows it) and of the gradient into it, bit for bit."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(5, 8)

    def run() -> None:
        model.zero_grad()
        model(x).square().sum().backward()

    fwd, grad = _reference(model, run)
    with nanwatch(namespace={"model": model}, **options) as report:
        run()
    rows = {row.module: row for row in report.layers}
    assert report.events == ()
    assert set(rows) == set(fwd)
    for path, values in fwd.items():
        row = rows[path]
        assert [row.fwd_min, row.fwd_max, row.fwd_mean] == values, path
        assert [row.grad_min, row.grad_max, row.grad_mean] == grad[path], path
    assert rows["model.body.0"].fwd_min < 0 and rows["model.body.1"].fwd_min == 0.0  # before and after ReLU_


def _ops_of(run: Callable[[], Any], watch: Optional[Callable[[], Any]]) -> collections.Counter:
    with OpCount() as counted:
        if watch is None:
            run()
        else:
            with watch():
                run()
    return counted.ops


def test_module_mode_costs_one_aminmax_and_one_sum_per_distinct_output() -> None:
    """A forward under ``mode="module"`` adds two reductions per module output and nothing else that
    computes (a container returning its child's output is not read again)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 2))
    x = torch.randn(3, 8)
    with torch.no_grad():
        plain = _ops_of(lambda: model(x), None)
        watched = _ops_of(lambda: model(x), lambda: nanwatch(mode="module", namespace={"model": model}))
    extra = watched - plain
    distinct = 4  # model.0, model.1.0, model.1.1 (model.1 returns it), model.2 (model returns it)
    assert extra["aminmax"] == distinct and extra["sum"] == distinct
    assert set(extra) <= {"aminmax", "sum", "_local_scalar_dense"}  # reading a CPU scalar


def test_kept_outputs_on_a_device_are_read_once_per_model_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """``replay=True``, outputs on a device (CUDA: the CPU stands in, its read-at-exit switched off): the
    module outputs of a forward are read together, with one host read, when the model returns (not one
    read per module)."""
    from torch_nbdebug.record.nanwatch.replay import outputs as nanwatch_modules

    monkeypatch.setattr(nanwatch_modules, "READ_AT_EXIT", False)
    model, idx = SmallGPT(), torch.randint(0, 512, (2, 16))
    with nanwatch(namespace={"model": model}) as report:
        with torch.no_grad():
            model(idx)  # the first call: the watch's own first-call work is not what is counted
            with counting_host_syncs() as syncs:
                for _ in range(3):
                    model(idx)
    assert syncs.count == 3, syncs.calls
    assert report.events == () and len(report.layers) > 10


def test_kept_outputs_are_read_as_each_module_returns_no_more_than_module_mode_reads() -> None:
    """``replay=True`` on a CPU reads each module output as its module returns (reading a CPU scalar is
    no synchronisation), as ``mode="module"`` does, and nothing more when the model returns."""
    model, idx = SmallGPT(), torch.randint(0, 512, (2, 16))
    counts = {}
    for mode in ("op", "module"):
        with nanwatch(mode=mode, namespace={"model": model}) as report:
            with torch.no_grad():
                model(idx)  # the first call: the watch's own first-call work is not what is counted
                with counting_host_syncs() as syncs:
                    for _ in range(3):
                        model(idx)
        assert report.events == () and len(report.layers) > 10
        counts[mode] = syncs.count
    assert counts["op"] == counts["module"] > 0


class _Shared(nn.Module):
    """A module tree with a shared child, a shared parameter, an empty slot and a None parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Sequential(nn.Linear(3, 3), self.a, None)  # type: ignore[arg-type]
        self.c = nn.Linear(3, 3)
        self.c.weight = self.b[0].weight
        self.register_parameter("nothing", None)
        self.scale = nn.Parameter(torch.ones(()))


class _OwnParameters(nn.Module):
    """A module listing only some of its parameters (its own ``parameters()`` must be asked)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept, self.hidden = nn.Linear(2, 2), nn.Linear(2, 2)

    def parameters(self, recurse: bool = True) -> Any:  # type: ignore[override]
        return self.kept.parameters(recurse)


@pytest.mark.parametrize("make", [_Shared, SmallGPT, _OwnParameters, lambda: nn.Sequential(_OwnParameters())],
                         ids=["shared", "gpt", "own-parameters", "own-parameters-inside"])
def test_the_fast_parameter_walk_lists_what_parameters_lists(make: Callable[[], nn.Module]) -> None:
    """The model call's weights (kept for the backward's replay) are ``module.parameters()``: the same
    tensors in the same order, shared ones once, whatever the tree."""
    from torch_nbdebug.record.nanwatch.replay.forward import parameters_of

    module = make()
    assert [id(p) for p in parameters_of(module)] == [id(p) for p in module.parameters()]


class _ClassInplace(nn.Module):
    inplace = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.relu_()


class _PropertyInplace(nn.Module):
    def __init__(self, on: bool) -> None:
        super().__init__()
        self.on = on

    @property
    def inplace(self) -> bool:
        return self.on


class _Forwarding(nn.Module):
    """A wrapper whose ``__getattr__`` forwards unknown names to the module it wraps (as FSDP does)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)


@pytest.mark.parametrize("module", [nn.ReLU(inplace=True), nn.ReLU(), nn.Linear(2, 2), nn.Dropout(inplace=True),
                                    _ClassInplace(), _PropertyInplace(True), _PropertyInplace(False),
                                    _Forwarding(nn.ReLU(inplace=True)), _Forwarding(nn.ReLU())],
                         ids=lambda m: type(m).__name__ + ("-on" if getattr(m, "inplace", False) else ""))
def test_an_inplace_module_is_known_as_getattr_knows_it(module: nn.Module) -> None:
    """The check before an in-place module runs (it may overwrite a kept output) asks what
    ``getattr(module, "inplace", False) is True`` says, for instance attributes, class attributes,
    properties and modules forwarding attribute lookups."""
    from torch_nbdebug.record.nanwatch.replay.outputs import declares_inplace

    assert declares_inplace(module) is (getattr(module, "inplace", False) is True)


def test_a_call_keeps_the_versions_its_arguments_had_when_it_started() -> None:
    """The positional tensors' versions are those at the call's start (a forward writing its own input
    cannot be replayed); keyword tensors are read as the call returns; autocast is recorded as on."""
    from torch_nbdebug.record.nanwatch.replay.forward import call_start, capture

    x, y, z = torch.randn(3), torch.randn(3), torch.randn(3)
    start = call_start((x, 2.0, y))
    x.add_(1)
    call = capture((x, 2.0, y), {"mask": z, "n": 3}, start)
    assert call.tensors == (x, y, z) and call.versions == (0, 0, 0) and call.changed()
    assert call.autocast == ()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert capture((y,), {}, None).autocast == (("cpu", torch.bfloat16),)
    assert capture((y,), {}, None).versions == (0,) and not capture((y,), {}, None).changed()


def test_a_finite_forward_walks_up_the_stack_once_for_the_model_call_and_has_the_users_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A finite forward reads the user's line once, at the model call's exit: the model call (which
    names backward births) has the line that called the model, with no module and no op."""
    from torch_nbdebug.record.nanwatch.replay import kept as nanwatch_kept

    walks: list[Optional[str]] = []
    real_here = nanwatch_kept.here

    def counting_here(module: Optional[str], op: Any, start: Any = None) -> Any:
        walks.append(module)
        return real_here(module, op, start if start is not None else inspect.currentframe().f_back)  # type: ignore[union-attr]

    monkeypatch.setattr(nanwatch_kept, "here", counting_here)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(2, 4)
    watch = nanwatch(namespace={"model": model})
    with watch:
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        out = model(x)
        calls = list(watch._recorder.model_calls.calls)
        out.sum().backward()
    assert walks == ["model"]  # finite outputs need no line: only the model call's (it names backward births)
    assert len(calls) == 1
    module, _call, _end, place = calls[0]
    assert module is model
    assert place.module is None and place.op is None
    assert (place.filename, place.lineno) == (__file__, line)
    assert place.function == "test_a_finite_forward_walks_up_the_stack_once_for_the_model_call_and_has_the_users_line"


def test_the_exit_hook_is_never_traced_by_dynamo() -> None:
    """``not_traced(hook)`` runs the hook as ``torch.compiler.disable(hook)`` would: called with its
    arguments, its result returned, and never while Dynamo traces a compiled function that calls it."""
    from torch_nbdebug.record.nanwatch.modules.tracker import not_traced

    seen: list[bool] = []

    def hook(a: torch.Tensor, b: int) -> int:
        seen.append(torch.compiler.is_compiling())
        return b + 1

    wrapped = not_traced(hook)
    assert wrapped(torch.ones(1), 2) == 3 and seen == [False]
    with nanwatch(namespace={}):  # its hooks are this package's: a replay in another watch runs despite them
        assert compat.global_module_hook_ids("torch_nbdebug") == set()
        assert compat.global_module_hook_ids()
    assert not_traced(hook).func is wrapped.func  # one disabled trampoline, made once

    @torch.compile(backend="eager")
    def f(x: torch.Tensor) -> torch.Tensor:
        wrapped(x, 1)
        return x + 1

    torch._dynamo.reset()
    try:
        assert torch.equal(f(torch.zeros(2)), torch.ones(2))
    finally:
        torch._dynamo.reset()
    assert seen == [False, False]


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_a_models_module_paths_follow_every_change_to_its_tree() -> None:
    """A child replaced, added, renamed, swapped or removed is named by its new path at the next start."""
    model = _Two()
    ns = {"model": model}

    def paths() -> dict[str, nn.Module]:
        namer = ModuleNamer(ns)
        return {namer.name(m, "?"): m for m in model.modules()}

    assert paths() == {"model": model, "model.a": model.a, "model.b": model.b}
    model.a = nn.Linear(2, 2)  # replaced
    assert paths()["model.a"] is model.a
    model.a, model.b = model.b, model.a  # swapped: same children, other names
    assert paths() == {"model": model, "model.a": model.a, "model.b": model.b}
    model.add_module("c", nn.Sequential(nn.ReLU()))  # added, with a child of its own
    assert paths()["model.c.0"] is model.c[0]
    model.c[0] = nn.GELU()  # a grandchild replaced
    assert paths()["model.c.0"] is model.c[0]
    del model.c
    assert "model.c" not in paths() and "model.c.0" not in paths()
    with nanwatch(mode="module", namespace=ns) as report:
        model(torch.randn(3, 2))
    assert [row.module for row in report.layers] == ["model", "model.a", "model.b"]


class _ByConfig(nn.Module):
    """A model class with value equality: two instances of one width compare (and hash) equal."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width, self.fc, self.out = width, nn.Linear(2, width), nn.Linear(width, 1)

    def __eq__(self, other: object) -> bool:
        return type(other) is _ByConfig and other.width == self.width

    def __hash__(self) -> int:
        return hash(("_ByConfig", self.width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.out(self.fc(x)) - 1e6)  # NaN born in the model


@pytest.mark.parametrize("mode", ["op", "module"])
def test_equal_models_get_their_own_paths(mode: str) -> None:
    """Modules are told apart by identity: a second model equal to the first (by its class's
    ``__eq__``) gets its own paths, not the first model's."""
    teacher, student = _ByConfig(4), _ByConfig(4)
    assert teacher == student and hash(teacher) == hash(student)
    assert qualified_names([("teacher", teacher)])[id(teacher.fc)] == "teacher.fc"
    assert qualified_names([("student", student)])[id(student.fc)] == "student.fc"
    with nanwatch(mode=mode, namespace={"teacher": teacher, "student": student}) as report:
        student(torch.ones(1, 2))
    assert [e.module for e in report.events] == ["student"]
    assert [row.module for row in report.layers] == ["student", "student.fc", "student.out"]


class _Births(nn.Module):
    """A module output with a NaN, one with +inf, or a NaN gradient into the model's output."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.case, self.fc = case, nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.case == "nan":
            return (h.abs() + 1).neg().log()
        if self.case == "inf":
            return (h.abs() * 1e30).exp()
        return h


@pytest.mark.parametrize("case", ["nan", "inf", "gradient"])
def test_deferred_module_mode_reports_what_the_immediate_one_reports(case: str) -> None:
    """The deferred module check judges an output (and the gradient into it) from the layer table's
    reading of it, not from a second reduction: same births, kinds and modules as reading at once."""
    torch.manual_seed(0)
    model, x = _Births(case), torch.randn(3, 4)
    found = []
    for defer in (False, True):
        with nanwatch(mode="module", defer=defer, namespace={"model": model}) as report:
            y = model(x)
            (y * 0).sqrt().sum().backward() if case == "gradient" else y.sum().backward()
        found.append([(e.phase, e.module, e.op, e.kind) for e in report.events])
    assert found[0] and found[1] == found[0]


_SPECIAL = {"nan": [1.0, math.nan], "+inf": [1.0, math.inf], "-inf": [1.0, -math.inf], "both": [math.inf, -math.inf],
            "huge": [3e38, 3e38], "huge64": [1e308, 1e308], "negative": [-2.0, 1.0], "fine": [1.0, 2.0]}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("case", list(_SPECIAL))
def test_flags_from_the_tables_reading_are_those_of_the_float64_sum(case: str, dtype: torch.dtype) -> None:
    """The deferred module check judges an output from its layer reading exactly as the float64 sum
    of the other deferred checks would: huge finite float64 values overflow it (an event), huge
    finite values of narrower types do not."""
    t = torch.tensor(_SPECIAL[case], dtype=torch.float64).to(dtype)
    (total,) = _flags([t]).tolist()
    expected = (not math.isfinite(total), total != total)
    flags = reading_flags(stat_values(t), dtype is torch.float64)
    assert flags[:2] == expected
    if flags[0] and not flags[1]:  # an infinity's sign is what the event says
        assert flags[2] == (total < 0)


class _Huge64(nn.Module):
    """float64 values whose float64 sum overflows (in the output, or in the gradient into it)."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.case, self.fc = case, nn.Linear(2, 2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y * 0 + 1e308 if self.case == "output" else y


@pytest.mark.parametrize("case", ["output", "gradient"])
def test_deferred_module_mode_reports_a_float64_sum_that_overflows(case: str) -> None:
    found = []
    for defer in (False, True):
        model, x = _Huge64(case), torch.ones(3, 2, dtype=torch.float64)
        with nanwatch(mode="module", defer=defer, namespace={"model": model}) as report:
            y = model(x)
            (y * 0.5e308).sum().backward() if case == "gradient" else y.sum().backward()
        found.append([(e.phase, e.module, e.op, e.kind) for e in report.events])
    assert found[0] and found[1] == found[0]


# -- the compiled-code note (its frame search stops at the enclosing module call) ---------------------------
def test_a_compiled_function_called_inside_a_model_is_named() -> None:
    """The compiled code around a module call is looked for between it and the enclosing module's
    call only (above that, the enclosing call's own look found it): a compiled helper that a model's
    forward calls is still named in the note."""
    import torch._dynamo  # noqa: F401 - the watch sets the eager stance only once dynamo is loaded

    inner = nn.Linear(2, 2)
    helper = torch.compile(lambda x: inner(x).relu(), backend="eager")

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return helper(self.fc(x))

    model = Outer()
    try:
        with nanwatch(mode="module", namespace={"model": model}) as report:
            model(torch.randn(3, 2))
    finally:
        torch._dynamo.reset()
    notes = [n for n in report.notes if "torch.compile" in n]
    assert len(notes) == 1 and "(<lambda>)" in notes[0], report.notes


def test_a_flush_with_one_extra_tensor_still_replays_the_queued_entries_without_flags() -> None:
    """``defer=True``: a flush given one tensor of its own (an optimizer's norms, GradScaler's check) while
    the queue holds an entry with no device flags (a backward node whose gradients were all written by
    queued ops) reads them together: the entry is replayed, its held birth committed in order."""
    from torch_nbdebug.data.nanwatch import NanEvent
    from torch_nbdebug.record.nanwatch.recorder import NanRecorder
    from torch_nbdebug.record.nanwatch.checks.queued import NodeCheck

    rec = NanRecorder(defer=True)
    rec.log._held[7] = [NanEvent(phase="backward", op="SqrtBackward0", kind="inf")]
    rec.deferred.pending.append(NodeCheck(None, (123,), 7))
    assert rec.flush([torch.tensor([1.0, 2.0])]) == [[1.0, 2.0]]
    assert not rec.deferred.pending and not rec.log._held
    assert [(e.phase, e.op) for e in rec.log.events] == [("backward", "SqrtBackward0")]
