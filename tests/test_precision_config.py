"""The seed YAML block loads verbatim and selects W8A8 INT8 + INT4 KV; bad precision input gives one
clear error naming the key or file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from parity.config import typed
from parity.config.schema import ParityConfig, PrecisionConfig
from parity.precision.config import (
    PrecisionConfigError,
    load_quantization_config_file,
    quantization_config_path,
    resolve_precision,
)

# DESIGN.md, Precision: this block must load verbatim
SEED_BLOCK = """\
actor_rollout_ref:
  rollout:
    dtype: bfloat16
    quantization: int8
    quantization_config_file: ${oc.env:SC_INT8_CONFIG,outputs/precision_validation/Qwen3.5-9B-W8A8-INT8/config.json}
    engine_kwargs:
      vllm:
        linear_backend: triton
        attention_backend: TRITON_ATTN
        kv_cache_dtype: int4_per_token_head
"""


def _compose(block: str = SEED_BLOCK, **dotlist: object):
    """The schema with `block` and `dotlist` on top, typed the way load_config hands it out (the seed block folded
    into rollout.precision)."""
    cfg = OmegaConf.merge(OmegaConf.structured(ParityConfig), OmegaConf.create(block))
    if dotlist:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([f"{k}={v}" for k, v in dotlist.items()]))
    return typed(cfg)


def test_seed_block_resolves_without_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SC_INT8_CONFIG", raising=False)
    cfg = _compose()
    p = resolve_precision(cfg)
    assert isinstance(p, PrecisionConfig)
    assert (p.weights, p.activations, p.kv_cache) == ("int8", "int8", "int4_per_token_head")
    assert quantization_config_path(cfg) == "outputs/precision_validation/Qwen3.5-9B-W8A8-INT8/config.json"
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm.attention_backend == "TRITON_ATTN"
    # folded once at load: rollout.precision itself holds the formats the block selects
    assert (cfg.rollout.precision.weights, cfg.rollout.precision.kv_cache) == ("int8", "int4_per_token_head")
    assert typed(OmegaConf.structured(cfg)).rollout.precision == cfg.rollout.precision  # folding again: no change


def test_seed_block_resolves_with_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    target = tmp_path / "mine" / "config.json"
    monkeypatch.setenv("SC_INT8_CONFIG", str(target))
    cfg = _compose()
    p = resolve_precision(cfg)
    assert (p.weights, p.activations, p.kv_cache) == ("int8", "int8", "int4_per_token_head")
    assert quantization_config_path(cfg) == str(target)


def test_own_keys_and_defaults() -> None:
    cfg = typed(OmegaConf.structured(ParityConfig))
    p = resolve_precision(cfg)
    assert (p.weights, p.activations, p.kv_cache) == ("bf16", "bf16", "bf16")
    cfg = _compose("{}", **{"rollout.precision.weights": "fp8", "rollout.precision.activations": "fp8",
                            "rollout.precision.kv_cache": "fp8"})
    p = resolve_precision(cfg)
    assert (p.weights, p.activations, p.kv_cache) == ("fp8", "fp8", "fp8")
    # fp8 through the seed block, KV through vLLM's name
    block = SEED_BLOCK.replace("quantization: int8", "quantization: fp8").replace(
        "int4_per_token_head", "int8_per_token_head")
    p = resolve_precision(_compose(block))
    assert (p.weights, p.activations, p.kv_cache) == ("fp8", "fp8", "int8")


def test_unknown_quantization_name() -> None:
    with pytest.raises(PrecisionConfigError, match=r"`actor_rollout_ref.rollout.quantization`.*'int3'"):
        resolve_precision(_compose(SEED_BLOCK.replace("quantization: int8", "quantization: int3")))


def test_unknown_own_value_and_kv_dtype() -> None:
    with pytest.raises(PrecisionConfigError, match=r"`rollout.precision.weights`.*'int2'"):
        resolve_precision(_compose("{}", **{"rollout.precision.weights": "int2"}))
    with pytest.raises(PrecisionConfigError, match=r"kv_cache_dtype`.*'fp8_e5m2'"):
        resolve_precision(_compose(SEED_BLOCK.replace("kv_cache_dtype: int4_per_token_head",
                                                      "kv_cache_dtype: fp8_e5m2")))


def test_conflicting_keys_are_both_named() -> None:
    with pytest.raises(PrecisionConfigError, match=r"`rollout.precision.weights`='fp8'.*quantization"):
        resolve_precision(_compose(**{"rollout.precision.weights": "fp8"}))


def test_int4_kv_with_odd_head_dim() -> None:
    with pytest.raises(PrecisionConfigError, match=r"`model.tiny.head_dim`=33.*int4_per_token_head"):
        resolve_precision(_compose(**{"model.tiny.head_dim": 33}))
    # an even head size is fine; an odd one with another KV kind too
    resolve_precision(_compose(**{"model.tiny.head_dim": 32}))
    resolve_precision(_compose("{}", **{"model.tiny.head_dim": 33, "rollout.precision.kv_cache": "int8"}))


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_quantization_config_file_missing(tmp_path: Path) -> None:
    with pytest.raises(PrecisionConfigError, match=r"quantization_config_file`: file not found: .*nope.json"):
        load_quantization_config_file(tmp_path / "nope.json")


@pytest.mark.parametrize("text, msg", [
    ("{not json", r"not valid JSON \(line 1"),
    ("[1, 2]", "must hold a JSON object"),
    ('{"architectures": ["Qwen3ForCausalLM"]}', "has no `quantization_config`"),
    ('{"quantization_config": {"quant_method": "gptq"}}', "expected 'compressed-tensors'"),
    ('{"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {}}}', "missing or empty"),
    ('{"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {"num_bits": 4, '
     '"type": "int"}}}}', r"group_0.weights: unsupported quantization 4-bit 'int'"),
])
def test_quantization_config_file_malformed(tmp_path: Path, text: str, msg: str) -> None:
    f = _write(tmp_path / "bad" / "config.json", text)
    with pytest.raises(PrecisionConfigError, match=msg) as e:
        load_quantization_config_file(f)
    assert str(f) in str(e.value) and "quantization_config_file" in str(e.value)


def test_quantization_config_file_good_and_mismatch(tmp_path: Path) -> None:
    qc = {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
          "config_groups": {"group_0": {"targets": ["Linear"],
                                        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                                        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                                                              "dynamic": True}}}}
    f = _write(tmp_path / "m-W8A8-INT8" / "config.json", json.dumps({"model_type": "qwen3", "quantization_config": qc}))
    info = load_quantization_config_file(f, expect=("int8", "int8"))
    assert (info.weights, info.activations, info.checkpoint_dir, info.ignore) == ("int8", "int8", f.parent, ["lm_head"])
    with pytest.raises(PrecisionConfigError, match="holds a W=int8 A=int8 checkpoint but the config asks for W=fp8"):
        load_quantization_config_file(f, expect=("fp8", "fp8"))


@pytest.mark.parametrize("preset, expected", [("w8a8_int8", ("int8", "int8", "bf16")),
                                              ("w8a8_int8_kv_int4", ("int8", "int8", "int4_per_token_head")),
                                              ("w8a8_fp8", ("fp8", "fp8", "bf16")),
                                              ("w8a8_fp8_kv_fp8", ("fp8", "fp8", "fp8"))])
def test_precision_presets_compose(preset: str, expected: tuple[str, str, str]) -> None:
    from parity.config import load_config

    p = resolve_precision(load_config([f"+precision={preset}"]))
    assert (p.weights, p.activations, p.kv_cache) == expected


def test_int4_activations_resolve_and_a_bad_name_lists_them() -> None:
    p = resolve_precision(_compose("{}", **{"rollout.precision.weights": "int4", "rollout.precision.activations": "int4",
                                            "rollout.precision.kv_cache": "int4_per_token_head"}))
    assert (p.weights, p.activations, p.kv_cache) == ("int4", "int4", "int4_per_token_head")
    with pytest.raises(PrecisionConfigError, match=r"`rollout.precision.activations`: unknown value 'int3'; "
                                                   r"known: bf16, int8, fp8, int4$"):
        resolve_precision(_compose("{}", **{"rollout.precision.activations": "int3"}))
