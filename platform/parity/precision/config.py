"""The rollout precision of a loaded config, checked, and the quantized checkpoint's config file.

`rollout.precision.{weights, activations, kv_cache}` name the formats; the seed experiments' verl-style block
`actor_rollout_ref.rollout` is an input alias of them, folded in once when the config loads
(parity.config.seed_block), so nothing here reads it for the formats.

`quantization_config_file` is the config.json of the quantized checkpoint that `python -m parity
quantize` writes (outputs/precision_validation/<model>-W8A8-INT8/config.json): the Hugging Face
config with a compressed-tensors `quantization_config`; the checkpoint is its folder. It is read
only by the steps that need the checkpoint (vLLM engine, validate), through
`load_quantization_config_file`, never at resolve time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parity.config.schema import ParityConfig, PrecisionConfig
from parity.config.seed_block import SEED
from parity.errors import PrecisionConfigError
from parity.precision.formats import ACTIVATION_FORMATS, WEIGHT_FORMATS
from parity.precision.kv import KV_KINDS

# the spec token and its inverse import nothing heavy (parity.precision_names): the dashboard reads them too
from parity.precision_names import parse_spec, precision_spec  # noqa: F401  (parse_spec: re-exported)

# our KV kind -> the kv_cache_dtype the vLLM engine passes
KV_TO_VLLM: dict[str, str] = {"bf16": "auto", "int8": "int8_per_token_head", "fp8": "fp8",
                              "fp8_per_token_head": "fp8_per_token_head",
                              "int4_per_token_head": "int4_per_token_head"}


def head_dim_from_config(cfg: ParityConfig) -> int | None:
    """head_dim of the tiny model from the config (None when the model is an HF checkpoint: its head
    size is known only once loaded, where `kv_codec_for_model` checks it)."""
    if cfg.model.source != "tiny":
        return None
    hd = cfg.model.tiny.head_dim
    return int(hd) if hd else None


def check_kv_head_dim(kv_cache: str, head_dim: int | None, key: str = "model.tiny.head_dim") -> None:
    if kv_cache == "int4_per_token_head" and head_dim is not None and head_dim % 2:
        raise PrecisionConfigError(f"config key `{key}`={head_dim}: an int4_per_token_head KV cache packs two "
                                   "4-bit values per byte and needs an even head size")


def resolve_precision(cfg: ParityConfig) -> PrecisionConfig:
    """The rollout precision of a loaded config (the seed block already folded in), its formats checked; a
    PrecisionConfigError names the key at fault."""
    p = cfg.rollout.precision
    for key, known in (("weights", WEIGHT_FORMATS), ("activations", ACTIVATION_FORMATS), ("kv_cache", KV_KINDS)):
        value = getattr(p, key)
        if value not in known:
            raise PrecisionConfigError(f"config key `rollout.precision.{key}`: unknown value {value!r}; "
                                       f"known: {', '.join(known)}")
    check_kv_head_dim(str(p.kv_cache), head_dim_from_config(cfg))
    return p


def quantization_config_path(cfg: ParityConfig) -> str | None:
    """The seed block's quantization_config_file, interpolations (${oc.env:SC_INT8_CONFIG,...}) resolved."""
    return cfg.actor_rollout_ref.rollout.quantization_config_file


@dataclass
class QuantizedCheckpointInfo:
    """What `load_quantization_config_file` found: the checkpoint folder and its formats."""

    config_file: Path
    checkpoint_dir: Path
    weights: str
    activations: str
    ignore: list[str] = field(default_factory=list)
    quantization_config: dict = field(default_factory=dict)
    hf_config: dict = field(default_factory=dict)


def _args_format(args: Any, where: str) -> str:
    if not isinstance(args, dict):
        raise PrecisionConfigError(f"{where}: expected an object, got {type(args).__name__}")
    bits, typ = args.get("num_bits"), args.get("type")
    if bits == 8 and typ == "int":
        return "int8"
    if bits == 8 and typ == "float":
        return "fp8"
    raise PrecisionConfigError(f"{where}: unsupported quantization {bits}-bit {typ!r} (supported: 8-bit int, 8-bit float)")


def load_quantization_config_file(path: str | Path, expect: tuple[str, str] | None = None,
                                  key: str = f"{SEED}.quantization_config_file") -> QuantizedCheckpointInfo:
    """Read and check the quantized checkpoint's config.json (or a bare compressed-tensors
    quantization_config JSON). Errors name the config key and the file; `expect` = (weights,
    activations) the config asked for, checked against the file."""
    p = Path(str(path))
    if not p.is_file():
        raise PrecisionConfigError(f"config key `{key}`: file not found: {p} (write it with `python -m parity "
                                   "quantize`, or point SC_INT8_CONFIG at an existing one)")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise PrecisionConfigError(f"config key `{key}`: {p} is not valid JSON (line {e.lineno}, column {e.colno}: "
                                   f"{e.msg})") from e
    if not isinstance(data, dict):
        raise PrecisionConfigError(f"config key `{key}`: {p} must hold a JSON object, got {type(data).__name__}")
    qc = data.get("quantization_config", data if "quant_method" in data else None)
    if not isinstance(qc, dict):
        raise PrecisionConfigError(f"config key `{key}`: {p} has no `quantization_config` object")
    if qc.get("quant_method") != "compressed-tensors":
        raise PrecisionConfigError(f"config key `{key}`: {p}: quantization_config.quant_method is "
                                   f"{qc.get('quant_method')!r}, expected 'compressed-tensors'")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise PrecisionConfigError(f"config key `{key}`: {p}: quantization_config.config_groups is missing or empty")
    formats = set()
    for gname, g in groups.items():
        where = f"config key `{key}`: {p}: config_groups.{gname}"
        if not isinstance(g, dict) or "weights" not in g:
            raise PrecisionConfigError(f"{where} has no `weights` entry")
        w = _args_format(g["weights"], f"{where}.weights")
        a = "bf16" if g.get("input_activations") is None else _args_format(g["input_activations"],
                                                                            f"{where}.input_activations")
        formats.add((w, a))
    if len(formats) != 1:
        raise PrecisionConfigError(f"config key `{key}`: {p}: config groups mix formats {sorted(formats)}")
    weights, activations = formats.pop()
    if expect is not None and tuple(expect) != (weights, activations):
        raise PrecisionConfigError(f"config key `{key}`: {p} holds a W={weights} A={activations} checkpoint but the "
                                   f"config asks for W={expect[0]} A={expect[1]}")
    return QuantizedCheckpointInfo(config_file=p, checkpoint_dir=p.parent, weights=weights, activations=activations,
                                   ignore=list(qc.get("ignore") or []), quantization_config=qc,
                                   hf_config=data if "quantization_config" in data else {})


def spec_of(precision: PrecisionConfig) -> str:
    """precision_spec of a resolved precision (resolve_precision)."""
    from parity.precision.perturbation import perturbation_of

    return precision_spec(str(precision.weights), str(precision.activations), str(precision.kv_cache),
                          kv_hadamard=bool(precision.kv_hadamard),
                          perturbation_sigma=perturbation_of(precision)[0])


