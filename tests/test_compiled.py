"""A ``torch.compile``'d model still runs compiled after every tool (DESIGN.md section 3).

Dynamo marks a compiled frame "skip" for good when it is called under a TorchDispatchMode; the
watches (``nanwatch()``, ``memory_timeline()``) set the ``force_eager`` stance instead
(:class:`torch_nbdebug.record.compiled.CompiledCode`), say so in the report, and leave the compiled
code compiled. The witness is the output's ``grad_fn``: ``CompiledFunctionBackward`` when the compiled
graph ran, an eager node (``AddmmBackward0``) when it did not.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from typing import Any, Iterator

import pytest
import torch
from torch import nn

import torch_nbdebug as nb

COMPILED = "CompiledFunctionBackward"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def kind(t: torch.Tensor) -> str:
    return type(t.grad_fn).__name__


def stance() -> str:
    import torch._dynamo.eval_frame as eval_frame

    return eval_frame._stance.stance


_batches = iter(range(5, 10_000))


def assert_still_compiled(model: Any) -> None:
    """Compiled for the shape seen before and for a shape never seen (a recompile, not eager)."""
    assert stance() == "default"
    assert kind(model(torch.randn(3, 4))) == COMPILED
    assert kind(model(torch.randn(next(_batches), 4))) == COMPILED


@pytest.fixture(scope="module")
def compiled() -> Iterator[tuple[Net, Any]]:
    """One aot_eager-compiled model for the module (compiling is the slow part); dynamo reset after."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = Net()
    model = torch.compile(net, backend="aot_eager")
    assert kind(model(torch.randn(3, 4))) == COMPILED
    yield net, model
    torch._dynamo.reset()


@pytest.mark.parametrize("watch", ["nanwatch", "nanwatch-module", "memory_timeline", "explain", "repro", "profile"])
def test_a_compiled_model_called_inside_a_watch_gives_no_warning_about_the_watchs_own_hooks(
        compiled: tuple[Net, Any], watch: str) -> None:
    """Torch warns at every call of a ``torch.compile`` wrapper while global module hooks exist (they fire an
    extra time for the wrapper): the watches' hooks know the wrapper, the warning is not for the user. The
    user's warning filters are as they were afterwards."""
    _, model = compiled
    before = list(warnings.filters)
    blocks = {"nanwatch": nb.nanwatch, "nanwatch-module": lambda: nb.nanwatch(mode="module"),
              "memory_timeline": nb.memory_timeline, "explain": nb.explain, "profile": nb.profile}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if watch == "repro":
            nb.repro(lambda: model(torch.randn(3, 4)).sum())
        else:
            with blocks[watch]():
                model(torch.randn(3, 4)).sum().backward()
        inner = list(warnings.filters)
    assert not [w for w in seen if "global hooks" in str(w.message)], [str(w.message) for w in seen]
    assert inner[0][0] == "always" and list(warnings.filters) == before


# -- the watches with a dispatch mode: eager inside (and said so), compiled after -------------------
def test_op_nanwatch_sees_compiled_code_eagerly_and_leaves_it_compiled(compiled: tuple[Net, Any]) -> None:
    _, model = compiled
    assert_still_compiled(model)
    with nb.nanwatch() as report:
        y = model(torch.randn(3, 4))
        assert kind(y) == "AddmmBackward0"  # every op seen: that is what the watch checks
        y.sum().backward()
    assert_still_compiled(model)
    notes = [n for n in report.notes if "torch.compile" in n]
    assert len(notes) == 1 and "(model) ran eagerly while nanwatch checked each of its ops" in notes[0]
    assert report.summary.ops_seen > 0


def test_profile_runs_compiled_code_compiled_and_leaves_it_compiled(compiled: tuple[Net, Any]) -> None:
    """The profiler must measure the model the user runs: the compiled one, not an eager stand-in. Its
    module ranges do nothing inside compiled code, so the wrapper is one range (``model``)."""
    _, model = compiled
    assert_still_compiled(model)
    with nb.profile() as prof:
        y = model(torch.randn(3, 4))
        assert kind(y) == COMPILED and stance() == "default"
        y.sum().backward()
    assert "model" in {m.path for m in prof.by_module}
    assert_still_compiled(model)


def test_another_model_of_the_same_class_compiles_after_a_watch(compiled: tuple[Net, Any]) -> None:
    """Dynamo's "skip" mark is per code object: before the fix, every Net compiled later ran eagerly too."""
    _, model = compiled
    with nb.memory_timeline():
        model(torch.randn(3, 4))
    other = torch.compile(Net(), backend="aot_eager")
    assert kind(other(torch.randn(3, 4))) == COMPILED


@pytest.mark.parametrize("mode", ["op", "module"])
def test_a_compiled_model_called_after_a_watch_gives_no_global_hook_warning(compiled: tuple[Net, Any],
                                                                          mode: str) -> None:
    """Torch's handle for a ``with_kwargs`` global hook forgets its flag when removed: after the watch,
    every call of a compiled module warned of global hooks that were gone (they fire an extra time)."""
    _, model = compiled
    with nb.nanwatch(mode=mode):
        model(torch.randn(3, 4)).sum().backward()
    assert not torch.nn.modules.module._has_any_global_hook()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(torch.randn(3, 4))


def test_op_nanwatch_still_finds_a_birth_inside_compiled_code(compiled: tuple[Net, Any]) -> None:
    _, model = compiled
    saved = model.fc1.weight.detach().clone()
    try:
        with torch.no_grad():
            model.fc1.weight.fill_(1e38)  # parameter values are not guarded: no recompile
        with nb.nanwatch() as report:
            model(torch.full((3, 4), 10.0))
    finally:
        with torch.no_grad():
            model.fc1.weight.copy_(saved)
    assert report.first is not None
    assert (report.first.phase, report.first.op, report.first.module) == ("forward", "aten.addmm.default", "model.fc1")
    assert_still_compiled(model)


def test_module_nanwatch_sees_compiled_modules_eagerly_and_leaves_them_compiled(compiled: tuple[Net, Any]) -> None:
    """Compiled, only dynamo's fused GraphModule would be seen, not model.fc1 and model.fc2."""
    _, model = compiled
    with nb.nanwatch(mode="module") as report:
        y = model(torch.randn(3, 4))
        y.sum().backward()
    assert kind(y) == "AddmmBackward0"
    assert any("(model) ran eagerly while nanwatch checked each module" in n for n in report.notes)
    assert {layer.module for layer in report.layers} >= {"model.fc1", "model.fc2"}
    assert_still_compiled(model)


def test_memory_timeline_sees_compiled_code_eagerly_and_leaves_it_compiled(compiled: tuple[Net, Any]) -> None:
    _, model = compiled
    with nb.memory_timeline() as tl:
        y = model(torch.randn(3, 4))
        assert kind(y) == "AddmmBackward0"
    assert "torch.compile'd code (model) ran eagerly while memory_timeline recorded it" in tl.note
    assert len(tl.allocations) > 0
    del y
    assert_still_compiled(model)


def test_a_compiled_function_is_named_and_stays_compiled(compiled: tuple[Net, Any]) -> None:
    net, _ = compiled

    @torch.compile(backend="aot_eager")
    def train_step(x: torch.Tensor) -> torch.Tensor:
        return net(x).relu().sum()

    assert kind(train_step(torch.randn(3, 4))) == COMPILED
    with nb.nanwatch() as report:
        train_step(torch.randn(3, 4)).backward()
    assert any("(train_step) ran eagerly" in n for n in report.notes)
    assert kind(train_step(torch.randn(3, 4))) == COMPILED
    assert kind(train_step(torch.randn(11, 4))) == COMPILED


def test_nested_watches_and_a_raising_block_restore_the_stance(compiled: tuple[Net, Any]) -> None:
    _, model = compiled
    with pytest.raises(ZeroDivisionError):
        with nb.memory_timeline() as tl:
            with nb.nanwatch() as report:
                model(torch.randn(3, 4))
                assert stance() == "force_eager"
            assert stance() == "force_eager"  # the inner watch put back the outer one's stance
            model(torch.randn(3, 4))
            1 / 0
    assert any("torch.compile" in n for n in report.notes) and "torch.compile" in tl.note
    assert_still_compiled(model)


def test_watches_ending_out_of_order_restore_the_users_stance(compiled: tuple[Net, Any]) -> None:
    """Two watches at once (two threads, or generators) may end in any order: the stance must come
    back to what it was before the first, not to what the first one found."""
    from torch_nbdebug.record.compiled import CompiledCode

    _, model = compiled
    first, second = CompiledCode(), CompiledCode()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # ends first, although it began first
    assert stance() == "force_eager"  # the second watch is still on
    second.__exit__(None, None, None)
    assert stance() == "default"
    assert_still_compiled(model)


def test_no_note_when_no_compiled_code_ran(compiled: tuple[Net, Any]) -> None:
    net, model = compiled
    with nb.nanwatch() as report:
        net(torch.randn(3, 4))  # the original module: eager anyway, nothing compiled ran
    assert not [n for n in report.notes if "torch.compile" in n]
    assert_still_compiled(model)


def test_the_magics_say_so_and_leave_compiled_code_compiled(compiled: tuple[Net, Any], ipython: Any) -> None:
    from IPython.utils.capture import capture_output

    _, model = compiled
    ipython.user_ns.update(model=model, x=torch.randn(3, 4))
    try:
        with capture_output():
            report = ipython.run_cell_magic("nanwatch", "-o", "y = model(x)\ny.sum().backward()\n")
            timeline = ipython.run_cell_magic("cudamem", "-o", "y = model(x)\n")
        assert any("torch.compile'd code (model) ran eagerly" in n for n in report.notes)
        assert "torch.compile'd code (model) ran eagerly" in timeline.note
    finally:
        for name in ("model", "x", "y", "_nanwatch", "_cudamem"):
            ipython.user_ns.pop(name, None)
    assert_still_compiled(model)


# -- the tools without a dispatch mode leave compiled code alone ------------------------------------
def test_record_gradients_and_grads_leave_compiled_code_compiled_with_the_users_names(
        compiled: tuple[Net, Any]) -> None:
    _, model = compiled
    with nb.record_gradients(model, activations=True) as trace:  # per-module hooks: a recompile, still compiled
        for _ in range(2):
            y = model(torch.randn(3, 4))
            assert kind(y) == COMPILED
            y.sum().backward()
    assert trace.layer_names == ("model.fc1", "model.fc2")  # not model._orig_mod.fc1
    assert_still_compiled(model)
    model(torch.randn(3, 4)).sum().backward()
    assert nb.grads(model).layer_names == ("model.fc1", "model.fc2")
    assert_still_compiled(model)
    model.zero_grad()


def test_record_graph_and_graph_leave_compiled_code_compiled(compiled: tuple[Net, Any]) -> None:
    _, model = compiled
    x = torch.randn(3, 4)
    with nb.record_graph() as rec:
        y = model(x)
        assert kind(y) == COMPILED
    rec.graph(y)
    assert_still_compiled(model)
    explorer = nb.graph(model, x)
    assert {"model.fc1", "model.fc2"} <= {n.module for n in explorer.data.nodes}
    assert_still_compiled(model)
    explorer = nb.graph(model(x).sum())
    assert "CompiledFunctionBackward" in {n.op for n in explorer.data.nodes}
    assert any("whole torch.compile'd region" in note for note in explorer.data.notes)
    assert not any("torch.compile" in note for note in nb.graph(compiled[0](x).sum()).data.notes)
    assert_still_compiled(model)


# -- module names under compile: the user's, never _orig_mod or dynamo's GraphModule ---------------
@pytest.mark.parametrize("mode", ["op", "module"])
def test_nanwatch_names_modules_of_a_compiled_model_as_the_user_does(mode: str) -> None:
    torch.manual_seed(0)
    model = torch.compile(Net(), backend="aot_eager")
    x = torch.randn(3, 4)
    model(x)
    with torch.no_grad():
        model.fc2.weight[0, 0] = float("nan")
    with nb.nanwatch(mode=mode) as report:
        model(x)
    assert report.first is not None
    assert report.first.module == "model.fc2"


def test_memory_timeline_names_modules_of_a_compiled_model_as_the_user_does() -> None:
    model = torch.compile(Net(), backend="aot_eager")
    x = torch.randn(3, 4)
    model(x)
    with nb.memory_timeline() as tl:
        y = model(x)
    modules = {a.module for a in tl.allocations if a.module}
    assert {"model.fc1", "model.fc2"} <= modules
    assert not [m for m in modules if "_orig_mod" in m or "graphmodule" in m.lower()]
    del y


# -- the default backend (inductor) ---------------------------------------------------------------
def _cxx() -> bool:
    return any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++"))


@pytest.mark.slow  # inductor: about 25 s with a warm inductor cache, a minute on a cold one
@pytest.mark.skipif(not _cxx(), reason="inductor (the default torch.compile backend) needs a C++ compiler on CPU")
def test_default_backend_stays_compiled_after_the_watches() -> None:
    torch.manual_seed(0)
    model = torch.compile(Net())
    try:
        assert kind(model(torch.randn(3, 4))) == COMPILED
        with nb.nanwatch() as report:
            model(torch.randn(3, 4)).sum().backward()
        assert any("(model) ran eagerly" in n for n in report.notes)
        with nb.memory_timeline() as tl:
            model(torch.randn(3, 4))
        assert "torch.compile'd code (model)" in tl.note
        assert kind(model(torch.randn(3, 4))) == COMPILED
        assert kind(model(torch.randn(6, 4))) == COMPILED
    finally:
        torch._dynamo.reset()


# -- torch.compile first used inside the watch ------------------------------------------------------
def test_compiling_inside_the_watch_still_compiles_afterwards() -> None:
    """When dynamo is not loaded as the watch starts (CompiledCode does not pay ~1 s to import it), the
    frames dynamo refused under the dispatch mode are unmarked on exit. A fresh interpreter: dynamo
    loaded by other tests would hide the case."""
    code = textwrap.dedent("""
        import sys, torch, torch_nbdebug as nb
        from torch import nn
        from torch_nbdebug.record.compiled import CompiledCode
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        x = torch.randn(3, 4)
        with CompiledCode() as plain:
            net(x)
        assert "torch._dynamo" not in sys.modules, "CompiledCode imported dynamo"
        assert not plain.ran_eagerly and plain.note == ""
        with nb.memory_timeline() as tl:
            model = torch.compile(net, backend="aot_eager")
            assert type(model(x).grad_fn).__name__ == "AddmmBackward0"
        assert "ran eagerly" in tl.note, tl.note
        with nb.nanwatch() as report:
            y = model(x)
            assert type(y.grad_fn).__name__ == "AddmmBackward0"
        assert any("ran eagerly" in n for n in report.notes), report.notes
        for batch in (3, 7):
            name = type(model(torch.randn(batch, 4)).grad_fn).__name__
            assert name == "CompiledFunctionBackward", (batch, name)
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_repro_runs_compiled_code_eagerly_twice_says_so_and_leaves_it_compiled(compiled: tuple[Net, Any]) -> None:
    """%%repro's recorder is a dispatch mode: without the eager stance, dynamo marked the model's code
    "skip" for good and it ran eagerly for the rest of the session."""
    _, model = compiled
    report = nb.repro(lambda: model(torch.randn(3, 4)).sum(), state=model, restore_rng=True)
    assert_still_compiled(model)
    assert any("ran eagerly while repro ran it twice" in n for n in report.summary.notes), report.summary.notes


def test_the_hook_warning_filter_leaves_a_users_identical_filter_and_survives_a_catch_warnings_block() -> None:
    from torch_nbdebug.record import compat

    message = compat.global_hook_warning.MESSAGE
    ours = lambda: [f for f in warnings.filters if f[1] is not None and f[1].pattern == message]  # noqa: E731
    saved = list(warnings.filters)
    try:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)  # the user's own
        with nb.nanwatch(namespace={}):
            pass
        assert len(ours()) == 1  # still theirs
        warnings.filters[:] = saved
        watch, block = nb.nanwatch(namespace={}), warnings.catch_warnings()
        watch.__enter__()
        block.__enter__()  # entered in the watch, left after it
        watch.__exit__(None, None, None)
        block.__exit__(None, None, None)
        assert not ours() and compat.global_hook_warning._users == 0
    finally:
        warnings.filters[:] = saved
        warnings._filters_mutated()  # type: ignore[attr-defined]
