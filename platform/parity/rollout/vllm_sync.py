"""Weight sync into a running vLLM engine: the functions that run inside vLLM's worker.

Two routes, chosen by the checkpoint the engine loaded:

- BF16 / FP32 models: vLLM's own in-place reload (`model_runner.reload_weights(weights_iterator=...)`),
  which reruns each layer's loader and kernel preparation and copies the result into the running tensors.
- W8A8 INT8 / FP8 (compressed-tensors) models: `requantize_into_model`. vLLM's reload yields NaN there on
  CPU: the oneDNN int8 kernel (CPUInt8ScaledMMLinearKernel) prepacks the weight into a handle built in
  `process_weights_after_loading` and sets `layer.weight = None`, and the reload path builds that handle from
  temporary tensors it then swaps back for the old ones. Instead, per quantized linear layer:
      1. fuse the trainer's HF tensors the way vLLM fuses them (model.packed_modules_mapping: q/k/v ->
         qkv_proj, gate/up -> gate_up_proj; shards concatenated along the output dim),
      2. quantize row-wise with parity.precision.formats (per-output-channel scales are row-independent, so
         fuse-then-quantize equals the quantize stage's per-projection codes),
      3. put fresh checkpoint-layout parameters (`weight` [N, K] codes, `weight_scale` [N, 1]) on the layer and
         rerun the scheme's own `process_weights_after_loading` under the model dtype, which prepacks them and
         builds a new kernel handle owning its own tensors.
  Unquantized tensors (embeddings, norms, lm_head) are copied into vLLM's parameters in place.
Fused MoE experts of a quantized model are not handled here (a clear error; rebuild the engine instead).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from parity.precision.formats import quantize_rowwise


def pack_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """safetensors bytes: tensors cross vLLM's RPC (msgpack) to another process only as bytes."""
    from safetensors.torch import save

    return save({k: v.detach().contiguous().cpu() for k, v in named})


def unpack_tensors(payload: bytes | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if isinstance(payload, dict):
        return payload
    from safetensors.torch import load

    return load(bytes(payload) if not isinstance(payload, bytes) else payload)


def _model(worker: Any) -> torch.nn.Module:
    return worker.model_runner.model


def _model_dtype(worker: Any) -> torch.dtype:
    return worker.model_runner.model_config.dtype


def quantized_linear_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Linear layers whose compressed-tensors scheme holds quantized weights (have `weight_scale`)."""
    out = []
    for name, mod in model.named_modules():
        if getattr(mod, "scheme", None) is not None and hasattr(mod, "weight_scale"):
            out.append((name, mod))
    return out


def _fused_weight(name: str, packed: dict[str, list[str]], new: dict[str, torch.Tensor]) -> torch.Tensor:
    prefix, _, last = name.rpartition(".")
    parts = packed.get(last, [last])
    keys = [f"{prefix}.{p}.weight" if prefix else f"{p}.weight" for p in parts]
    missing = [k for k in keys if k not in new]
    if missing:
        raise KeyError(f"weight sync: no trainer tensor {missing[0]!r} for vLLM layer {name!r}")
    return torch.cat([new.pop(k).float() for k in keys], 0)


def requantize_into_model(model: torch.nn.Module, new: dict[str, torch.Tensor], dtype: torch.dtype) -> dict:
    """Load HF-named full-precision tensors into a compressed-tensors W8A8 model (module docstring)."""
    from torch.nn import Parameter
    from vllm.utils.torch_utils import set_default_torch_dtype

    new = dict(new)
    packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
    layers = quantized_linear_layers(model)
    if any("experts" in n for n, _ in layers) or any(type(m).__name__ == "FusedMoE" and
                                                      getattr(m, "quant_method", None) is not None and
                                                      hasattr(m, "w13_weight_scale") for _, m in model.named_modules()):
        raise NotImplementedError("weight sync into a quantized MoE vLLM model (fused experts) is not supported; "
                                  "set rollout.vllm_quantized_sync=rebuild")
    n_layers = 0
    for name, mod in layers:
        fmt = getattr(mod, "_parity_fmt", None)
        if fmt not in ("int8", "fp8"):
            raise RuntimeError(f"weight sync: vLLM layer {name!r} has no recorded code format (tag_quantized_formats)")
        w = _fused_weight(name, packed, new)
        q, s = quantize_rowwise(w, fmt)
        mod.register_parameter("weight", Parameter(q, requires_grad=False))
        mod.register_parameter("weight_scale", Parameter(s, requires_grad=False))
        with set_default_torch_dtype(dtype):
            mod.scheme.process_weights_after_loading(mod)
        n_layers += 1
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    params = dict(model.named_parameters())
    for key, t in new.items():
        if key not in params:
            raise KeyError(f"weight sync: vLLM model has no parameter {key!r}")
        # the parameter's own loader handles vLLM's layout (vocab rows padded to a multiple of 64, TP shards)
        getattr(params[key], "weight_loader", default_weight_loader)(params[key], t.to(params[key].dtype))
    return {"requantized_layers": n_layers, "copied": len(new)}


def tag_quantized_formats(worker: Any, fmt: str) -> int:
    """Remember each quantized layer's format once (the prepacked weight no longer shows its dtype)."""
    layers = quantized_linear_layers(_model(worker))
    for _, mod in layers:
        mod._parity_fmt = fmt
    return len(layers)


def worker_update(worker: Any, payload: bytes | dict[str, torch.Tensor], route: str) -> dict:
    """Entry point run by `collective_rpc` inside each worker."""
    tensors = unpack_tensors(payload)
    model = _model(worker)
    if route == "reload":
        worker.model_runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        return {"route": route, "tensors": len(tensors)}
    with torch.no_grad():
        info = requantize_into_model(model, tensors, _model_dtype(worker))
    return {"route": route, **info}
