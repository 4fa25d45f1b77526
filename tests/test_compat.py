"""Private torch API goes through one door (``record/compat.py``) with version checks, and the
dependency floors the package claims are the versions the test suite runs (DESIGN.md section 9)."""
from __future__ import annotations

import ast
import pathlib
import re
import tomllib

import pytest
import torch
from packaging.requirements import Requirement
from packaging.version import Version

from torch_nbdebug.errors import NbdebugError
from torch_nbdebug.record import compat

REPO = pathlib.Path(__file__).resolve().parents[1]
PKG = REPO / "torch_nbdebug"
COMPAT = PKG / "record" / "compat.py"


def _sources() -> list[pathlib.Path]:
    files = sorted(p for p in PKG.rglob("*.py") if p != COMPAT)
    assert len(files) > 20, "package sources not found"
    return files


# -- one door --------------------------------------------------------------------------------
def test_no_module_outside_compat_touches_torch_C() -> None:
    pattern = re.compile(r"\btorch\._C\b")
    offenders = [f"{p.relative_to(REPO)}:{i}: {line.strip()}" for p in _sources()
                 for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert offenders == []


def _private_torch_names(tree: ast.AST) -> list[tuple[int, str]]:
    """``torch.x._y`` attribute chains and ``from torch._x import``/``import torch._x`` in code."""
    found = []
    inner_links = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] == "torch"]
        elif isinstance(node, ast.Attribute) and id(node) not in inner_links:  # whole chains only
            parts = []
            inner: ast.AST = node
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if not (isinstance(inner, ast.Name) and inner.id == "torch"):
                continue
            names = [".".join(["torch", *reversed(parts)])]
        else:
            continue
        for name in names:
            if any(part.startswith("_") and not part.startswith("__") for part in name.split(".")[1:]):
                found.append((node.lineno, name))
    return found


def test_no_module_outside_compat_uses_private_torch_names() -> None:
    offenders = []
    for path in _sources():
        for lineno, name in _private_torch_names(ast.parse(path.read_text())):
            offenders.append(f"{path.relative_to(REPO)}:{lineno}: {name}")
    assert sorted(set(offenders)) == []


def test_the_private_name_finder_finds_what_it_should() -> None:
    code = ("import torch._dynamo\nfrom torch.utils._pytree import tree_leaves\nx = torch._C._foo()\n"
            "y = torch.nn.functional.relu\nz = torch.__version__\n'''torch._C in a docstring'''\n")
    assert sorted(name for _, name in _private_torch_names(ast.parse(code))) == [
        "torch._C._foo", "torch._dynamo", "torch.utils._pytree"]


# Torch's private attributes of tensors, modules and autograd nodes: read through compat like torch._x names.
_PRIVATE_ATTRIBUTES = frozenset({
    "_version", "_base", "_is_view", "_cdata", "_grad_fn", "_buffers", "_parameters", "_modules",
    "_non_persistent_buffers_set", "_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called", "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_post_accumulate_grad_hooks",
})
# Tools being rewritten in parallel (explain, memory, repro): their reads move to compat with that work.


def _private_attribute_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """``x._version``, ``m._buffers``, ``node._saved_self``...: torch's private attributes read on any object
    but our own (``self``, ``cls``)."""
    return [(node.lineno, node.attr) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and (node.attr in _PRIVATE_ATTRIBUTES or node.attr.startswith(("_saved_", "_raw_saved_")))
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]


def test_no_module_outside_compat_reads_private_torch_attributes() -> None:
    offenders = [f"{path.relative_to(REPO)}:{lineno}: .{name}" for path in _sources()
                 for lineno, name in _private_attribute_reads(ast.parse(path.read_text()))]
    assert offenders == []


def test_the_private_attribute_finder_finds_what_it_should() -> None:
    code = ("v = t._version\nb = x.grad._base\nm._buffers['a'] = 1\ns = node._saved_self\nh = m._forward_hooks\n"
            "self._buffers = {}\nok = t.grad_fn\nmine = self._modules\nown = rec._held\n")
    assert sorted(name for _, name in _private_attribute_reads(ast.parse(code))) == [
        "_base", "_buffers", "_forward_hooks", "_saved_self", "_version"]


def test_compat_imports_torch_only() -> None:
    tree = ast.parse(COMPAT.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    # the package's one error class (torch_nbdebug.errors imports nothing) and the standard library
    assert imported <= {"__future__", "importlib", "re", "sys", "threading", "types", "typing", "warnings", "weakref", "torch",
                        "torch_nbdebug"}
    assert {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
            and n.module and n.module.startswith("torch_nbdebug")} == {"torch_nbdebug.errors"}


# -- version checks --------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [("2.13.0+cpu", (2, 13)), ("2.14.0.dev20261101", (2, 14)),
                                            ("3.0.0a0+git1234", (3, 0)), ("2.6", (2, 6))])
def test_parse_version(text: str, expected: tuple[int, int]) -> None:
    assert compat.parse_version(text) == expected


def test_parse_version_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="cannot read a torch version"):
        compat.parse_version("nightly")


def test_installed_torch_meets_the_floor() -> None:
    assert compat.TORCH_VERSION == compat.parse_version(torch.__version__)
    assert compat.at_least(compat.MIN_TORCH)
    for feature in compat.FEATURES:
        compat.require(feature)  # every feature works on the torch the suite runs


def test_require_names_the_feature_and_the_torch_it_needs() -> None:
    with pytest.raises(compat.TorchVersionError) as info:
        compat.require("compiler_stance", current=(2, 5))
    message = str(info.value)
    assert "torch.compiler.set_stance" in message and "torch>=2.6" in message and "torch 2.5 is installed" in message
    assert isinstance(info.value, NbdebugError)
    compat.require("compiler_stance", current=(2, 6))
    assert not compat.at_least((2, 6), current=(2, 5)) and compat.at_least((2, 6), current=(3, 0))


def test_an_older_torch_gets_one_clear_warning() -> None:
    assert compat.floor_warning() is None
    message = compat.floor_warning(current=(2, 12))
    assert message is not None and "tested with torch>=2.13" in message and "torch 2.12 is installed" in message


def test_a_private_name_a_torch_release_dropped_fails_with_a_message_not_at_import() -> None:
    import types

    owner = types.SimpleNamespace(__name__="torch._C", present=len)
    assert compat.bind(owner, "present", "x") is len
    missing = compat.bind(owner, "_gone", "telling backward from forward")
    with pytest.raises(compat.TorchVersionError, match=r"telling backward from forward needs torch\._C\._gone, "
                                                       r"which torch .* does not have"):
        missing()


def test_require_the_package_floor() -> None:
    needed = compat.FEATURES["package"][0]
    assert needed == compat.MIN_TORCH
    with pytest.raises(compat.TorchVersionError, match=r"torch_nbdebug needs torch>=2\.13"):
        compat.require("package", current=(2, 12))


def test_foreach_norm_on_an_older_torch_falls_back_to_per_tensor_norms(monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = [torch.full((3,), 300.0, dtype=torch.float16), torch.ones(2, 2, dtype=torch.float16)]
    batched = compat.foreach_norm(tensors, 2, dtype=torch.float32)
    monkeypatch.setattr(compat, "TORCH_VERSION", (2, 2))
    fallback = compat.foreach_norm(tensors, 2, dtype=torch.float32)
    assert [t.dtype for t in fallback] == [torch.float32, torch.float32]
    assert torch.allclose(torch.stack(batched), torch.stack(fallback))
    assert float(batched[0]) == pytest.approx(300.0 * 3 ** 0.5)


# -- the wrappers ----------------------------------------------------------------------------
def test_storage_key_is_the_public_weak_ref_key_and_shared_by_views() -> None:
    t = torch.arange(6.0)
    key = compat.storage_key(t)
    assert key == compat.StorageWeakRef(t.untyped_storage()).cdata
    assert compat.storage_key(t.view(2, 3)[1]) == key and compat.storage_key(torch.ones(1)) != key
    assert compat.storage_key(torch.ones(2).to_sparse()) is None


def test_storage_weak_ref_tracks_the_free() -> None:
    t = torch.ones(4)
    weak = compat.storage_weak_ref(t.untyped_storage())
    assert weak == compat.storage_key(t) and not compat.storage_expired(weak)
    del t
    assert compat.storage_expired(weak)
    compat.free_storage_weak_ref(weak)


def test_autograd_node_helpers() -> None:
    a = torch.ones(2, requires_grad=True)
    expected = compat.next_sequence_nr()
    b = a * 3
    assert compat.node_sequence_nr(b.grad_fn) == expected and compat.next_sequence_nr() == expected + 1
    assert [tuple(m.shape) for m in compat.node_output_metadata(b.grad_fn)] == [(2,)]
    assert set(compat.node_saved_attributes(b.grad_fn)) >= {"_saved_other"}
    assert compat.node_sequence_nr(b.grad_fn.next_functions[0][0]) == compat.NO_SEQUENCE  # AccumulateGrad
    assert compat.current_autograd_node() is None
    seen = []
    b.register_hook(lambda g: seen.append(compat.current_autograd_node()))
    (b * 1).sum().backward()
    assert seen and seen[0] is not None
    order = []
    c = a * 2
    c.register_hook(lambda g: compat.queue_backward_callback(lambda: order.append("end")) or order.append("hook"))
    (c * 1).sum().backward()
    assert order == ["hook", "end"]


def test_dispatch_stack_helpers() -> None:
    class Mode(compat.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    base = compat.dispatch_stack_len()
    with Mode() as mode:
        assert compat.dispatch_stack_len() == base + 1 and compat.dispatch_mode_at(base) is mode
        popped = compat.pop_dispatch_mode()
        assert popped is mode and compat.dispatch_stack_len() == base
        compat.push_dispatch_mode(popped)
    assert compat.dispatch_stack_len() == base and compat.function_stack_len() == 0


def test_tensor_helpers() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.ones(2)
    assert compat.is_fake(fake) and not compat.is_fake(torch.ones(2))
    assert [a.name for a in compat.op_arguments(torch.ops.aten.add.Tensor)][:2] == ["self", "other"]
    assert compat.op_arguments(len) == []
    assert compat.tree_leaves(((1, [2]), {"a": 3})) == [1, 2, 3]


def test_cuda_history_is_off_between_tests() -> None:
    # Off between tests: without CUDA it is never on, with CUDA the autouse fixture keeps it off.
    assert compat.cuda_history_enabled() is False


def test_compiled_module_helpers() -> None:
    net = torch.nn.Linear(2, 2)
    assert compat.original_module(net) is net and not compat.is_compiled_module(net)
    compiled = torch.compile(net, backend="eager")  # wrapping only: nothing is compiled until called
    assert compat.is_compiled_module(compiled) and compat.original_module(compiled) is net
    assert list(compat.compiled_callables(None)) == []


# -- dependency floors: what pyproject claims is what requirements/dev.txt runs ---------------
def _pins() -> dict[str, Version]:
    pins = {}
    for line in (REPO / "requirements" / "dev.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            pins[req.name.lower().replace("_", "-")] = Version(next(iter(req.specifier)).version)
    return pins


def test_dependency_floors_are_the_pinned_versions_the_suite_runs() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = _pins()
    claims = list(project["dependencies"]) + [d for group in project["optional-dependencies"].values() for d in group]
    mismatched = []
    for text in claims:
        req = Requirement(text)
        floors = [Version(s.version) for s in req.specifier if s.operator in (">=", "==")]
        pin = pins.get(req.name.lower().replace("_", "-"))
        assert pin is not None, f"{req.name} is claimed in pyproject.toml but not pinned in requirements/dev.txt"
        if len(floors) != 1 or floors[0].release != pin.release[:len(floors[0].release)]:
            mismatched.append(f"{text} (pinned and tested: {pin})")
    assert mismatched == []


def test_torch_floor_is_compats() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    torch_req = next(Requirement(d) for d in project["dependencies"] if Requirement(d).name == "torch")
    (floor,) = [Version(s.version) for s in torch_req.specifier if s.operator == ">="]
    assert floor.release[:2] == compat.MIN_TORCH
    pinned = _pins()["torch"]  # what ./dev test runs: the floor is what runs
    assert pinned.release[:2] == compat.MIN_TORCH
    # ./dev test-newest runs the same suite with requirements/newest.txt's torch: the range tested is
    # from the floor to that one, and the suite runs with no other
    (newest,) = [Version(next(iter(Requirement(line).specifier)).version)
                 for line in (REPO / "requirements" / "newest.txt").read_text().splitlines()
                 if line.split("#")[0].strip()]
    assert newest > pinned
    running = Version(torch.__version__.split("+")[0])
    assert running in (pinned, newest), f"torch {running} is neither the pinned {pinned} nor the newest {newest}"


def test_requires_python_is_what_the_pins_need() -> None:
    from packaging.specifiers import SpecifierSet

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    claimed = SpecifierSet(project["requires-python"])
    assert "3.11.2" in claimed and "3.10.12" not in claimed  # Debian 12's python; ipython 9 needs 3.11
