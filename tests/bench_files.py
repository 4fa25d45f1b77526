"""The benchmarks' own files, for tests: ``bench/`` is not a package."""
from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def bench_module(name: str) -> ModuleType:
    """``bench/<name>.py`` loaded as a module of its own (``_bench_<name>``)."""
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
