"""Put a Hugging Face Qwen3 / Qwen3-MoE model into a rollout precision, in place, and stream new
weights into it (weight sync).

Quantized: every nn.Linear inside the decoder layers (q/k/v/o projections, MLP projections) and the
fused MoE expert tensors (transformers 5 stores experts as 3D `gate_up_proj` [E, 2I, H] and
`down_proj` [E, H, I]). Kept BF16: embeddings, lm_head, norms and MoE routers (`mlp.gate`,
`shared_expert_gate`), because they are few parameters and the most sensitive ones.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

import torch
from torch import nn

from parity.config.schema import PrecisionConfig
from parity.precision.formats import FP8_DTYPE, dequantize, quantize_rowwise
from parity.precision.kv import KVCodec, make_kv_codec
from parity.precision.linear import QuantLinear, check_formats, quant_linear_forward, select_path

_LAYER_RE = re.compile(r"(^|\.)layers\.\d+\.")
_ROUTER_RE = re.compile(r"(^|\.)(mlp\.gate|shared_expert_gate|router)$")
_EXPERT_CKPT_RE = re.compile(r"^(?P<mod>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
# int4 / int3 codes are kept in an int8 container
_STORAGE = {"int8": torch.int8, "fp8": FP8_DTYPE, "int4": torch.int8, "int3": torch.int8, "bf16": torch.bfloat16}


class QuantExperts(nn.Module):
    """Quantized stand-in for a transformers-5 fused experts module (Qwen3MoeExperts): codes
    `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] with per-output-channel scales, the same
    forward (loop over the experts that received tokens) with QuantLinear numerics."""

    def __init__(self, num_experts: int, hidden: int, inter: int, weights: str, activations: str,
                 act_fn: nn.Module, device: torch.device | None = None) -> None:
        super().__init__()
        check_formats(weights, activations)
        self.num_experts, self.hidden_dim, self.intermediate_dim = num_experts, hidden, inter
        self.weights, self.activations, self.act_fn = weights, activations, act_fn
        store = _STORAGE[weights]
        self.register_buffer("gate_up_proj", torch.zeros(num_experts, 2 * inter, hidden, dtype=store, device=device))
        self.register_buffer("gate_up_proj_scale", torch.ones(num_experts, 2 * inter, 1, device=device))
        self.register_buffer("down_proj", torch.zeros(num_experts, hidden, inter, dtype=store, device=device))
        self.register_buffer("down_proj_scale", torch.ones(num_experts, hidden, 1, device=device))
        self._set_paths(self.gate_up_proj.device)

    def _set_paths(self, device: torch.device) -> None:
        self.path_gate_up = select_path(self.weights, self.activations, device, self.hidden_dim,
                                        2 * self.intermediate_dim)
        self.path_down = select_path(self.weights, self.activations, device, self.intermediate_dim, self.hidden_dim)
        self.path = self.path_gate_up

    @classmethod
    def from_experts(cls, experts: nn.Module, weights: str, activations: str) -> QuantExperts:
        gu, dn = experts.gate_up_proj, experts.down_proj
        q = cls(gu.shape[0], gu.shape[2], dn.shape[2], weights, activations, experts.act_fn, gu.device)
        q.set_tensor("gate_up_proj", gu.detach())
        q.set_tensor("down_proj", dn.detach())
        return q

    @torch.no_grad()
    def set_tensor(self, name: str, w: torch.Tensor, rows: slice | None = None, expert: int | None = None) -> None:
        """Re-quantize all of `name` (gate_up_proj | down_proj), or one expert's rows of it."""
        codes, scale = self._buffers[name], self._buffers[f"{name}_scale"]
        if expert is None and rows is None and tuple(w.shape) == tuple(codes.shape):
            for e in range(self.num_experts):  # one expert at a time: float32 temporaries of one expert only
                self.set_tensor(name, w[e], expert=e)
            return
        if expert is not None:
            codes, scale = codes[expert], scale[expert]
        if rows is not None:
            codes, scale = codes[rows], scale[rows]
        if tuple(w.shape) != tuple(codes.shape):
            raise ValueError(f"QuantExperts.{name}: got shape {tuple(w.shape)}, expected {tuple(codes.shape)}")
        w = w.to(codes.device)
        if self.weights == "bf16":
            codes.copy_(w.to(torch.bfloat16))
            return
        q, s = quantize_rowwise(w, self.weights)
        codes.copy_(q)
        scale.copy_(s)

    def set_expert_proj(self, expert: int, proj: str, w: torch.Tensor) -> None:
        """Checkpoint layout: experts.{e}.gate_proj / up_proj / down_proj .weight."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"QuantExperts: expert {expert} out of range (num_experts={self.num_experts})")
        i = self.intermediate_dim
        if proj == "down_proj":
            self.set_tensor("down_proj", w, expert=expert)
        else:
            self.set_tensor("gate_up_proj", w, rows=slice(0, i) if proj == "gate_proj" else slice(i, 2 * i),
                            expert=expert)

    def dequantized(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        codes = self._buffers[name]
        return codes.to(dtype) if self.weights == "bf16" else dequantize(codes, self._buffers[f"{name}_scale"], dtype)

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - nn.Module signature
        device = fn(torch.zeros(0, device=self.gate_up_proj.device)).device
        for name in list(self._buffers):
            self._buffers[name] = self._buffers[name].to(device)
        self._set_paths(device)
        return self

    def _linear(self, x: torch.Tensor, name: str, e: int, path: str) -> torch.Tensor:
        return quant_linear_forward(x, self._buffers[name][e], self._buffers[f"{name}_scale"][e], None,
                                    self.weights, self.activations, path)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
            hit = (mask.sum(dim=(-1, -2)) > 0).nonzero().flatten().tolist()
        for e in hit:
            pos, tok = torch.where(mask[e])
            gate, up = self._linear(hidden_states[tok], "gate_up_proj", e, self.path_gate_up).chunk(2, dim=-1)
            h = self._linear(self.act_fn(gate) * up, "down_proj", e, self.path_down)
            out.index_add_(0, tok, (h * top_k_weights[tok, pos, None]).to(out.dtype))
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden={self.hidden_dim}, inter={self.intermediate_dim}, "
                f"weights={self.weights}, activations={self.activations}, path={self.path}")


def _is_fused_experts(m: nn.Module) -> bool:
    gu, dn = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    return (isinstance(gu, torch.Tensor) and isinstance(dn, torch.Tensor) and gu.dim() == 3
            and dn.dim() == 3 and hasattr(m, "act_fn") and not isinstance(m, QuantExperts))


def _quantizable(name: str, m: nn.Module) -> str | None:
    """'linear' | 'experts' | None for a module of the model."""
    if not _LAYER_RE.search(name + ".") or _ROUTER_RE.search(name):
        return None
    if type(m) is nn.Linear:
        return "linear"
    if _is_fused_experts(m):
        if getattr(m, "has_bias", False) or getattr(m, "is_transposed", False) or not getattr(m, "has_gate", True):
            raise ValueError(f"quantize_model_: experts module {name} ({type(m).__name__}) has a layout "
                             "this quantizer does not handle (bias, transposed or no gate)")
        return "experts"
    return None


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def kv_codec_for_model(model: nn.Module, precision: PrecisionConfig) -> KVCodec:
    """The KV codec for this model's head size (an int4 cache with an odd head_dim raises here)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kind = str(precision.kv_cache)
    try:
        return make_kv_codec(kind, int(head_dim), hadamard=bool(precision.kv_hadamard))
    except ValueError as e:
        raise ValueError(f"precision.kv_cache={kind!r} for model with head_dim={head_dim}: {e}") from e


def quantize_model_(model: nn.Module, precision: PrecisionConfig) -> dict:
    """Replace the decoder layers' Linear layers (and fused experts) by quantized ones, in place.
    Returns a description: formats, kernel paths with counts, number of layers replaced."""
    weights, activations = str(precision.weights), str(precision.activations)
    check_formats(weights, activations)
    kv = kv_codec_for_model(model, precision) if hasattr(model, "config") else None
    paths: Counter[str] = Counter()
    n_linear = n_experts = 0
    if (weights, activations) != ("bf16", "bf16"):
        targets = [(n, m, kind) for n, m in model.named_modules() if (kind := _quantizable(n, m))]
        for name, mod, kind in targets:
            if kind == "linear":
                new: nn.Module = QuantLinear.from_linear(mod, weights, activations)
                n_linear += 1
                paths[new.path] += 1
            else:
                new = QuantExperts.from_experts(mod, weights, activations)
                n_experts += 1
                paths[new.path_gate_up] += 1
                paths[new.path_down] += 1
            _set_submodule(model, name, new)
    return {"weights": weights, "activations": activations, "kv_cache": kv.kind if kv else str(precision.kv_cache),
            "kv": kv.describe() if kv else None, "paths": dict(paths), "quantized_linear": n_linear,
            "quantized_experts": n_experts, "path": paths.most_common(1)[0][0] if paths else "bf16",
            "kept_bf16": "embeddings, lm_head, norms, routers"}


def describe_model_precision(model: nn.Module) -> dict:
    """Kernel paths of the quantized modules currently in `model`."""
    paths: Counter[str] = Counter()
    for m in model.modules():
        if isinstance(m, QuantLinear):
            paths[m.path] += 1
        elif isinstance(m, QuantExperts):
            paths[m.path_gate_up] += 1
            paths[m.path_down] += 1
    return dict(paths)


@torch.no_grad()
def load_weights_(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Stream full-precision tensors with HF names into `model`, re-quantizing tensor by tensor where
    the target is quantized. Accepts the model's own names (fused `experts.gate_up_proj`) and the
    checkpoint names (`experts.{e}.gate_proj.weight`). Only one incoming tensor is alive at a time
    (plus its codes), never a second copy of the model. An unknown name raises, naming it."""
    modules = dict(model.named_modules())
    plain = dict(model.named_parameters(remove_duplicate=False))
    plain.update(dict(model.named_buffers(remove_duplicate=False)))
    for name, t in named_tensors:
        mod_name, _, attr = name.rpartition(".")
        mod = modules.get(mod_name)
        if isinstance(mod, QuantLinear) and attr in ("weight", "bias"):
            mod.set_weight(t) if attr == "weight" else mod.set_bias(t)
            continue
        if isinstance(mod, QuantExperts) and attr in ("gate_up_proj", "down_proj"):
            mod.set_tensor(attr, t)
            continue
        m = _EXPERT_CKPT_RE.match(name)
        if m and isinstance(modules.get(m["mod"]), QuantExperts):
            modules[m["mod"]].set_expert_proj(int(m["e"]), m["proj"], t)
            continue
        if m and _is_fused_experts(modules.get(m["mod"], nn.Module())):
            _copy_expert_rows(modules[m["mod"]], int(m["e"]), m["proj"], t)
            continue
        target = plain.get(name)
        if target is None:
            raise KeyError(f"load_weights_: tensor {name!r} matches no parameter or buffer of the model")
        if target.shape != t.shape:
            raise ValueError(f"load_weights_: tensor {name!r} has shape {tuple(t.shape)}, model expects "
                             f"{tuple(target.shape)}")
        target.copy_(t)


def _copy_expert_rows(experts: nn.Module, e: int, proj: str, t: torch.Tensor) -> None:
    """Checkpoint-named expert tensor into an unquantized fused experts module."""
    i = experts.down_proj.shape[2]
    if proj == "down_proj":
        dst = experts.down_proj[e]
    else:
        dst = experts.gate_up_proj[e, :i] if proj == "gate_proj" else experts.gate_up_proj[e, i:]
    if dst.shape != t.shape:
        raise ValueError(f"load_weights_: expert {e} {proj} has shape {tuple(t.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(t)
