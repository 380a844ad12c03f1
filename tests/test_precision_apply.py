"""quantize_model_ on tiny HF Qwen3 / Qwen3-MoE models and load_weights_ (weight sync)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

from parity.config.schema import PrecisionConfig
from parity.precision import int8_triton
from parity.precision.apply import QuantExperts, kv_codec_for_model, load_weights_, quantize_model_
from parity.precision.formats import fake_quantize
from parity.precision.linear import QuantLinear

COMMON = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=64)


def _dense(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(Qwen3Config(intermediate_size=128, **COMMON)).eval()


def _moe(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(intermediate_size=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                         **COMMON)
    return AutoModelForCausalLM.from_config(cfg).eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(0))


def test_dense_replacement_leaves_embeddings_head_norms() -> None:
    m = _dense()
    info = quantize_model_(m, PrecisionConfig(weights="int8", activations="int8", kv_cache="int4_per_token_head"))
    assert info["quantized_linear"] == 2 * 7 and info["paths"] == {"int8_simulated": 14}
    assert info["kv"]["kind"] == "int4_per_token_head"
    quant = {n for n, mod in m.named_modules() if isinstance(mod, QuantLinear)}
    assert "model.layers.1.mlp.down_proj" in quant and "model.layers.0.self_attn.k_proj" in quant
    assert type(m.lm_head) is nn.Linear and type(m.model.embed_tokens) is nn.Embedding
    assert m.model.layers[0].input_layernorm.weight.dtype == torch.float32
    assert not any(isinstance(mod, nn.Linear) and ".layers." in n for n, mod in m.named_modules())


def test_dense_logits_match_float64_fake_quant_reference() -> None:
    """Reference: the same model in float64 where each decoder Linear computes
    F.linear(fq(x), fq(W)) with fq = per-token / per-channel INT8 quantize-dequantize."""
    base = _dense()
    q = copy.deepcopy(base)
    quantize_model_(q, PrecisionConfig(weights="int8", activations="int8"))
    ref = copy.deepcopy(base).double()
    for name, mod in ref.named_modules():
        if isinstance(mod, nn.Linear) and ".layers." in name:
            wq = fake_quantize(mod.weight.detach(), "int8")
            mod.forward = (lambda w: lambda x: F.linear(fake_quantize(x, "int8"), w))(wq)
    ids = _ids()
    got = q(ids).logits.double()
    want = ref(ids).logits
    bf16 = base(ids).logits.double()
    err = (got - want).abs().max()
    # float32 against float64 with the same INT8 codes: 2 layers, K <= 128, each linear within K u (8e-6) of its
    # terms, ~20 such steps to logits of size <= 0.6: ~1e-4 worst case, 2e-4 with the norms. A code that rounds
    # the other way (a float32 activation within ~1e-6 relative of a .5 tie) would move a logit by ~s |w| ~ 5e-4:
    # this bound assumes none does.
    assert err < 2e-4, err
    assert (bf16 - want).abs().max() > 20 * err  # quantization is visible, the reference explains it


def test_moe_experts_quantized_router_kept() -> None:
    m = _moe()
    info = quantize_model_(m, PrecisionConfig(weights="int8", activations="int8"))
    assert info["quantized_experts"] == 2 and info["quantized_linear"] == 2 * 4
    mlp = m.model.layers[0].mlp
    assert isinstance(mlp.experts, QuantExperts) and type(mlp.gate).__name__ == "Qwen3MoeTopKRouter"
    assert mlp.gate.weight.dtype == torch.float32
    assert m(_ids()).logits.isfinite().all()


@pytest.mark.parametrize("fmt", ["int8", "int4", "int3"])
def test_moe_weight_only_equals_dequantized_reference(fmt: str) -> None:
    base = _moe()
    q = copy.deepcopy(base)
    quantize_model_(q, PrecisionConfig(weights=fmt, activations="bf16"))
    qmax = {"int8": 127, "int4": 7, "int3": 3}[fmt]
    for lq, lb in zip(q.model.layers, base.model.layers):  # codes of the format, one scale per output channel
        for name in ("gate_up_proj", "down_proj"):
            codes = getattr(lq.mlp.experts, name)
            assert codes.dtype == torch.int8 and codes.abs().max() == qmax
            assert torch.equal(lq.mlp.experts.dequantized(name), fake_quantize(getattr(lb.mlp.experts, name).detach(), fmt))
    ref = copy.deepcopy(base)
    with torch.no_grad():
        for lq, lr in zip(q.model.layers, ref.model.layers):
            lr.mlp.experts.gate_up_proj.copy_(lq.mlp.experts.dequantized("gate_up_proj"))
            lr.mlp.experts.down_proj.copy_(lq.mlp.experts.dequantized("down_proj"))
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(lr.self_attn, name).weight.copy_(getattr(lq.self_attn, name).dequantized_weight())
    ids = _ids()
    # the same float32 model with the dequantized weights in place: the expert path differs only in how it applies
    # the dequantization (scale per channel before or after the product: one rounding of each term, u)
    torch.testing.assert_close(q(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("build", [_dense, _moe])
def test_load_weights_equals_quantizing_the_new_weights(build) -> None:  # noqa: ANN001
    engine = build(seed=0)
    quantize_model_(engine, PrecisionConfig(weights="int8", activations="int8"))
    trainer = build(seed=1)  # "after an optimizer step": different weights, same names
    load_weights_(engine, ((n, p.detach().to(torch.bfloat16)) for n, p in trainer.named_parameters()))
    expected = copy.deepcopy(trainer)
    with torch.no_grad():  # the parameters only: `.to(bfloat16)` would also round the RoPE buffers
        for prm in expected.parameters():
            prm.copy_(prm.to(torch.bfloat16))
    quantize_model_(expected, PrecisionConfig(weights="int8", activations="int8"))
    got, want = engine.state_dict(), expected.state_dict()
    assert got.keys() == want.keys()
    for k in got:
        assert torch.equal(got[k].float(), want[k].float()), k
    ids = _ids()
    assert torch.equal(engine(ids).logits, expected(ids).logits)


def test_load_weights_checkpoint_expert_names() -> None:
    """Per-expert names as save_pretrained writes them land in the fused quantized tensors."""
    engine = _moe(seed=0)
    quantize_model_(engine, PrecisionConfig(weights="fp8", activations="fp8"))
    trainer = _moe(seed=1)
    expected = copy.deepcopy(trainer)
    quantize_model_(expected, PrecisionConfig(weights="fp8", activations="fp8"))
    i = 32

    def checkpoint_names():
        for n, p in trainer.named_parameters():
            if n.endswith("experts.gate_up_proj"):
                stem = n[: -len("gate_up_proj")]
                for e in range(p.shape[0]):
                    yield f"{stem}{e}.gate_proj.weight", p[e, :i].detach()
                    yield f"{stem}{e}.up_proj.weight", p[e, i:].detach()
            elif n.endswith("experts.down_proj"):
                stem = n[: -len("down_proj")]
                for e in range(p.shape[0]):
                    yield f"{stem}{e}.down_proj.weight", p[e].detach()
            else:
                yield n, p.detach()

    load_weights_(engine, checkpoint_names())
    for k, v in expected.state_dict().items():
        assert torch.equal(engine.state_dict()[k].float(), v.float()), k


def test_load_weights_bad_names_and_shapes() -> None:
    m = _dense()
    quantize_model_(m, PrecisionConfig(weights="int8", activations="int8"))
    with pytest.raises(KeyError, match="model.layers.0.self_attn.qq_proj.weight"):
        load_weights_(m, [("model.layers.0.self_attn.qq_proj.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match=r"shape \(64, 63\)"):
        load_weights_(m, [("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 63))])
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_weights_(m, [("model.norm.weight", torch.zeros(3))])


def test_int4_kv_with_odd_head_dim_model() -> None:
    # transformers refuses an odd head_dim for Qwen3 (RoPE), so a model-like module carries the config
    m = nn.Module()
    m.config = Qwen3Config(intermediate_size=32, **COMMON)
    m.config.head_dim = 15
    with pytest.raises(ValueError, match=r"kv_cache='int4_per_token_head' for model with head_dim=15"):
        quantize_model_(m, PrecisionConfig(weights="int8", activations="int8", kv_cache="int4_per_token_head"))
    assert kv_codec_for_model(m, PrecisionConfig(kv_cache="int8")).kind == "int8"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantized_model_on_cuda_matches_cpu(fmt: str) -> None:
    m = _dense()
    quantize_model_(m, PrecisionConfig(weights=fmt, activations=fmt))
    ids = _ids()
    cpu = m(ids).logits
    info = quantize_model_(copy.deepcopy(_moe()).cuda(), PrecisionConfig(weights=fmt, activations=fmt))
    want = ({"int8_triton"} if int8_triton.usable() else {"int8_mm_cuda"}) if fmt == "int8" else {"fp8_scaled_mm"}
    assert set(info["paths"]) == want
    m.cuda()
    assert {mod.path for mod in m.modules() if isinstance(mod, QuantLinear)} == set(info["paths"])
    gpu = m(ids.cuda()).logits.cpu()
    # int8: same integers, float epilogue differs in order; fp8: bf16 output of the scaled GEMM
    # logits of size <= 0.6: int8 ~ 20 float32 epilogues in other orders (1e-3 leaves room for a flipped code's
    # 5e-4); fp8's GPU GEMM writes bf16 (2^-8 of each of ~20 outputs, typically sqrt(20) 2^-8 ~ 1.7e-2 of a logit)
    torch.testing.assert_close(gpu, cpu, rtol=0, atol=1e-3 if fmt == "int8" else 3e-2)


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_int4_activation_logits_match_float64_fake_quant_reference(weights: str) -> None:
    """W4A4 / W8A4: every decoder Linear computes F.linear(fq4(x), fq(W)), fq4 = per-token INT4 (as the integer
    codes' exact product, `int_codes`); the float64 reference explains the quantized logits, and the error from bf16
    is far larger than at W8A8."""
    base = _dense()
    q = copy.deepcopy(base)
    info = quantize_model_(q, PrecisionConfig(weights=weights, activations="int4"))
    assert info["paths"] == {"int_codes": 14}
    ref = copy.deepcopy(base).double()
    for name, mod in ref.named_modules():
        if isinstance(mod, nn.Linear) and ".layers." in name:
            wq = fake_quantize(mod.weight.detach(), weights)
            mod.forward = (lambda w: lambda x: F.linear(fake_quantize(x, "int4"), w))(wq)
    ids = _ids()
    got, want, bf16 = q(ids).logits.double(), ref(ids).logits, base(ids).logits.double()
    err = (got - want).abs().max()
    assert err < 2e-4, err  # as for W8A8 above: float32 against float64 with the same codes
    w8a8 = copy.deepcopy(base)
    quantize_model_(w8a8, PrecisionConfig(weights="int8", activations="int8"))
    assert (bf16 - want).abs().max() > 4 * (bf16 - w8a8(ids).logits.double()).abs().max()
