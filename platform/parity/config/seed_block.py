"""The seed experiments' verl-style rollout block, an input alias of `rollout.precision`, folded into it once when
the config is loaded (`parity.config.typed`); library code reads `rollout.precision` alone.

- `actor_rollout_ref.rollout.quantization: int8` selects W8A8 INT8 (`fp8` W8A8 FP8; QUANTIZATION_NAMES);
- `actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype` the KV cache, in vLLM's names (VLLM_KV_DTYPES).

What the block sets wins over a default `rollout.precision`; a non-default `rollout.precision` that contradicts it
is an error naming both keys. The block's engine options (the vLLM backends, `quantization_config_file`) are not
precision and stay where the engine and the validate stage read them. Folding also fixes the mismatch dial's
seed: unset, Delta follows `trainer.seed`, so seeds draw independent biases.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from parity.errors import PrecisionConfigError

# The block's names (QUANTIZATION_NAMES: `quantization` -> (weights, activations); VLLM_KV_DTYPES: vLLM's
# kv_cache_dtype -> Parity's KV kind) live with the precision's other names, which import nothing heavy: the
# dashboard reads a run's precision back with them.
from parity.precision_names import QUANTIZATION_NAMES, SEED, VLLM_KV_DTYPES

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig

def seed_formats(quantization: str | None) -> tuple[str, str] | None:
    """(weights, activations) the block's `quantization` selects, None when it is unset."""
    if quantization is None:
        return None
    name = str(quantization).lower()
    if name not in QUANTIZATION_NAMES:
        raise PrecisionConfigError(f"config key `{SEED}.quantization`: unknown quantization {quantization!r}; "
                                   f"known: {', '.join(QUANTIZATION_NAMES)}")
    return QUANTIZATION_NAMES[name]


def seed_kv(kv_cache_dtype: str | None) -> str | None:
    """The KV kind the block's vLLM `kv_cache_dtype` selects, None when it is unset."""
    if kv_cache_dtype is None:
        return None
    if str(kv_cache_dtype) not in VLLM_KV_DTYPES:
        raise PrecisionConfigError(f"config key `{SEED}.engine_kwargs.vllm.kv_cache_dtype`: unsupported KV cache "
                                   f"dtype {kv_cache_dtype!r}; known: {', '.join(VLLM_KV_DTYPES)}")
    return VLLM_KV_DTYPES[str(kv_cache_dtype)]


def _merge(key: str, own: str, seed_value: str | None, seed_key: str) -> str:
    if seed_value is None or own == seed_value:
        return own
    if own != "bf16":
        raise PrecisionConfigError(f"config keys `rollout.precision.{key}`={own!r} and `{seed_key}` (which selects "
                                   f"{seed_value!r}) disagree; set only one of them")
    return seed_value


def fold_seed_block(cfg: ParityConfig) -> ParityConfig:
    """`cfg` with the seed block's precision folded into `rollout.precision` and the dial's seed fixed, in place.
    Folding a folded config changes nothing."""
    own, seed = cfg.rollout.precision, cfg.actor_rollout_ref.rollout
    formats = seed_formats(seed.quantization)
    if formats is not None:
        own.weights = _merge("weights", str(own.weights), formats[0], f"{SEED}.quantization")
        own.activations = _merge("activations", str(own.activations), formats[1], f"{SEED}.quantization")
    own.kv_cache = _merge("kv_cache", str(own.kv_cache), seed_kv(seed.engine_kwargs.vllm.kv_cache_dtype),
                          f"{SEED}.engine_kwargs.vllm.kv_cache_dtype")
    if own.perturbation.seed is None:
        own.perturbation.seed = int(cfg.trainer.seed)
    return cfg


__all__ = ["QUANTIZATION_NAMES", "SEED", "VLLM_KV_DTYPES", "fold_seed_block", "seed_formats", "seed_kv"]
