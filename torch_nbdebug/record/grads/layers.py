"""Which parameters a gradient recording covers, and how they are grouped into layers.

The modules owning parameters directly, in the forward order a recording of the same model saw
(remembered weakly between recordings) or else in registration order; a parameter shared by two
modules belongs to the first one listed. Used by :mod:`torch_nbdebug.record.grads` at a recording's
start and end, and by a snapshot.
"""
from __future__ import annotations

from typing import Optional

from torch import nn

from torch_nbdebug.data.grads import LayerInfo, ParamInfo
from torch_nbdebug.record import compat
from torch_nbdebug.record.interrupts import WeakIdMap

# Forward order learnt by a recording, reused by later snapshots of the same model (weak: never
# keeps the model alive, and runs no callback when it dies: see record/interrupts.py).
FORWARD_ORDER: "WeakIdMap[nn.Module, tuple[str, ...]]" = WeakIdMap()

# What layers_of finds: the modules owning parameters, the parameters, their layers and infos, the order's kind.
Layers = tuple[list[tuple[str, nn.Module]], list[nn.Parameter], tuple[LayerInfo, ...], tuple[ParamInfo, ...], str]


def layers_of(model: nn.Module, name: str, order: Optional[tuple[str, ...]] = None) -> Layers:
    """Modules owning parameters directly, in ``order`` (sub-names) then registration order.

    A parameter shared by two modules (tied embeddings) belongs to the first module that lists it.
    """
    model = compat.original_module(model)  # a torch.compile'd model: the user's names, not _orig_mod.*
    order = order if order is not None else FORWARD_ORDER.get(model)
    # Each module's own parameters listed once (named_parameters walks a generator and a memo per call).
    found = [(sub, m, list(m.named_parameters(recurse=False))) for sub, m in model.named_modules()]
    modules = [entry for entry in found if entry[2]]
    if order:
        rank = {sub: i for i, sub in enumerate(order)}
        modules.sort(key=lambda entry: rank.get(entry[0], len(rank)))  # stable: unseen keep registration order
    seen: set[int] = set()
    live: list[tuple[str, nn.Module]] = []
    params: list[nn.Parameter] = []
    layers: list[LayerInfo] = []
    infos: list[ParamInfo] = []
    for sub, module, named in modules:
        path = f"{name}.{sub}" if sub else name
        owned = [(pn, p) for pn, p in named if id(p) not in seen]
        if not owned:
            continue
        indices = []
        for pn, p in owned:
            seen.add(id(p))
            indices.append(len(params))
            params.append(p)
            infos.append(param_info(f"{path}.{pn}", len(layers), p))
        layers.append(LayerInfo(path, type(module).__name__, tuple(indices)))
        live.append((sub, module))
    return live, params, tuple(layers), tuple(infos), "forward" if order else "registration"


def param_info(name: str, layer: int, param: nn.Parameter) -> ParamInfo:
    """What the trace keeps of a parameter as it is now: shape, dtype and trainability."""
    return ParamInfo(name, layer, tuple(param.shape), str(param.dtype).replace("torch.", ""), param.numel(),
                     param.requires_grad)


def remember_order(model: nn.Module, order: tuple[str, ...]) -> None:
    try:
        FORWARD_ORDER[model] = order
    except TypeError:  # a module that cannot be weakly referenced: just don't remember
        pass
