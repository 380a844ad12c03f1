"""`quantize` then `validate` on a tiny saved model, through the composed Hydra config: the seed's path
pattern, the report beside config.json, a non-zero failure on a checkpoint with scales x 10, and one
clear error for a missing or malformed quantization_config_file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3Config

from parity.config import load_config
from parity.models.tokenizer import EOS, PAD, save_char_tokenizer
from parity.precision.config import PrecisionConfigError
from parity.precision.validate import PrecisionValidationError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny")
    tok = save_char_tokenizer(out)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                      initializer_range=0.1, pad_token_id=tok.convert_tokens_to_ids(PAD),
                      eos_token_id=tok.convert_tokens_to_ids(EOS), bos_token_id=tok.convert_tokens_to_ids(EOS))
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(out)
    return out


def _cfg(model_dir: Path, outputs: Path, *extra: str):
    return load_config([f"model.path={model_dir}", f"outputs_dir={outputs}", "trainer.device=cpu",
                        "rollout.precision.validation.num_prompts=6", "rollout.precision.validation.max_new_tokens=6",
                        # an untrained random model with an int4 cache agrees less on top-1 than a trained one
                        "rollout.precision.validation.min_top1_agreement=0.6",
                        "rollout.precision.validation.samples_per_prompt=2", *extra])


def test_quantize_then_validate_with_seed_defaults(model_dir: Path, tmp_path: Path) -> None:
    from parity.commands import quantize, validate

    cfg = _cfg(model_dir, tmp_path, "actor_rollout_ref.rollout.quantization=int8",
               "actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype=int4_per_token_head")
    q = quantize.run(cfg)
    expected = tmp_path / "precision_validation" / "tiny_qwen3-W8A8-INT8" / "config.json"
    assert Path(q["config_file"]) == expected and expected.is_file()
    assert q["kv_cache"] == "int4_per_token_head" and (expected.parent / "tokenizer.json").is_file()
    hf = json.loads(expected.read_text())
    assert hf["quantization_config"]["format"] == "int-quantized"
    v = validate.run(cfg)
    assert v["passed"] and Path(v["report_json"]).parent == expected.parent / "validations"
    report = json.loads(Path(v["report_json"]).read_text())
    assert report["quant"]["kv_cache"] == "int4_per_token_head" and report["quant"]["engine"] == "torch"
    assert report["metrics"]["accuracy_bf16"] is not None  # graded by math-verify (an untrained model: ~0)
    assert "| abs_prob_diff_mean |" in Path(v["report_md"]).read_text()

    # the same checkpoint with every scale x 10: validate stops with the reason, report written first
    st = expected.parent / "model.safetensors"
    state = load_file(str(st))
    save_file({k: v * 10 if k.endswith("weight_scale") else v for k, v in state.items()}, str(st))
    with pytest.raises(PrecisionValidationError, match=r"precision validation failed: .*threshold rollout\.precision"):
        validate.run(cfg)
    assert json.loads((expected.parent / "validation.json").read_text())["passed"] is False  # the latest
    assert json.loads(Path(v["report_json"]).read_text())["passed"] is True  # the earlier one is kept


def test_seed_path_from_env(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from parity.commands import quantize

    target = tmp_path / "elsewhere" / "Qwen3.5-9B-W8A8-INT8" / "config.json"
    monkeypatch.setenv("SC_INT8_CONFIG", str(target))
    seed = ("actor_rollout_ref.rollout.quantization_config_file="
            "${oc.env:SC_INT8_CONFIG,outputs/precision_validation/Qwen3.5-9B-W8A8-INT8/config.json}")
    cfg = _cfg(model_dir, tmp_path, "actor_rollout_ref.rollout.quantization=int8", seed)
    assert Path(quantize.run(cfg)["config_file"]) == target and target.is_file()


def test_validate_without_checkpoint_or_with_malformed_file(model_dir: Path, tmp_path: Path) -> None:
    from parity.commands import validate

    missing = tmp_path / "nope" / "config.json"
    cfg = _cfg(model_dir, tmp_path, "actor_rollout_ref.rollout.quantization=int8",
               f"actor_rollout_ref.rollout.quantization_config_file={missing}")
    with pytest.raises(PrecisionConfigError, match=r"quantization_config_file`: file not found: .*nope/config.json"):
        validate.run(cfg)
    missing.parent.mkdir()
    missing.write_text('{"quantization_config": {"quant_method": "compressed-tensors"')
    with pytest.raises(PrecisionConfigError, match=r"is not valid JSON \(line 1"):
        validate.run(cfg)
    cfg = _cfg(model_dir, tmp_path, "rollout.precision.weights=fp8", "rollout.precision.activations=fp8")
    with pytest.raises(PrecisionConfigError, match=r"rollout.precision.export_dir.*tiny_qwen3-W8A8-FP8"):
        validate.run(cfg)


def test_quantize_needs_a_quantized_precision(model_dir: Path, tmp_path: Path) -> None:
    from parity.commands import quantize

    with pytest.raises(PrecisionConfigError, match="nothing to quantize"):
        quantize.run(_cfg(model_dir, tmp_path))


def test_quantize_refuses_int4_activations_naming_the_key(model_dir: Path, tmp_path: Path) -> None:
    from parity.commands import quantize

    out = tmp_path / "out"
    with pytest.raises(PrecisionConfigError, match=r"`rollout.precision`: W=int8 A=int4 has no compressed-tensors "
                                                   r"checkpoint \(it is simulated by the torch engine only\)"):
        quantize.run(_cfg(model_dir, out, "rollout.precision.weights=int8", "rollout.precision.activations=int4"))
    assert not (out / "precision_validation").exists()
