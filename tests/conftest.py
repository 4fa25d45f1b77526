"""Shared fixtures. ``no_leftovers`` is autouse: any test that leaves a hook, mode or flag behind fails."""
from __future__ import annotations

import gc
import os
import sys
from typing import Any

import pytest
import torch

from torch_nbdebug.record.modules import global_hook_counts

torch.set_num_threads(min(2, os.cpu_count() or 1))


def _global_state() -> dict[str, Any]:
    state: dict[str, Any] = dict(global_hook_counts())
    state["grad_enabled"] = torch.is_grad_enabled()
    state["anomaly_enabled"] = torch.is_anomaly_enabled()
    state["anomaly_check_nan"] = torch.is_anomaly_check_nan_enabled()
    state["inference_mode"] = torch.is_inference_mode_enabled()
    state["default_dtype"] = torch.get_default_dtype()
    state["saved_tensors_hooks"] = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    state["sys_trace"] = sys.gettrace() is not None and "coverage" not in type(sys.gettrace()).__module__
    state["sys_profile"] = sys.getprofile() is not None
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # the torch.compile stance (force_eager...)
    state["compiler_stance"] = eval_frame._stance.stance if eval_frame is not None else "default"
    if torch.cuda.is_available():
        state["cuda_history"] = bool(torch.cuda.memory._snapshot().get("device_traces") and
                                     any(torch.cuda.memory._snapshot()["device_traces"]))
    return state


@pytest.fixture(autouse=True)
def no_leftovers() -> Any:
    """Fail any test after which a global hook, dispatch mode, anomaly flag or grad mode differs."""
    before = _global_state()
    yield
    after = _global_state()
    changed = {k: (before[k], after.get(k)) for k in before if before[k] != after.get(k)}
    assert not changed, f"torch_nbdebug left global state behind (before, after): {changed}"


@pytest.fixture
def ipython() -> Any:
    """A real IPython shell with the extension loaded; unloaded afterwards."""
    from IPython.testing.globalipapp import get_ipython

    ip = get_ipython()
    ip.run_line_magic("load_ext", "torch_nbdebug")
    yield ip
    ip.run_line_magic("unload_ext", "torch_nbdebug")
    gc.collect()


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    # Browser tests last: playwright's sync API keeps an asyncio loop running in the main thread for
    # the rest of the session, which changes what any later test sees (asyncio.get_running_loop()).
    items.sort(key=lambda item: "browser" in item.keywords)  # stable: the order within each group stays
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
