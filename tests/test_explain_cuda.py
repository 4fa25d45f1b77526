"""%explain on a real CUDA device (run when one is lent). A device-side assert ruins the CUDA context
of its process, so each scenario runs in a fresh interpreter and reports back as JSON."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda

ASSERT = """
import json, torch
from torch_nbdebug.api.explain import explain_exception
emb = torch.nn.Embedding(100, 8).cuda()
tokens = torch.tensor([[1, 2, 100]], device="cuda")
try:
    hidden = emb(tokens)
    print(hidden.sum().item())
except RuntimeError as err:
    d = explain_exception(err, namespace={"emb": emb})
    print(json.dumps({"kind": d.kind, "restart": d.restart_needed, "hint": d.hint}))
"""

CHECKED = """
import json, torch
from torch_nbdebug.api.explain import explain
emb = torch.nn.Embedding(100, 8).cuda()
tokens = torch.tensor([[1, 2, 100]], device="cuda")
try:
    with explain(check_indices=True, namespace={"emb": emb}) as ex:
        hidden = emb(tokens)
except IndexError as err:
    torch.cuda.synchronize()  # the context is still usable: no kernel saw the bad index
    d = ex.diagnosis
    print(json.dumps({"kind": d.kind, "op": d.op, "lineno": d.lineno, "hint": d.hint, "error": str(err)}))
"""


def _run(script: str, folder: Path) -> dict[str, object]:
    path = folder / "scenario.py"  # a file, not -c: the explanation reads the failing line's source
    path.write_text(script)
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no result:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1])


def test_device_side_assert_is_explained_with_restart_and_check_indices(tmp_path: Path) -> None:
    result = _run(ASSERT, tmp_path)
    assert result["kind"] == "index" and result["restart"] is True
    assert "--check-indices" in str(result["hint"])


def test_check_indices_stops_before_the_cuda_kernel(tmp_path: Path) -> None:
    result = _run(CHECKED, tmp_path)
    assert (result["kind"], result["op"], result["lineno"]) == ("index", "aten::embedding", 8)
    assert "index 100" in str(result["error"]) and "`tokens` holds 100" in str(result["hint"])
