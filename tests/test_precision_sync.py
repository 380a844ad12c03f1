"""Weight sync into a quantized torch engine: in place, equal to an engine built from the new weights,
and the engine's log-probs match the trainer's quantized reference forward."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from parity.config.schema import PrecisionConfig
from parity.core.sampling import SamplingSpec
from parity.precision.apply import quantize_model_
from parity.precision.linear import QuantLinear
from parity.precision.sampler import response_logprobs
from parity.rollout.torch_engine import TorchEngine

PROMPTS = [[2 + (5 * i + j) % 90 for j in range(4 + i % 3)] for i in range(6)]
SPEC = SamplingSpec(temperature=1.0, max_new_tokens=8, n=2, seed=3)


def _save(seed: int, out: Path) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64, initializer_range=0.1,
                      pad_token_id=0, eos_token_id=1)
    m = AutoModelForCausalLM.from_config(cfg).eval()
    m.save_pretrained(out)
    return m


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.nn.Module]:
    a, b = tmp_path_factory.mktemp("a"), tmp_path_factory.mktemp("b")
    _save(0, a)
    new = _save(1, b)
    return a, b, new


@pytest.mark.parametrize("prec", [PrecisionConfig(weights="int8", activations="int8", kv_cache="int4_per_token_head"),
                                  PrecisionConfig(weights="fp8", activations="fp8", kv_cache="fp8")])
def test_sync_equals_rebuild(dirs, prec: PrecisionConfig) -> None:  # noqa: ANN001
    a, b, new = dirs
    engine = TorchEngine(a, precision=prec, dtype=torch.float32)
    q = engine.model.model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantLinear)
    ptr = q.weight.data_ptr()
    before = engine.generate(PROMPTS, SPEC)
    seconds = engine.update_weights((n, p.detach().to(torch.bfloat16)) for n, p in new.named_parameters())
    assert seconds > 0 and q.weight.data_ptr() == ptr  # re-quantized in place, no rebuild
    rebuilt = TorchEngine(b, precision=prec, dtype=torch.float32)
    with torch.no_grad():  # the rebuilt engine starts from the same bf16-rounded weights
        for p in rebuilt.model.parameters():
            p.copy_(p.to(torch.bfloat16))
        for name, mod in rebuilt.model.named_modules():
            if isinstance(mod, QuantLinear):
                mod.set_weight(new.get_submodule(name).weight.detach().to(torch.bfloat16))
    after, ref = engine.generate(PROMPTS, SPEC), rebuilt.generate(PROMPTS, SPEC)
    assert torch.equal(after.responses, ref.responses)
    assert torch.equal(after.rollout_logprobs, ref.rollout_logprobs)
    assert not torch.equal(after.rollout_logprobs, before.rollout_logprobs)


def test_engine_logprobs_match_quantized_trainer_reference(dirs) -> None:  # noqa: ANN001
    """After a sync, the engine's pi_inf equals the trainer-side quantized model's teacher-forced
    log-probs (no KV quantization here: the trainer's HF forward has no cache codec)."""
    a, _, new = dirs
    prec = PrecisionConfig(weights="int8", activations="int8", kv_cache="bf16")
    engine = TorchEngine(a, precision=prec, dtype=torch.float32)
    engine.update_weights((n, p.detach()) for n, p in new.named_parameters())
    batch = engine.generate(PROMPTS, SPEC)
    ref_model = copy.deepcopy(new)
    quantize_model_(ref_model, prec)
    lp = response_logprobs(ref_model, batch).gather(-1, batch.responses[..., None]).squeeze(-1)
    m = batch.response_mask
    diff = (lp - batch.rollout_logprobs)[m].abs()
    # float32 forwards that differ only in attention kernels: per-token activation codes can flip at
    # rounding ties, so a few tokens differ by one code's effect; almost all agree to 1e-4 (float32 through 4
    # layers, K <= 512: within ~1e-4 of the log-probs' terms worst case, 2e-7 typically)
    assert (diff < 1e-4).float().mean() > 0.95 and diff.max() < 5e-2
    bf16_lp = response_logprobs(new, batch).gather(-1, batch.responses[..., None]).squeeze(-1)
    assert (bf16_lp - batch.rollout_logprobs)[m].abs().mean() > 10 * diff.mean()  # the reference is the quantized one


def test_w4a4_engine_runs_and_departs_from_bf16_more_than_w8a8(dirs) -> None:  # noqa: ANN001
    """The torch engine at W4A4 (+ INT4 KV) samples, reports the simulated path, and its log-probs of its own
    samples are further from the BF16 model's than a W8A8 engine's are."""
    a, _, _ = dirs
    bf16_model = AutoModelForCausalLM.from_pretrained(str(a), dtype=torch.float32).eval()

    def mean_abs_dp(prec: PrecisionConfig) -> tuple[float, TorchEngine]:
        engine = TorchEngine(a, precision=prec, dtype=torch.float32)
        batch = engine.generate(PROMPTS, SPEC)
        lp = response_logprobs(bf16_model, batch).gather(-1, batch.responses[..., None]).squeeze(-1)
        m = batch.response_mask
        assert m.any() and torch.isfinite(batch.rollout_logprobs[m]).all()
        return float((lp.exp() - batch.rollout_logprobs.exp())[m].abs().mean()), engine

    dp4, engine = mean_abs_dp(PrecisionConfig(weights="int4", activations="int4", kv_cache="int4_per_token_head"))
    assert engine.describe()["linear_path"] == "int_codes"
    assert engine.describe()["activations"] == "int4"
    dp8, _ = mean_abs_dp(PrecisionConfig(weights="int8", activations="int8", kv_cache="bf16"))
    assert dp4 > 3 * dp8 > 0, (dp4, dp8)
