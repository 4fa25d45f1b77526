"""The cause and the fix for index errors: an index out of range (with the value and the size it had
to stay below) and an index of the wrong dtype (naming the index expression on the user's line)."""
from __future__ import annotations

import ast
import re
from typing import Optional

from torch_nbdebug.data.explain import FailureFacts, Recording
from torch_nbdebug.process.explain_hints import Fields, _in

def index_hint(m: "re.Match[str]", facts: FailureFacts, rec: Optional[Recording]) -> Fields:
    if "device-side assert" in m.group(0):
        return {"summary": "CUDA device-side assert (most often an index out of range)", "restart_needed": True,
                "hint": "a kernel failed an assertion, usually an index (embedding token id, class target, "
                "gather/index_select index) out of range. The CUDA context is now unusable: restart the "
                "kernel, then run the failing cell with `%%explain --check-indices` on its first line: it "
                "checks index arguments before they reach CUDA ops, so the run stops at the right line with "
                "the bad value, before the assert. (Or reproduce on the CPU, or set CUDA_LAUNCH_BLOCKING=1.)"}
    value, size = _index_numbers(m, facts)
    op = f"aten::{m.group(2)}" if "is out of range for" in m.group(0) else _op_of(facts)
    what = {"aten::embedding": "rows (num_embeddings)", "aten::nll_loss": "classes",
            "aten::cross_entropy_loss": "classes", "aten::cross_entropy": "classes"}.get(op, "entries")
    named = next((o.name for o in facts.operands if o.dtype.startswith(("int", "uint"))), "")
    index = f"`{named}`" if named else "an index"
    if value is None:
        summary = f"index out of range{_in(facts)}"
    else:
        summary = f"{index} holds {value}, but{' `' + facts.module + '`' if facts.module else ' it'} has only " \
                  f"{size} {what} (valid 0..{size - 1 if size is not None else '?'})"
    fix = ("labels are probably 1-based or there are more classes than outputs: use 0-based labels "
           "(`y - 1`) or raise the number of outputs" if "classes" in what else
           "the vocabulary grew (a special token added to the tokenizer but not to the embedding: "
           "`model.resize_token_embeddings` or a larger `num_embeddings`), or the ids come from another "
           "tokenizer" if "rows" in what else "clamp or filter the indices, or check the `dim=`")
    return {"summary": summary, "hint": f"{summary}: {fix}. On CUDA this is a device-side assert; "
            "`%%explain --check-indices` catches it before the kernel runs."}


def _op_of(facts: FailureFacts) -> str:
    return {"embedding": "aten::embedding", "cross_entropy": "aten::cross_entropy_loss",
            "cross_entropy_loss": "aten::cross_entropy_loss", "nll_loss": "aten::nll_loss",
            "nll_loss_nd": "aten::nll_loss"}.get(facts.call, "")


def _index_numbers(m: "re.Match[str]", facts: FailureFacts) -> tuple[Optional[int], Optional[int]]:
    nums = [int(g) for g in m.groups() if g is not None and g.lstrip("-").isdigit()]
    text = m.group(0)
    if text.startswith("index") and "for dimension" in text and len(nums) == 3:
        return nums[0], nums[2]
    if (text.startswith("INDICES") or "is out of range for" in text) and len(nums) == 2:
        return nums[0], nums[1]
    if text.startswith("Target") and nums:
        return nums[0], facts.index_size
    return facts.index_value, facts.index_size


def index_dtype_hint(m: "re.Match[str]", facts: FailureFacts, rec: Optional[Recording]) -> Fields:
    """A float (or other non-integer) tensor given as the index of gather/scatter/index_select/``x[i]``."""
    op = m.group(1) if m.groups() and m.group(1) else "indexing"
    name = index_argument(facts.line, op)
    found = next((o for o in facts.operands if o.name == name), None) if name else None
    if not name:
        found = next((o for o in reversed(facts.operands) if o.dtype.startswith(("float", "bfloat"))), None)
    name = found.name if found is not None else name
    index = f"`{name}`{f' ({found.dtype})' if found is not None else ''}" if name else "the index"
    summary = f"the index of `{op}`{_in(facts)} is {index}, not an integer tensor"
    return {"summary": summary,
            "hint": f"{summary}: indices must be int64 (or int32). Convert it with `{name or 'index'}.long()`, or "
                    "build it as integers (`//` instead of `/`, `torch.arange`, `argmax`) so no value is rounded."}


def index_argument(line: str, op: str) -> str:
    """The expression a line passes as the index of ``op``: ``x.gather(1, idx)`` -> ``idx``;
    ``torch.scatter(x, 1, idx, src)`` -> ``idx``; ``x[idx]`` -> ``idx``. '' when not found."""
    try:
        tree = ast.parse(_statement(line))
    except SyntaxError:
        return ""
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and op == "indexing":
            return ast.unparse(node.slice)
        if not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Attribute, ast.Name)):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
        if name.rstrip("_") != op.rstrip("_"):
            continue
        keyword = next((k.value for k in node.keywords if k.arg == "index"), None)
        method = isinstance(node.func, ast.Attribute) and not _is_namespace(node.func.value)
        position = 1 if method else 2  # x.gather(dim, index) / torch.gather(input, dim, index)
        arg = keyword or (node.args[position] if len(node.args) > position else None)
        return ast.unparse(arg) if arg is not None else ""
    return ""


def _is_namespace(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in {"torch", "F"}


def _statement(line: str) -> str:
    text = line.strip()
    for prefix in ("return ", "yield "):
        text = text[len(prefix):] if text.startswith(prefix) else text
    return text
