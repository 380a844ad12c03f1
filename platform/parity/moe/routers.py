"""Locating the MoE routers of a Hugging Face model (shared by capture and replay).

"MoE layer index" everywhere in parity.moe means the position of a sparse block among the model's MoE
blocks in forward order (dense MLP layers, e.g. `mlp_only_layers`, are skipped), so a routing tensor's
`n_layers` axis has one entry per router, not one per decoder layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# Router classes whose semantics replay reproduces exactly: logits = linear(h), probs = softmax(logits) in
# fp32, top-k over probs, optional renormalisation of the k weights. A router with another rule (sigmoid
# scores, selection bias, grouped top-k) would be replayed with wrong gate weights, so it is refused.
_SUPPORTED_ROUTERS = ("Qwen3MoeTopKRouter",)


@dataclass(frozen=True)
class RouterRef:
    moe_index: int  # position among the MoE blocks (the n_layers axis of routing tensors)
    name: str  # module path, e.g. "model.layers.3.mlp.gate"
    router: nn.Module
    block: nn.Module  # the sparse MoE block that calls the router


def _supported(module: nn.Module) -> bool:
    return any(cls.__name__ in _SUPPORTED_ROUTERS for cls in type(module).__mro__)


def find_moe_routers(model: nn.Module) -> list[RouterRef]:
    """All MoE routers of `model` in forward order; a clear error for dense models or unknown routers."""
    modules = dict(model.named_modules())
    refs: list[RouterRef] = []
    for name, module in modules.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = modules.get(parent_name)
        if leaf != "gate" or parent is None or not hasattr(parent, "experts"):
            continue
        if not _supported(module):
            raise TypeError(
                f"MoE router {name!r} is a {type(module).__name__}; routing capture/replay supports "
                f"{', '.join(_SUPPORTED_ROUTERS)} (softmax top-k routers) only")
        refs.append(RouterRef(len(refs), name, module, parent))
    if not refs:
        raise ValueError(
            f"model {type(model).__name__} has no MoE routers (no `<block>.gate` beside `<block>.experts`); "
            "routing capture/replay needs an MoE model such as Qwen3-MoE")
    tops = {int(r.router.top_k) for r in refs}
    experts = {int(r.router.num_experts) for r in refs}
    if len(tops) != 1 or len(experts) != 1:
        raise ValueError(f"MoE routers disagree on top_k {sorted(tops)} or num_experts {sorted(experts)}; "
                         "a routing tensor needs one top_k and one expert count")
    return refs


def router_device(refs: list[RouterRef]) -> torch.device:
    return refs[0].router.weight.device
