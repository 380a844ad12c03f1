"""The names of a rollout precision, on the standard library alone (no torch, no config schema): the seed block's
spellings and the full spec token. The config loader (parity.config.seed_block), the pipeline
(parity.precision.config) and the dashboard, which reads a run's precision back from its MLflow params, use these
one set of rules.

    QUANTIZATION_NAMES   seed block `actor_rollout_ref.rollout.quantization` -> (weights, activations)
    VLLM_KV_DTYPES       vLLM's `kv_cache_dtype` -> Parity's KV kind
    precision_spec       every format of a precision as one token ('wint8-aint8-kvint4_per_token_head-nohadamard')
    parse_spec           its inverse
    formats_of_params    the precision of a flattened config (MLflow params), seed block folded in as the loader does
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

SEED = "actor_rollout_ref.rollout"

# seed block `quantization` -> (weights, activations)
QUANTIZATION_NAMES: dict[str, tuple[str, str]] = {
    "int8": ("int8", "int8"), "w8a8_int8": ("int8", "int8"), "int8_w8a8": ("int8", "int8"),
    "fp8": ("fp8", "fp8"), "w8a8_fp8": ("fp8", "fp8"), "fp8_dynamic": ("fp8", "fp8"),
    "int8_weight_only": ("int8", "bf16"), "w8a16_int8": ("int8", "bf16"),
    "fp8_weight_only": ("fp8", "bf16"), "w8a16_fp8": ("fp8", "bf16"),
    "none": ("bf16", "bf16"), "bf16": ("bf16", "bf16"),
}
# vLLM's kv_cache_dtype -> Parity's KV kind
VLLM_KV_DTYPES: dict[str, str] = {
    "auto": "bf16", "bfloat16": "bf16", "bf16": "bf16",
    "int8_per_token_head": "int8", "int8": "int8",
    "int4_per_token_head": "int4_per_token_head",
    "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_per_token_head": "fp8_per_token_head",
}


def precision_spec(weights: str, activations: str, kv_cache: str, *, kv_hadamard: bool = True,
                   perturbation_sigma: float = 0.0) -> str:
    """Every format of a rollout precision as one token, safe in a file name: 'bf16',
    'wint8-aint8-kvint4_per_token_head', with '-nohadamard' for an int4 KV cache without the rotation and
    '-sigma0.01' when the mismatch dial perturbs the rollout. What the registry stores as an artifact's or an
    evaluation's precision and what validation reports are named by; parity.tracking.naming.precision_short
    is its readable label."""
    base = "bf16" if (weights, activations, kv_cache) == ("bf16", "bf16", "bf16") else \
        f"w{weights}-a{activations}-kv{kv_cache}"
    if kv_cache == "int4_per_token_head" and not kv_hadamard:
        base += "-nohadamard"
    if perturbation_sigma and perturbation_sigma > 0:
        base += f"-sigma{float(perturbation_sigma):g}"
    return base


_SPEC = re.compile(r"^(?:bf16|w(?P<w>[a-z0-9]+)-a(?P<a>[a-z0-9]+)-kv(?P<kv>[a-z0-9_]+?))"
                   r"(?P<noh>-nohadamard)?(?:-sigma(?P<s>[0-9.e+-]+))?$")


def parse_spec(spec: str) -> dict[str, Any]:
    """The inverse of precision_spec: {'weights', 'activations', 'kv_cache', 'kv_hadamard', 'sigma'}; a string
    that is not a spec (an older registry's free text) gives bf16 formats with `unknown` set to it."""
    m = _SPEC.match(str(spec or "bf16"))
    if not m:
        return {"weights": "bf16", "activations": "bf16", "kv_cache": "bf16", "kv_hadamard": True, "sigma": 0.0,
                "unknown": str(spec)}
    return {"weights": m["w"] or "bf16", "activations": m["a"] or "bf16", "kv_cache": m["kv"] or "bf16",
            "kv_hadamard": not m["noh"], "sigma": float(m["s"]) if m["s"] else 0.0}


_UNSET = ("", "None", "none", "null")


def _text(params: Mapping[str, Any], key: str) -> str:
    v = params.get(key)
    return "" if v is None or str(v) in _UNSET else str(v)


def _flag(value: str, default: bool) -> bool:
    return default if not value else value.strip().lower() not in ("false", "0", "no", "off")


def _sigma(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        return 0.0
    return x if math.isfinite(x) and x > 0 else 0.0


def formats_of_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """{'weights', 'activations', 'kv_cache', 'kv_hadamard', 'sigma'} of a flattened config as MLflow keeps it
    (values as text). `rollout.precision.*` holds the loaded config's precision with the seed block folded in
    (parity.config.seed_block); a store written before folding, or a config that set only the seed block, has
    its precision in the seed block's names, read here through QUANTIZATION_NAMES and VLLM_KV_DTYPES (where
    both are set and agree, as after folding, either gives the same). A name outside those tables is kept as
    it is, so the label shows what was asked for."""
    own = {k: _text(params, f"rollout.precision.{k}") or "bf16" for k in ("weights", "activations", "kv_cache")}
    quant = _text(params, f"{SEED}.quantization").lower()
    seed_wa = QUANTIZATION_NAMES.get(quant, (quant, quant)) if quant else None
    kv_dtype = _text(params, f"{SEED}.engine_kwargs.vllm.kv_cache_dtype")
    seed_kv = VLLM_KV_DTYPES.get(kv_dtype, kv_dtype) if kv_dtype else None
    out: dict[str, Any] = dict(own)
    if seed_wa is not None:
        out["weights"] = own["weights"] if own["weights"] != "bf16" else seed_wa[0]
        out["activations"] = own["activations"] if own["activations"] != "bf16" else seed_wa[1]
    if seed_kv is not None:
        out["kv_cache"] = own["kv_cache"] if own["kv_cache"] != "bf16" else seed_kv
    out["kv_hadamard"] = _flag(_text(params, "rollout.precision.kv_hadamard"), True)
    out["sigma"] = _sigma(_text(params, "rollout.precision.perturbation.sigma"))
    return out


def spec_of_params(params: Mapping[str, Any]) -> str:
    """precision_spec of a flattened config (formats_of_params)."""
    f = formats_of_params(params)
    return precision_spec(f["weights"], f["activations"], f["kv_cache"], kv_hadamard=f["kv_hadamard"],
                          perturbation_sigma=f["sigma"])


__all__ = ["QUANTIZATION_NAMES", "SEED", "VLLM_KV_DTYPES", "formats_of_params", "parse_spec", "precision_spec",
           "spec_of_params"]
