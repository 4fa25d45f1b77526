"""Nothing in the user's process breaks a tool (issue 9, item 3).

A corpus of hostile objects (what a real session holds: unbound lazy proxies, dead weak proxies,
classes whose dunders raise, huge and recursive containers, nested, sparse, meta and fake tensors,
tensor subclasses, generators, modules with raising properties) goes into a real IPython shell's
namespace; all eight magic forms must still run, show their report, and say how many objects they
skipped. The garbage-collector scans of ``%cudamem`` must survive the same objects found through
``gc.get_objects()``.
"""
from __future__ import annotations

import gc
import warnings
import weakref
from typing import Any, Iterator

import pytest
import torch
from IPython.utils.capture import capture_output
from torch import nn

from torch_nbdebug.api.memory import memory_state, memory_timeline
from torch_nbdebug.record.memory.holders import find_holders
from torch_nbdebug.record.memory.ops import measurable, plain_shape, storage_bytes
from torch_nbdebug.record.modules import module_roots
from torch_nbdebug.record.source import UserNamespace, inspectable


class Boom(Exception):
    """What the hostile objects raise: an ordinary Exception subclass, not a KeyboardInterrupt."""


class ClassRaises:
    """``isinstance`` reads ``__class__``, which raises (what makes isinstance checks raise)."""

    @property  # type: ignore[misc]
    def __class__(self) -> Any:  # noqa: D105
        raise Boom("__class__")


class UnboundProxy:
    """Like werkzeug's LocalProxy outside a request: every attribute read raises."""

    def __getattribute__(self, name: str) -> Any:
        raise RuntimeError("working outside of application context")


class LazyProxy:
    """Like lazy_object_proxy.Proxy whose factory fails: forwards everything to a target it cannot build."""

    __slots__ = ("_factory",)

    def __init__(self, factory: Any) -> None:
        object.__setattr__(self, "_factory", factory)

    def __getattribute__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_factory")(), name)


def _no_target() -> Any:
    raise Boom("the proxied object cannot be created")


class GetattrRaises:
    """A missing attribute raises Boom instead of AttributeError (so ``hasattr`` raises too)."""

    def __init__(self) -> None:
        self.tensor = torch.ones(3)

    def __getattr__(self, name: str) -> Any:
        raise Boom(name)


class DunderRaises:
    """Every protocol method raises."""

    def __eq__(self, other: object) -> bool:
        raise Boom("__eq__")

    def __hash__(self) -> int:
        raise Boom("__hash__")

    def __len__(self) -> int:
        raise Boom("__len__")

    def __iter__(self) -> Iterator[Any]:
        raise Boom("__iter__")

    def __bool__(self) -> bool:
        raise Boom("__bool__")

    def __repr__(self) -> str:
        raise Boom("__repr__")


class KeyRaises:
    """A dict key that hashes but raises when compared or printed."""

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        raise Boom("__eq__")

    def __repr__(self) -> str:
        raise Boom("__repr__")


class ListRaises(list):  # type: ignore[type-arg]
    def __iter__(self) -> Iterator[Any]:
        raise Boom("__iter__")

    def __len__(self) -> int:
        raise Boom("__len__")

    def __bool__(self) -> bool:
        raise Boom("__bool__")


class DictRaises(dict):  # type: ignore[type-arg]
    def items(self) -> Any:
        raise Boom("items")

    def __iter__(self) -> Iterator[Any]:
        raise Boom("__iter__")


class DictPropertyRaises:
    @property
    def __dict__(self) -> Any:  # type: ignore[override]
        raise Boom("__dict__")


class MetaRaises(type):
    def __instancecheck__(cls, instance: Any) -> bool:
        raise Boom("__instancecheck__")

    def __subclasscheck__(cls, sub: Any) -> bool:
        raise Boom("__subclasscheck__")

    def __getattribute__(cls, name: str) -> Any:
        if name in ("__name__", "__qualname__", "__module__"):
            return type.__getattribute__(cls, name)
        raise Boom(name)


class InstanceOfRaisingMeta(metaclass=MetaRaises):
    pass


class RaisingTensor(torch.Tensor):
    """A tensor subclass whose every torch function (properties included) raises."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise Boom(f"__torch_function__ {getattr(func, '__name__', func)}")


class ModuleRaises(nn.Module):
    """A module whose properties raise, and whose unknown attributes raise Boom."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    @property
    def broken(self) -> Any:
        raise Boom("property")

    def __getattr__(self, name: str) -> Any:
        if name in ("lin", "_parameters", "_buffers", "_modules"):
            return super().__getattr__(name)
        raise Boom(name)


class _Dead:
    pass


def _symbolic_fake() -> torch.Tensor:
    """A FakeTensor with symbolic sizes, like those ``torch.compile(dynamic=True)`` leaves behind."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())
    context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.DYNAMIC])
    fake = mode.from_tensor(torch.randn(5, 3), symbolic_context=context)
    assert not isinstance(fake.shape[0], int)  # really symbolic
    return fake


def hostile_objects() -> dict[str, Any]:
    """Every kind of object a real session may hold that a tool must not trip over."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.empty(4, 4)
    recursive: list[Any] = [torch.ones(2)]
    recursive.append(recursive)
    self_dict: dict[str, Any] = {}
    self_dict["me"] = self_dict
    dead = _Dead()
    dead_proxy = weakref.proxy(dead)
    del dead
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # prototype/beta/deprecation warnings of the odd layouts
        nested = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
        csr = torch.randn(3, 3).to_sparse_csr()
        quantized = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    jagged = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged)
    live_generator = (i for i in range(3))
    next(live_generator)
    return {
        "class_raises": ClassRaises(),
        "unbound_proxy": UnboundProxy(),
        "lazy_proxy": LazyProxy(_no_target),
        "getattr_raises": GetattrRaises(),
        "dunder_raises": DunderRaises(),
        "list_raises": ListRaises([torch.ones(1)]),
        "dict_raises": DictRaises(a=torch.ones(1)),
        "dict_property_raises": DictPropertyRaises(),
        "raising_meta_class": InstanceOfRaisingMeta,
        "raising_meta_instance": InstanceOfRaisingMeta(),
        "raising_keys": {KeyRaises(): torch.ones(2), DunderRaises.__name__: 1},
        "holds_hostile": {"proxy": UnboundProxy(), "list": [ClassRaises(), dead_proxy], "ok": torch.ones(3)},
        "huge_list": list(range(2_000_000)),
        "huge_dict": {i: float(i) for i in range(300_000)},
        "huge_set": set(range(100_000)),
        "recursive_list": recursive,
        "recursive_dict": self_dict,
        "dead_weak_proxy": dead_proxy,
        "live_generator": live_generator,
        "nested": nested,
        "jagged": jagged,
        "sparse": torch.randn(3, 3).to_sparse(),
        "sparse_csr": csr,
        "meta": torch.empty(1000, 1000, device="meta"),
        "fake": fake,
        "symbolic_fake": _symbolic_fake(),
        "raising_tensor": torch.Tensor._make_subclass(RaisingTensor, torch.zeros(2)),
        "module_raises": ModuleRaises(),
        "quantized": quantized,
    }


# The names whose value itself cannot be inspected: each tool must count these in its note.
UNINSPECTABLE = {"class_raises", "unbound_proxy", "lazy_proxy", "dead_weak_proxy", "raising_meta_class"}

SETUP = """
import torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
x = torch.randn(5, 3)
"""
BODY = "out = model(x)\nloss = out.sum()\nloss.backward()\nloss"


@pytest.fixture
def hostile(ipython: Any) -> Iterator[Any]:
    objects = hostile_objects()
    ipython.run_cell(SETUP)
    ipython.user_ns.update(objects)
    yield ipython
    for name in list(objects) + ["model", "x", "out", "loss", "_nanwatch", "_profile"]:
        ipython.user_ns.pop(name, None)
    objects.clear()  # the ipython fixture collects the garbage


def _shown(cap: Any) -> str:
    texts = [o.data.get("text/plain", "") for o in cap.outputs]
    assert texts, "the magic displayed nothing"
    return "\n".join(texts)


def _assert_skipped_note(text: str) -> None:
    assert "could not be inspected" in text, text
    count = int(text.split("skipped ", 1)[1].split(" object", 1)[0])
    assert count >= len(UNINSPECTABLE), text


@pytest.mark.parametrize("magic, line, body, expect", [
    ("nanwatch", "", BODY, "nanwatch"),
    ("graph", "", BODY, "graph"),
    ("grads", "model", BODY, "model.0"),
    ("cudamem", "", BODY, "memory timeline"),
    ("repro", "", BODY, "the two runs are identical"),
    ("profile", "", BODY, "%%profile: the cell as one step"),
])
def test_cell_magics_survive_hostile_namespace(hostile: Any, magic: str, line: str, body: str, expect: str) -> None:
    with capture_output() as cap:
        hostile.run_cell_magic(magic, line, body)
    text = _shown(cap)
    assert expect in text
    _assert_skipped_note(text)


@pytest.mark.parametrize("magic, line, expect", [
    ("graph", "model(x).sum()", "autograd nodes"),
    ("grads", "model", "model.0"),
    ("cudamem", "", "memory"),
])
def test_line_magics_survive_hostile_namespace(hostile: Any, magic: str, line: str, expect: str) -> None:
    hostile.run_cell("model(x).sum().backward()")
    with capture_output() as cap:
        hostile.run_line_magic(magic, line)
    text = _shown(cap)
    assert expect in text
    _assert_skipped_note(text)


def test_explain_names_the_failing_module_despite_hostile_neighbours(hostile: Any) -> None:
    """%%explain and the automatic post-mortem paragraph read the namespace to name modules."""
    with capture_output() as cap:
        result = hostile.run_cell("model(torch.ones(3, 7))")  # the automatic paragraph
    assert isinstance(result.error_in_exec, RuntimeError)
    assert "shape mismatch at `model.0`" in "\n".join(o.data.get("text/plain", "") for o in cap.outputs)
    with capture_output():
        result = hostile.run_cell("%%explain\nmodel(torch.ones(3, 7))")
    assert isinstance(result.error_in_exec, RuntimeError)
    diagnosis = hostile.user_ns.pop("_explain")
    assert (diagnosis.kind, diagnosis.module) == ("shape", "model.0")


def test_nanwatch_line_shows_the_report_of_a_hostile_cell(hostile: Any) -> None:
    hostile.run_cell_magic("nanwatch", "-q", BODY)
    with capture_output() as cap:
        hostile.run_line_magic("nanwatch", "")
    text = _shown(cap)
    assert "nanwatch" in text
    _assert_skipped_note(text)


def test_magics_name_the_model_and_its_tensors_despite_hostile_neighbours(hostile: Any) -> None:
    graph = hostile.run_cell_magic("graph", "-o", BODY)
    assert any(n.module == "model.0" for n in graph.data.nodes if n.kind == "op")
    state = hostile.run_line_magic("cudamem", "-o")
    names = {t.name for t in state.top}
    assert any(name.startswith("model.0.weight") for name in names) or state.tensor_count > 0


def test_gc_scan_survives_the_corpus_reachable_only_through_gc() -> None:
    objects = list(hostile_objects().values())  # alive, but in no namespace the tool is given
    state = memory_state({}, top=50)
    assert state.tensor_count > 0
    assert all(isinstance(t.nbytes, int) and all(isinstance(s, int) for s in t.shape) for t in state.top)
    model = nn.Linear(3, 2)
    with memory_timeline({}, scan_gc=True) as tl:
        model(torch.randn(2, 3)).sum().backward()
    assert len(tl.steps) > 0
    del objects


def test_memory_state_counts_nested_but_not_fake_or_meta_tensors() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.randn(200, 3), torch.randn(300, 3)])
    ns = {"nested": nested, "fake": _symbolic_fake(), "meta": torch.empty(10_000, device="meta")}
    state = memory_state(ns, top=100)
    by_name = {t.name: t for t in state.top}
    assert by_name["nested"].nbytes == 500 * 3 * 4 and set(by_name["nested"].shape) == {-1}
    assert "fake" not in by_name and "meta" not in by_name


def test_measuring_helpers_refuse_what_holds_no_plain_memory() -> None:
    fake = _symbolic_fake()
    assert storage_bytes(fake, "cpu") is None and plain_shape(fake) is None and not measurable(fake)
    assert storage_bytes(torch.empty(3, device="meta"), "cpu") is None
    assert storage_bytes(torch.randn(3, 3).to_sparse(), "cpu") is None
    assert storage_bytes(torch.ones(3), "cpu") == 12 and plain_shape(torch.ones(3)) == (3,)


def test_namespace_view_skips_and_counts_what_it_cannot_inspect() -> None:
    objects = hostile_objects()
    view = UserNamespace({**objects, 5: "not a name", "model": nn.Linear(2, 2)})
    names = dict(view.items())
    assert UNINSPECTABLE.isdisjoint(names) and 5 not in names
    assert set(view.skipped) == UNINSPECTABLE
    assert "model" in view and "unbound_proxy" not in view
    with pytest.raises(KeyError):
        view["unbound_proxy"]
    assert [name for name, _ in module_roots(view)] == ["module_raises", "model"]
    assert not inspectable(objects["unbound_proxy"]) and inspectable(objects["nested"])


def test_holder_walk_names_what_it_can_and_counts_the_rest() -> None:
    objects = hostile_objects()
    view = UserNamespace(objects)
    holders = find_holders(view)
    named = set(holders.names.values())
    assert "holds_hostile['ok']" in named  # the readable neighbour of two hostile objects
    assert "recursive_list[0]" in named and "getattr_raises.tensor" in named
    assert "raising_tensor" in view.skipped  # its attributes raise when the walk reads them
    assert UNINSPECTABLE <= set(view.skipped)


def test_holder_walk_of_huge_containers_is_bounded() -> None:
    import time

    ns = {"big": list(range(5_000_000)), "bigd": {i: i for i in range(1_000_000)}, "t": torch.ones(2)}
    start = time.perf_counter()
    holders = find_holders(ns)
    assert time.perf_counter() - start < 2.0
    assert "t" in holders.names.values()


# -- cells and options the magics must take as IPython does ---------------------------------------
AWAIT_BODY = "import asyncio\nawait asyncio.sleep(0)\nout = model(x)\nloss = out.sum()\nloss.backward()\nloss"


@pytest.fixture
def shell(ipython: Any) -> Iterator[Any]:
    ipython.run_cell(SETUP)
    yield ipython
    for name in ("model", "x", "out", "loss", "sm", "asyncio", "_nanwatch"):
        ipython.user_ns.pop(name, None)


@pytest.mark.parametrize("magic, line", [("nanwatch", "-o"), ("graph", "-o"), ("grads", "model -o"),
                                         ("cudamem", "-o")])
def test_top_level_await_in_a_cell_magic_runs_as_ipython_would(shell: Any, magic: str, line: str) -> None:
    result = shell.run_cell_magic(magic, line, AWAIT_BODY)
    assert result is not None
    assert "loss" in shell.user_ns and shell.user_ns["model"][0].weight.grad is not None


@pytest.mark.parametrize("magic, line", [("nanwatch", ""), ("graph", ""), ("grads", "model"), ("cudamem", "")])
def test_top_level_await_under_a_running_event_loop_is_a_usage_error(shell: Any, magic: str, line: str) -> None:
    import asyncio

    from IPython.core.error import UsageError

    async def in_a_kernel() -> Any:  # Jupyter runs cells while its event loop is running
        return shell.run_cell_magic(magic, line, AWAIT_BODY)

    with pytest.raises(UsageError, match="top-level `await`"):
        asyncio.run(in_a_kernel())
    assert "loss" not in shell.user_ns  # nothing of the cell ran


def test_max_nodes_rule_is_the_same_in_the_magic_and_the_api(shell: Any) -> None:
    from IPython.core.error import UsageError

    from torch_nbdebug.api.graph import graph
    from torch_nbdebug.errors import InputError

    loss = shell.user_ns["model"](shell.user_ns["x"]).sum()
    for bad in (0, -3):
        with pytest.raises(UsageError, match="--max-nodes"):
            shell.run_line_magic("graph", f"model(x).sum() --max-nodes {bad}")
        with pytest.raises(UsageError, match="--max-nodes"):
            shell.run_cell_magic("graph", f"--max-nodes {bad}", "model(x).sum()")
        with pytest.raises(InputError, match="max_nodes must be a positive"):
            graph(loss, max_nodes=bad)
    assert shell.run_line_magic("graph", "model(x).sum() --max-nodes 1 -o").data.truncated


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_grads_on_a_torchscript_module(shell: Any) -> None:
    from IPython.core.error import UsageError

    shell.run_cell("sm = torch.jit.script(model)")
    with pytest.raises(UsageError, match="TorchScript module.*record_gradients\\(model\\)"):
        shell.run_cell_magic("grads", "sm", "sm(x).sum().backward()")
    assert shell.user_ns["model"][0].weight.grad is None  # the cell did not run
    shell.run_cell("sm(x).sum().backward()")
    report = shell.run_line_magic("grads", "sm -o")  # the snapshot needs no hooks: it works
    assert report.layer_names == ("sm.0", "sm.2")
    recording = shell.run_cell_magic("grads", "model -o", "model.zero_grad()\nsm(x).sum().backward()")
    assert recording.trace.steps  # the scripted module shares the parameters the recording watches


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_memory_state_after_torch_compile_with_dynamic_shapes() -> None:
    """torch.compile(dynamic=True) leaves FakeTensors with symbolic sizes for the gc to find."""
    from torch._subclasses.fake_tensor import FakeTensor

    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    compiled = torch.compile(model, backend="aot_eager", dynamic=True)
    for n in (2, 3, 5):
        compiled(torch.randn(n, 3)).sum().backward()
    fakes = [o for o in gc.get_objects() if type(o) is FakeTensor]
    assert any(not isinstance(s, int) for f in fakes for s in f.shape)  # the scenario is real
    del fakes
    # Every live tensor of the process is listed: tensors other tests left alive (64-byte ones, say)
    # must not crowd this model's 48-byte weight out of the list.
    state = memory_state({"model": model, "compiled": compiled}, top=100_000)
    assert isinstance(state.live_bytes, int)
    assert all(isinstance(t.nbytes, int) and all(isinstance(s, int) for s in t.shape) for t in state.top)
    assert "model.0.weight" in {t.name for t in state.top}
    assert state.text()


def test_a_hostile_object_given_as_the_target_is_a_usage_error(hostile: Any) -> None:
    from IPython.core.error import UsageError

    from torch_nbdebug.api.graph import graph
    from torch_nbdebug.errors import InputError

    for name in sorted(UNINSPECTABLE):
        with pytest.raises(UsageError, match="nn.Module"):
            hostile.run_line_magic("grads", name)
        with pytest.raises(UsageError, match="grad_fn"):
            hostile.run_line_magic("graph", name)
        with pytest.raises(UsageError, match="nn.Module"):
            hostile.run_cell_magic("grads", name, "pass")
        with pytest.raises(InputError, match="grad_fn"):
            graph(hostile.user_ns[name])
