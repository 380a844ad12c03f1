"""`python -m parity quantize [overrides]`: write the rollout's quantized checkpoint.

The precision is the rollout's (parity.precision.config.resolve_precision: `rollout.precision` or the
seed block `actor_rollout_ref.rollout`). The checkpoint (compressed-tensors, what vLLM loads) goes to
the folder of `actor_rollout_ref.rollout.quantization_config_file` when that is set (so the run that
reads it finds it), else to `<rollout.precision.export_dir>/<model>-W8A8-INT8/` (-W8A8-FP8, -W8A16-FP8):
outputs/precision_validation/<model>-W8A8-INT8/config.json, the seed's path pattern. A sidecar
precision.json records the source model and the KV-cache format, which are runtime settings.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from parity.precision.config import PrecisionConfigError, resolve_precision
from parity.precision.export import (
    EXPORTABLE,
    export_compressed_tensors,
    quantized_checkpoint_dir,  # noqa: F401  (its home before; tasks import it here)
)
from parity.training.warm_start import prepare_model

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig

GROUPS = ["precision", "model"]
KEYS = [
    "rollout.precision.weights / .activations: int8 or fp8 (W8A8), or weights only (activations=bf16)",
    "rollout.precision.export_dir: where <model>-W8A8-INT8/ is written",
    "actor_rollout_ref.rollout.quantization, .quantization_config_file: the verl-style seed block",
]
EXAMPLES = [
    "python -m parity quantize +precision=w8a8_int8",
    "python -m parity quantize +precision=w8a8_fp8",
]


def run(cfg: ParityConfig) -> dict:
    from transformers import AutoModelForCausalLM

    precision = resolve_precision(cfg)
    if precision.weights == "bf16":
        raise PrecisionConfigError("nothing to quantize: the rollout precision has BF16 weights; set "
                                   "`actor_rollout_ref.rollout.quantization` (int8 | fp8) or `rollout.precision.weights`")

    if (precision.weights, precision.activations) not in EXPORTABLE:
        # int4 / int3 weights and int4 activations exist only as the torch engine's simulation: refuse before
        # anything is written
        raise PrecisionConfigError(
            f"config key `rollout.precision`: W={precision.weights} A={precision.activations} has no compressed-tensors "
            "checkpoint (it is simulated by the torch engine only); exportable: "
            + ", ".join(f"W={w} A={a}" for w, a in EXPORTABLE))
    source = Path(prepare_model(cfg)["model_dir"])
    t0 = time.perf_counter()
    # the stored dtype: codes then equal what an engine computes from the same weights, and the layers
    # kept unquantized (embeddings, norms, lm_head, routers) are written as they are
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype="auto")
    out = quantized_checkpoint_dir(cfg, precision)
    config_file = export_compressed_tensors(model, out, precision.weights, precision.activations, source_dir=source)
    seconds = time.perf_counter() - t0
    side = {"source_model": str(source), "weights": precision.weights, "activations": precision.activations,
            "kv_cache": precision.kv_cache, "kv_hadamard": precision.kv_hadamard}
    (out / "precision.json").write_text(json.dumps(side, indent=2))
    size = sum(f.stat().st_size for f in out.glob("model*.safetensors"))
    return {"command": "quantize", "config_file": str(config_file), "checkpoint_dir": str(out), **side,
            "checkpoint_bytes": size, "seconds": round(seconds, 3)}
