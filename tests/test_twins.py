"""The Python twins see what the user sees (issue 9, item 4).

Called inside a function, every twin reads the caller's locals as well as its globals, live, through
the one helper (:func:`torch_nbdebug.record.source.caller_namespace`), and keeps neither the frame nor
its locals once the tool is done: on Python < 3.13 ``frame.f_locals`` is a snapshot attached to the
frame that would keep a deleted local's tensor alive until the function returns.

Module names under ``torch.compile`` are the user's (``m.fc2``, or ``cm.fc2`` when only the compiled
wrapper has a name), never ``cm._orig_mod.fc2``.
"""
from __future__ import annotations

import gc
import sys
import weakref
from typing import Any

import pytest
import torch
from torch import nn

from torch_nbdebug import (graph, grads, memory_state, memory_timeline, nanwatch, profile, record_gradients,
                           record_graph)
from torch_nbdebug.record.modules import ModuleNamer, module_roots, parameter_names, qualified_names
from torch_nbdebug.record.source import UserNamespace, caller_namespace, frame_locals


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))


def _modules_of(explorer: Any) -> set[str]:
    return {n.module for n in explorer.data.nodes if n.kind == "op" and n.module}


# -- the helper ----------------------------------------------------------------------------------
def test_caller_namespace_reads_locals_over_globals_live() -> None:
    shadow = "local"  # noqa: F841 - read through the namespace

    def inner() -> UserNamespace:
        return caller_namespace()

    ns = caller_namespace()
    late = torch.ones(2)  # bound after the view was made: seen, because reads are live
    assert ns["shadow"] == "local" and ns["late"] is late and ns["torch"] is torch
    assert "inner" in ns and ns["inner"] is inner
    ns.release()
    assert dict(ns.items()) == {}


def test_frame_locals_leaves_no_snapshot_keeping_a_deleted_local_alive() -> None:
    big = torch.ones(1000)
    ref = weakref.ref(big)
    copy = frame_locals(sys._getframe())
    assert copy is not None and copy["big"] is big
    del copy, big
    assert ref() is None, "the frame's f_locals snapshot kept a deleted local alive"


def test_frame_locals_keeps_a_locals_dict_the_user_holds() -> None:
    x = 1  # noqa: F841
    held = locals()
    frame_locals(sys._getframe())
    assert held["x"] == 1  # the user's own locals() dict is never emptied


# -- memory_timeline / memory_state --------------------------------------------------------------
def test_memory_timeline_in_a_function_names_local_holders() -> None:
    def train() -> Any:
        model = _net()
        keep = []
        with memory_timeline(device="cpu") as tl:
            for _ in range(3):
                out = model(torch.randn(16, 4))
                keep.append(out.sum())
        del out
        return tl

    tl = train()
    holders = [leak.holder for leak in tl.leaks]
    assert holders and holders[0] == "keep", tl.text()
    assert not any(h.startswith("(not reachable") for h in holders), tl.text()


def test_memory_timeline_last_local_result_is_not_a_leak() -> None:
    def step() -> Any:
        model = _net()
        with memory_timeline(device="cpu") as tl:
            result = model(torch.randn(16, 4)).detach()  # noqa: F841 - the function's own result
        return tl

    tl = step()
    assert tl.leaks == (), tl.text()


def test_memory_state_in_a_function_names_locals() -> None:
    def look() -> Any:
        weights = torch.ones(4096)  # noqa: F841
        return memory_state(device="cpu", top=100)

    assert "weights" in {t.name for t in look().top}


# -- nanwatch ------------------------------------------------------------------------------------
def test_nanwatch_in_a_function_names_local_modules() -> None:
    def run() -> Any:
        net = _net()
        x = torch.randn(2, 4)
        with nanwatch() as report:
            net(x).log().sum()
        return report

    report = run()
    assert report.first is not None and report.first.op == "aten.log.default"
    assert [layer.module for layer in report.layers] == ["net", "net.0", "net.1", "net.2"]


def test_nanwatch_in_a_function_names_a_model_made_inside_the_block() -> None:
    def run() -> Any:
        with nanwatch() as report:
            made_here = _net()
            made_here(torch.randn(2, 4)).log().sum()
        return report

    modules = {layer.module for layer in run().layers}
    assert any(m.startswith("made_here") for m in modules), modules


# -- graph / record_graph ------------------------------------------------------------------------
def test_profile_in_a_function_names_local_modules() -> None:
    def fit() -> Any:
        local_net = _net()
        with profile() as prof:
            local_net(torch.randn(2, 4)).sum().backward()
        return prof

    assert {"local_net", "local_net.0", "local_net.2"} <= {m.path for m in fit().by_module}


def test_graph_in_a_function_names_local_parameters_and_inputs() -> None:
    def draw() -> Any:
        net = _net()
        batch = torch.randn(2, 4, requires_grad=True)
        return graph(net(batch).sum())

    leaves = {(n.kind, n.label) for n in draw().data.nodes if n.kind in ("param", "input")}
    assert leaves == {("input", "batch"), ("param", "net.0.weight"), ("param", "net.0.bias"),
                      ("param", "net.2.weight"), ("param", "net.2.bias")}


def test_record_graph_in_a_function_names_local_modules() -> None:
    def draw() -> Any:
        net = _net()
        with record_graph() as rec:
            loss = net(torch.randn(2, 4)).sum()
        return rec.graph(loss)

    assert {"net.0", "net.2"} <= _modules_of(draw())


# -- grads / record_gradients --------------------------------------------------------------------
def test_grads_in_a_function_finds_the_local_name() -> None:
    def check() -> Any:
        net = _net()
        net(torch.randn(2, 4)).sum().backward()
        return grads(model=net)  # not spelled as a positional argument: found in the locals

    assert check().trace.model == "net"


def test_record_gradients_in_a_function_finds_the_local_name() -> None:
    def fit() -> Any:
        net = _net()
        with record_gradients(model=net) as trace:
            net(torch.randn(2, 4)).sum().backward()
        return trace

    trace = fit()
    assert trace.trace.model == "net"
    assert trace.layer_names[0] == "net.0"


# -- nothing of the caller is kept ---------------------------------------------------------------
def _tool_runs(tool: str) -> tuple[Any, list[weakref.ref[torch.Tensor]]]:
    """Run one twin inside a function that deletes a local after the tool is done."""
    net = _net()
    doomed = torch.ones(1000, requires_grad=True)
    refs = [weakref.ref(doomed)]
    result: Any
    if tool == "nanwatch":
        with nanwatch() as result:
            net(torch.randn(2, 4)).sum()
    elif tool == "record_graph":
        with record_graph() as rec:
            loss = net(torch.randn(2, 4)).sum() + doomed.sum()
        result = rec.graph(loss)
        del loss
    elif tool == "graph":
        result = graph((doomed * 2).sum())
    elif tool == "record_gradients":
        with record_gradients(model=net) as result:
            net(torch.randn(2, 4)).sum().backward()
    elif tool == "grads":
        net(torch.randn(2, 4)).sum().backward()
        result = grads(model=net)
    elif tool == "memory_timeline":
        with memory_timeline(device="cpu") as result:
            net(torch.randn(2, 4)).sum()
    elif tool in ("profile", "profile-kept"):
        with profile(keep_trace=tool == "profile-kept") as result:
            net(torch.randn(2, 4)).sum()
    else:
        result = memory_state(device="cpu")
    del doomed
    assert refs[0]() is None, f"{tool}: the caller's deleted local is still alive"
    inner = torch.ones(10)
    refs.append(weakref.ref(inner))
    return result, refs


TOOLS = ["nanwatch", "record_graph", "graph", "record_gradients", "grads", "memory_timeline", "memory_state",
         "profile", "profile-kept"]


@pytest.mark.parametrize("tool", TOOLS)
def test_twin_keeps_neither_the_frame_nor_its_locals(tool: str) -> None:
    result, refs = _tool_runs(tool)
    assert refs[1]() is None, f"{tool}: the result keeps the caller's frame (and its locals) alive"
    assert result is not None
    gc.collect()


# -- torch.compile: the user's module names ------------------------------------------------------
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_compiled_module_names_prefer_the_plain_name() -> None:
    m = _Net()
    cm = torch.compile(m, backend="aot_eager")
    both = qualified_names(module_roots({"cm": cm, "m": m}))
    assert both[id(m.fc2)] == "m.fc2"
    only = qualified_names(module_roots({"cm": cm}))
    assert only[id(m.fc2)] == "cm.fc2" and only[id(cm)] == "cm"
    assert set(parameter_names(module_roots({"cm": cm})).values()) == {
        "cm.fc1.weight", "cm.fc1.bias", "cm.fc2.weight", "cm.fc2.bias"}
    namer = ModuleNamer({"cm": cm})
    assert namer.name(m.fc1) == "cm.fc1"
    assert not any("_orig_mod" in name for name in qualified_names(module_roots({"cm": cm})).values())


@pytest.mark.filterwarnings("ignore:Using `torch.compile:UserWarning")
def test_compiled_model_graph_and_grads_use_the_users_names() -> None:
    m = _Net()
    cm = torch.compile(m, backend="aot_eager")
    x = torch.randn(3, 4)
    ns = {"cm": cm, "x": x}
    with record_graph(ns) as rec:
        loss = cm(x).sum()
    modules = _modules_of(rec.graph(loss))
    assert not any("_orig_mod" in name for name in modules), modules
    with record_gradients(cm, namespace=ns) as trace:
        cm(x).sum().backward()
    assert trace.layer_names == ("cm.fc1", "cm.fc2")
    both = {"m": m, "cm": cm}
    assert grads(cm, namespace=both).layer_names == ("cm.fc1", "cm.fc2")  # the name the user passed
    assert grads(m, namespace=both).layer_names == ("m.fc1", "m.fc2")


@pytest.mark.filterwarnings("ignore:Using `torch.compile:UserWarning")
def test_compiled_model_nanwatch_module_paths() -> None:
    m = _Net()
    cm = torch.compile(m, backend="aot_eager")
    x = torch.randn(3, 4)
    with nanwatch(namespace={"cm": cm, "m": m, "x": x}) as report:
        cm(x).log().sum()
    modules = {e.module for e in report.events if e.module} | {layer.module for layer in report.layers}
    assert modules and not any("_orig_mod" in name for name in modules), modules
    assert any(name.startswith("m.") or name == "m" for name in modules), modules


# -- issue 28: every twin names a model by the caller's variable -----------------------------------
def test_repro_state_in_a_function_is_named_by_the_local_variables() -> None:
    """``repro(fn, state=(model, opt))`` inside a function: the module where the runs part is
    ``model.1`` (the caller's name), not ``state[0].1``; the state is listed by the same names."""
    from torch_nbdebug import repro

    def check() -> Any:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.randn(16, 4)

        def step() -> None:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

        return repro(step, state=(model, opt), restore_rng=False)  # dropout draws anew: the runs differ

    report = check()
    assert not report.identical and report.cause == "rng"
    assert report.first.module == "model.1", report.text()
    assert set(report.summary.state) == {"model", "opt"}


def test_repro_without_state_in_a_function_names_the_model_by_the_local_variable() -> None:
    from torch_nbdebug import repro

    def check() -> Any:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
        x = torch.randn(16, 4)
        return repro(lambda: model(x).sum(), restore_rng=False)

    report = check()
    assert report.first.module == "model.1", report.text()  # was sequential.1


def test_monitor_in_a_function_names_layers_by_the_local_variable() -> None:
    from torch_nbdebug import monitor

    def fit() -> Any:
        net = _net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with monitor("loss") as mon:
            for _ in range(2):
                opt.zero_grad()
                loss = net(torch.randn(2, 4)).pow(2).mean()
                loss.backward()
                opt.step()
        return mon

    assert fit().history.layers == ("net.0", "net.2")


def test_repro_reading_the_callers_locals_keeps_none_alive() -> None:
    from torch_nbdebug import repro

    def check() -> list[weakref.ref[torch.Tensor]]:
        model = _net()
        doomed = torch.ones(1000)
        refs = [weakref.ref(doomed)]
        repro(lambda: model(torch.ones(2, 4)), state=(model,))
        del doomed
        assert refs[0]() is None, "the f_locals snapshot repro read keeps the deleted local alive"
        return refs

    check()
