"""The cause and the fix, per message family: each function reads the regex match, the failure facts
and (after a ``%%explain`` run) the recording, and returns the diagnosis fields it can fill."""
from __future__ import annotations

import math
import re
from typing import Optional

from torch_nbdebug.data.explain import (CutEvent, FailureFacts, InplaceEvent, OpSite, Operand, OptimizerStep,
                                        Recording)

Fields = dict[str, object]
REQUIRES_GRAD_WARNING = ("Do not 'fix' it with `loss.requires_grad = True` (or `requires_grad_()`): the error "
                         "goes away but no gradient reaches the model's parameters, so nothing trains.")


def _in(facts: FailureFacts) -> str:
    return f" in `{facts.module}`" if facts.module else ""


def _dims(text: str) -> list[int]:
    return [int(t) for t in re.findall(r"-?\d+", text)]


def _sizes(shape: Optional[tuple[int, ...]]) -> str:
    return "×".join(str(s) for s in shape) if shape else "?"


def culprit_fields(site: Optional[OpSite]) -> Fields:
    """The culprit fields of a diagnosis, from where the culprit ran."""
    if site is None:
        return {}
    return {"culprit_op": site.op, "culprit_module": site.module, "culprit_lineno": site.lineno,
            "culprit_line": site.line, "culprit_filename": site.filename}


def _where(site: OpSite) -> str:
    text = f"line {site.lineno}" if site.lineno else "an unknown line"
    if site.line:
        text += f" (`{site.line}`)"
    return text + (f" in `{site.module}`" if site.module else "")


# -- shapes ------------------------------------------------------------------------------------
def matmul_hint(m: "re.Match[str]", facts: FailureFacts, rec: Optional[Recording]) -> Fields:
    rows, got, expected, out = (int(g) for g in m.groups()) if len(m.groups()) == 4 else (1, *map(int, m.groups()))
    if facts.module_type not in ("Linear", "LazyLinear", "Bilinear"):
        return {"summary": f"matrix product with inner sizes {got} and {expected}{_in(facts)}",
                "hint": f"the left operand has {got} columns, the right one {expected} rows ({rows}×{got} @ "
                        f"{expected}×{out}): they must be equal. Check which operand needs a transpose "
                        f"(`.transpose(-2, -1)`) or a reshape."}
    summary = f"`{facts.module}` expects {expected} input features but gets {got}"
    return {"summary": summary, "hint": summary + _feature_cause(facts, got, expected) +
            f": resize the inputs to the size the model was built for, or set `in_features={got}` in "
            f"`{facts.module}`, or use `nn.LazyLinear` (or adaptive pooling such as `nn.AdaptiveAvgPool2d` "
            f"before flattening) so it adapts to the input size."}


def bmm_hint(m: "re.Match[str]", facts: FailureFacts, rec: Optional[Recording]) -> Fields:
    batch, inner, got_batch, got_inner = (int(g) for g in m.groups())
    shapes = " @ ".join(f"`{o.name}` {_sizes(o.shape)}" for o in facts.operands[:2])
    if got_batch != batch:
        problem = f"the batch sizes differ ({batch} and {got_batch})"
    else:
        problem = f"the left operand's last dimension is {inner}, the right one's rows are {got_inner}"
    summary = f"batched matrix product{_in(facts)}: {problem}"
    return {"summary": summary, "hint": f"{summary}{' (' + shapes + ')' if shapes else ''}. For `a @ b` the "
            "last dimension of `a` must equal the second-to-last of `b`: transpose the last two dimensions "
            "(`b.transpose(-2, -1)`), not the first two."}


def _feature_cause(facts: FailureFacts, got: int, expected: int) -> str:
    shape = facts.model_input
    if not facts.model_has_conv or shape is None or len(shape) < 3:
        return ""
    side = math.sqrt(got / expected) if expected else 0.0
    size = "larger" if got > expected else "smaller"
    return (f"; the layers before it give {got} features for {_sizes(shape[-2:])} inputs, so the images are "
            f"about {max(side, 1 / side if side else 0):.3g}× {size} per side than the model was built for")


def conv_channels_hint(m: "re.Match[str]", facts: FailureFacts, rec: Optional[Recording]) -> Fields:
    weight, given, want, got = _dims(m.group(1)), _dims(m.group(2)), int(m.group(3)), int(m.group(4))
    summary = f"`{facts.module or 'the convolution'}` expects {want} input channels, the input has {got}"
    extra = " (grayscale images into an RGB model?)" if (want, got) == (3, 1) else ""
    layout = ("; the input looks channels-last (N, H, W, C): use `x.permute(0, 3, 1, 2)`"
              if len(given) == 4 and given[-1] == want else "")
    return {"summary": summary, "hint": f"{summary}{extra}: input {_sizes(tuple(given))}, weight "
            f"{_sizes(tuple(weight))}{layout}. Set `in_channels={got}` or convert the input to {want} channels."}


def conv_rank_hint(m: "re.Match[str]", facts: FailureFacts, rec: Optional[Recording]) -> Fields:
    size = _dims(m.group(4))
    summary = f"{m.group(3)} needs a {m.group(2)} (batched) input, got shape [{', '.join(map(str, size))}]"
    return {"summary": summary + _in(facts), "hint": summary + ": add the missing batch/channel dimensions "
            "(`x.unsqueeze(0)` for one image, `x.unsqueeze(1)` for a batch of single-channel images)."}


def cat_hint(m: "re.Match[str]", facts: FailureFacts, rec: Optional[Recording]) -> Fields:
    dim, want, got, which = (int(g) for g in m.groups())
    summary = f"cat along dimension {dim}: tensor {which} differs from the first in another dimension"
    return {"summary": summary + _in(facts), "hint": f"{summary} (size {got}, expected {want}). All tensors "
            f"must have the same size in every dimension except {dim}: check the `dim=` argument and the "
            "shapes of the operands below (a missing batch dimension or a wrong sequence length)."}


def view_hint(m: "re.Match[str]", facts: FailureFacts, rec: Optional[Recording]) -> Fields:
    if not m.groups():
        return {"summary": "view() of a non-contiguous tensor" + _in(facts),
                "hint": "the tensor is not contiguous (after a transpose/permute/expand), so `.view()` cannot "
                        "reinterpret it: use `.reshape(...)` or `.contiguous().view(...)`."}
    shape, numel = _dims(m.group(1)), int(m.group(2))
    want = math.prod(s for s in shape if s != -1)
    summary = f"view to {list(shape)} ({want} elements) of a tensor with {numel} elements"
    return {"summary": summary + _in(facts), "hint": f"{summary}: the element counts must match. Keep the batch "
            "dimension and let one dimension be -1 (`x.view(x.size(0), -1)`), and check which dimension "
            "changed (batch size, sequence length or image size)."}


def broadcast_hint(m: "re.Match[str]", facts: FailureFacts, rec: Optional[Recording]) -> Fields:
    if facts.loss and len(facts.loss_shapes) == 2:  # mse_loss & co. broadcast, then fail: a loss size error
        return _loss_sizes(facts, facts.loss_shapes[0], facts.loss_shapes[1])
    groups = [int(g) for g in m.groups()]
    if len(groups) == 2:
        summary = f"the input has batch size {groups[0]} but the target {groups[1]}"
        return {"summary": summary, "hint": summary + ": inputs and targets come from different batches, or a "
                "reshape merged dimensions (flatten logits to (N, C) and targets to (N,) together)."}
    a, b, dim = groups
    shapes = ", ".join(f"`{o.name}` {_sizes(o.shape)}" for o in facts.operands[:3])
    summary = f"shapes do not broadcast: size {a} against {b} at dimension {dim}"
    return {"summary": summary + _in(facts), "hint": f"{summary}{' (' + shapes + ')' if shapes else ''}. "
            "Broadcasting aligns shapes from the right; each pair of sizes must be equal or 1. Add the "
            "missing dimension with `unsqueeze`, or fix the operand with the wrong size."}


def loss_size_hint(m: "re.Match[str]", facts: FailureFacts, rec: Optional[Recording]) -> Fields:
    """``Target size (...) must be the same as input size (...)``: BCE losses check the sizes themselves."""
    target, given = (tuple(_dims(g)) for g in (m.group(1), m.group(2)) if g is not None) if m.group(1) is not None \
        else (tuple(_dims(m.group(3))), tuple(_dims(m.group(4))))
    return _loss_sizes(facts, given, target)


def _loss_sizes(facts: FailureFacts, given: tuple[int, ...], target: tuple[int, ...]) -> Fields:
    loss = f"`{facts.loss}`" if facts.loss else "the loss"
    out, tgt = (_operand_named(facts, shape, fallback) for shape, fallback in ((given, "output"), (target, "target")))
    summary = f"{loss}{_in(facts)} got input {_sizes(given)} and target {_sizes(target)}: they must have the " \
              "same shape"
    if given == target + (1,) or given[:1] + given[2:] == target and given[1:2] == (1,):
        fix = f"`{tgt}.unsqueeze(1)` (or `{out}.squeeze(1)`)"
    elif target == given + (1,) or target[:1] + target[2:] == given and target[1:2] == (1,):
        fix = f"`{tgt}.squeeze(1)` (or `{out}.unsqueeze(1)`)"
    elif math.prod(given) == math.prod(target):
        fix = f"`{tgt}.view_as({out})`"
    else:
        fix = ("nothing reshapes one into the other: the model's output size (`out_features` of its last "
               "layer) and the targets' shape disagree, or the targets come from another batch")
    return {"summary": summary,
            "hint": f"{summary}. A size-1 dimension left over (or missing) broadcasts into wrong results or "
                    f"fails: use {fix}." if fix.startswith("`") else f"{summary}: {fix}."}


def _operand_named(facts: FailureFacts, shape: tuple[int, ...], fallback: str) -> str:
    """The name, on the user's line, of the operand of this shape."""
    return next((o.name for o in facts.operands if o.shape == shape), fallback)


# -- dtypes and devices --------------------------------------------------------------------------
def target_dtype_hint(m: "re.Match[str]", facts: FailureFacts, rec: Optional[Recording]) -> Fields:
    got = next((g for g in m.groups() if g), "Float")
    summary = f"class targets are {got}, the loss needs integer class indices (Long)"
    return {"summary": summary + _in(facts), "hint": f"{summary}: `cross_entropy`/`nll_loss` read targets "
            "of shape (N,) as class indices. Use `target.long()`; if they are class probabilities, they must "
            "have the logits' shape (N, C) and a float dtype."}


def dtype_hint(m: "re.Match[str]", facts: FailureFacts, rec: Optional[Recording]) -> Fields:
    dtypes = sorted({o.dtype for o in facts.operands})
    named = ", ".join(f"`{o.name}` is {o.dtype}" for o in facts.operands[:4])
    double = any(d == "float64" for d in dtypes) or "Double" in facts.message or "double" in facts.message
    fix = ("the float64 one most likely comes from numpy (its default): convert it with `.float()` "
           "(or `torch.from_numpy(a).float()`), or build the model in float64 with `model.double()`"
           if double else "convert one operand with `.to(other.dtype)`")
    summary = f"operands of different dtypes{_in(facts)}"
    fix = made_in_forward(facts, "`model.double()`/`.half()`", "dtype=x.dtype") or f"{fix[0].upper()}{fix[1:]}."
    return {**culprit_fields(facts.made_site), "summary": summary,
            "hint": f"{summary}{': ' + named if named else ''}. {fix}"}


def made_in_forward(facts: FailureFacts, mover: str, keyword: str) -> str:
    """The fix when the odd one out was made inside a ``forward`` (``mover`` never reached it), else ''."""
    if facts.module_made_in_forward:
        owner, _, var = facts.module.rpartition(".")
        site = facts.made_site
        local = site is None or "." not in site.line.split("=")[0]  # ``proj = ...``, not ``self.proj = ...``
        anew = " (and it is made anew, untrained, at every call)" if local else " (it did not exist yet)"
        return (f"`{facts.module}` is made inside `{owner}`'s forward, so {mover} never reaches it{anew}: "
                f"create it once in `__init__` (`self.{var} = ...`).")
    if facts.made_in_forward:
        names = ", ".join(f"`{n}`" for n in facts.made_in_forward)
        return (f"{names} {'is' if len(facts.made_in_forward) == 1 else 'are'} made inside "
                f"`{facts.module or 'the'}`'s forward, which {mover} never reaches: create it with `{keyword}` "
                f"from the input, or once in `__init__` as a buffer (`self.register_buffer(...)`), which moves "
                f"with the model.")
    return ""


def device_hint(m: "re.Match[str]", facts: FailureFacts, rec: Optional[Recording]) -> Fields:
    by_device: dict[str, list[str]] = {}
    for o in facts.operands:
        by_device.setdefault(o.device, []).append(f"`{o.name}`")
    named = "; ".join(f"{', '.join(v)} on {k}" for k, v in by_device.items())
    summary = f"operands on different devices{_in(facts)}"
    fix = made_in_forward(facts, "`model.to(device)`", "device=x.device") or (
        "Move the model once (`model.to(device)`), move every batch (`x = x.to(device)`), and create new "
        "tensors inside `forward` with `device=x.device`.")
    return {**culprit_fields(facts.made_site), "summary": summary,
            "hint": f"{summary}{': ' + named if named else ''}. {fix}"}


# -- autograd ----------------------------------------------------------------------------------
def inplace(m: "re.Match[str]", facts: FailureFacts, rec: Optional[Recording]) -> Fields:
    shape, node, version = tuple(_dims(m.group(1))), m.group(3), int(m.group(4))
    event = _modifier(rec, node, version, shape) if rec is not None else None
    saved = f"the output of {node} ({_sizes(shape)})"
    never = ("use the out-of-place form (`x = x + 1` for `x += 1`, `torch.relu(x)` for `x.relu_()`, "
             "`nn.ReLU()` without `inplace=True`), or modify a `.clone()`")
    step = _optimizer_step(rec, shape) if event is None and rec is not None else None
    if step is not None:
        by = f"`{step.site.op}()` at {_where(step.site)}"
        wanted = {shape, tuple(reversed(shape))}
        params = [n for n, s, v in facts.param_versions if s in wanted and v == version][:3]
        weight = " and ".join(f"`{n}`" for n in params) or "a parameter"
        return {**culprit_fields(step.site),
                "summary": f"{by} updated {weight} in place, which this backward still needs",
                "hint": f"{saved} is {weight} (or a view of it) saved by the forward pass; {by} updated "
                        f"the parameters in place before this backward ran (version {version}). Call "
                        "backward() for every loss of that forward before `step()` (sum the losses, or "
                        "order them), or run the forward again after the step."}
    if event is None:
        mods = ", ".join(f"`{n}`" for n in facts.inplace_modules)
        guess = f" Modules of this model that work in place: {mods}." if mods else ""
        return {"summary": f"{saved} was saved for backward, then modified in place",
                "suggest_record": True,
                "hint": f"{saved} was saved for backward and later modified in place (version {version}).{guess} "
                        f"Fix: {never}."}
    if event.site.op == "__setitem__":
        never = ("collect the pieces in a Python list and `torch.stack`/`torch.cat` them once, instead of "
                 "assigning into slices of a tensor that earlier steps read (or assign into a `.clone()`)")
    saver = rec.site_of(event.node_seq) if rec is not None else None
    by = f"`{event.site.op}` at {_where(event.site)}"
    made = f"`{saver.op}` at {_where(saver)}" if saver is not None else f"{node}"
    return {**culprit_fields(event.site),
            "summary": f"{by} modified the output of {made} in place after it was saved for backward",
            "hint": f"{made} made a tensor that backward needs; {by} modified it in place (version "
                    f"{event.version}). Fix: {never}."}


def _optimizer_step(rec: Recording, shape: tuple[int, ...]) -> Optional[OptimizerStep]:
    """The last optimizer step that updated a parameter of this shape (or of its transpose)."""
    wanted = {shape, tuple(reversed(shape))}
    return next((s for s in reversed(rec.steps) if wanted & set(s.shapes)), None)


def _modifier(rec: Recording, node: str, version: int, shape: tuple[int, ...]) -> Optional[InplaceEvent]:
    name = re.sub(r"Backward\d*$", "", node)
    found = [e for e in rec.inplace if re.sub(r"Backward\d*$", "", e.node) == name and e.version == version]
    exact = [e for e in found if e.shape == shape] or found
    if exact:
        return exact[-1]
    # A view was saved (``h[:, t - 1]`` into a matmul: "output 0 of AsStrided"): the in-place op that
    # brought the tensor it views to this version (``h[:, t] = out``).
    views = [e for e in rec.inplace if e.version == version and len(e.shape) > len(shape)
             and math.prod(e.shape) > math.prod(shape) and e.site.op in _WRITES_INTO]
    return views[-1] if views else None


_WRITES_INTO = ("__setitem__", "copy_", "index_copy_", "index_put_", "masked_fill_", "masked_scatter_", "scatter_",
                "fill_", "zero_")


def assigned_name(line: str) -> str:
    """The variable a line assigns: ``h = torch.tanh(x)`` -> ``h``; '' when it assigns none."""
    match = re.match(r"\s*([A-Za-z_][\w.]*)\s*(?:=|\+=|-=|\*=)(?!=)", line)
    return match.group(1) if match else ""


_CUT_TEXT = {"no_grad": "ran under `torch.no_grad()`/`inference_mode()`", "detach": "`.detach()` cut the chain",
             "data": "`.data` cut the chain", "item": "`.item()` made a Python number",
             "numpy": "`.numpy()` left autograd", "tolist": "`.tolist()` made Python numbers",
             "tensor": "`torch.tensor(...)` copied the values into a new tensor without their history (use the "
                       "tensor itself, or `torch.stack`/`torch.cat` to combine several)"}
_STRONG_CUTS = ("no_grad", "detach", "data", "tensor")  # always cut; `.item()` and friends are often just logging


def no_grad(m: "re.Match[str]", facts: FailureFacts, rec: Optional[Recording]) -> Fields:
    root = f"`{facts.backward_of}`" if facts.backward_of else "the tensor"
    cut = _cut(rec)
    frozen = ", ".join(f"`{f}`" for f in facts.frozen_models)
    if facts.frozen_call is not None and (cut is None or cut.how not in _STRONG_CUTS):
        call = facts.frozen_call
        return {**culprit_fields(call),
                "summary": f"`{call.module}` at {_where(call)} has no parameter that requires grad",
                "hint": f"{root} comes from `{call.module}` at {_where(call)}, and every parameter of "
                        f"`{call.module}` has `requires_grad=False`, so its output has no gradient chain. Unfreeze "
                        f"what should train (`for p in {call.module}.parameters(): p.requires_grad_(True)`), or "
                        f"compute the loss through a module that trains.",
                "warning": REQUIRES_GRAD_WARNING}
    if cut is not None:
        where = _where(cut.site)
        also = f" Also, no parameter of {frozen} requires grad." if frozen else ""
        return {**culprit_fields(cut.site),
                "summary": f"the gradient chain to {root} was cut at {where}",
                "hint": f"{root} does not depend on any parameter through autograd: at {where}, "
                        f"{_CUT_TEXT[cut.how]}. Compute the loss from the model's output without breaking "
                        f"the chain (no `torch.no_grad()` around the forward pass, no `.detach()`/`.data`, "
                        f"stay in torch instead of `.item()`/numpy).{also}",
                "warning": REQUIRES_GRAD_WARNING}
    cause = (f"every parameter of {frozen} has `requires_grad=False` (unfreeze with "
             f"`p.requires_grad_(True)`)" if frozen else
             "it was computed under `torch.no_grad()`, after `.detach()`/`.data`, or rebuilt from "
             "`.item()`/numpy values")
    return {"summary": f"{root} does not require grad: the gradient chain was cut",
            "suggest_record": not frozen,
            "hint": f"{root} has no grad_fn: {cause}.",
            "warning": REQUIRES_GRAD_WARNING}


def _cut(rec: Optional[Recording]) -> Optional[CutEvent]:
    if rec is None or not rec.cuts:
        return None
    strong = [c for c in rec.cuts if c.how in _STRONG_CUTS]
    return (strong or list(rec.cuts))[-1]


def operand_list(operands: tuple[Operand, ...]) -> str:
    return "; ".join(o.describe() for o in operands)
