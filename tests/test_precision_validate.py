"""Validation metrics against hand computations; validate passes on a good INT8 checkpoint and fails
on one whose scales were multiplied by 10."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3Config

from parity.config.schema import PrecisionConfig, PrecisionValidationConfig
from parity.precision.apply import quantize_model_
from parity.precision.export import load_compressed_checkpoint_
from parity.precision.sampler import ModelSampler
from parity.precision.validate import (
    PrecisionValidationError,
    exact_kl,
    greedy_prefix,
    token_metrics,
    validate_precision,
    write_report,
)
from parity.types import RolloutBatch


def test_token_metrics_hand_computed() -> None:
    lp = torch.log(torch.tensor([[0.5, 0.2, 0.9]]))
    lq = torch.log(torch.tensor([[0.25, 0.2, 0.01]]))
    mask = torch.tensor([[True, True, False]])  # the third token is padding: ignored
    m = token_metrics(lp, lq, mask, torch.tensor([[3, 4, 0]]), torch.tensor([[3, 5, 0]]))
    assert m["n_tokens"] == 2
    assert m["abs_prob_diff_mean"] == pytest.approx(0.125)
    assert m["abs_prob_diff_max"] == pytest.approx(0.25)
    assert m["abs_prob_diff_p99"] == pytest.approx(0.99 * 0.25)  # linear interpolation between 0 and 0.25
    assert m["k1_kl"] == pytest.approx(math.log(0.5) / 2)
    assert m["k3_kl"] == pytest.approx((1 - math.log(2)) / 2)  # r = p/q = 2 and 1
    assert m["top1_agreement"] == pytest.approx(0.5)
    assert m["ppl_bf16"] == pytest.approx(1 / math.sqrt(0.1))
    assert m["ppl_quant"] == pytest.approx(1 / math.sqrt(0.05))
    assert m["ppl_ratio"] == pytest.approx(math.sqrt(0.5))


def test_exact_kl_hand_computed() -> None:
    p = torch.log(torch.tensor([[[0.5, 0.5]], [[0.9, 0.1]]]))
    q = torch.log(torch.tensor([[[0.25, 0.75]], [[0.9, 0.1]]]))
    mask = torch.tensor([[True], [False]])
    assert exact_kl(p, q, mask) == pytest.approx(0.25 * math.log(0.5) + 0.75 * math.log(1.5))


def _batch(resp: list[list[int]], mask: list[list[bool]]) -> RolloutBatch:
    b = len(resp)
    return RolloutBatch(prompts=torch.ones(b, 1, dtype=torch.long), prompt_mask=torch.ones(b, 1, dtype=torch.bool),
                        responses=torch.tensor(resp), response_mask=torch.tensor(mask),
                        rollout_logprobs=torch.zeros(b, len(resp[0])), rewards=torch.zeros(b),
                        truncated=torch.zeros(b, dtype=torch.bool), group_ids=torch.arange(b),
                        prompt_ids=torch.arange(b))


def test_greedy_prefix_hand_computed() -> None:
    a = _batch([[1, 2, 3], [1, 2, 3], [7, 0, 0]], [[True] * 3, [True] * 3, [True, False, False]])
    b = _batch([[1, 2, 4], [5, 2, 3], [7, 0, 0]], [[True] * 3, [True] * 3, [True, False, False]])
    g = greedy_prefix(a, b)
    assert g["greedy_prefix_mean"] == pytest.approx(1.0)  # prefixes 2, 0, 1 (EOS-terminated at 1)
    assert g["greedy_prefix_fraction"] == pytest.approx((2 / 3 + 0 + 1) / 3)  # of the reference's lengths 3, 3, 1
    assert g["greedy_identical_fraction"] == pytest.approx(1 / 3)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64, initializer_range=0.1,
                      eos_token_id=1, pad_token_id=0)
    return AutoModelForCausalLM.from_config(cfg).eval()


PROMPTS = [[2 + (7 * i + 3 * j) % 90 for j in range(5)] for i in range(8)]
KW = dict(samples_per_prompt=2, max_new_tokens=8, pad_token_id=0, eos_token_id=1)


def test_bf16_against_itself_is_a_perfect_match() -> None:
    m = _model()
    rep = validate_precision(m, copy.deepcopy(m), PROMPTS, **KW)
    mt = rep["metrics"]
    assert rep["passed"] and mt["n_tokens"] == 8 * 2 * 8
    # a float32 model and its copy: the same kernels on the same shapes give the same bits, so these are 0; the
    # bounds leave float32 rounding room (k3 ~ d^2 / 2 of a log-ratio d ~ 1e-6 is 1e-12)
    assert mt["abs_prob_diff_max"] < 1e-6 and abs(mt["k1_kl"]) < 1e-6 and mt["k3_kl"] < 1e-9
    assert mt["top1_agreement"] == 1.0 and mt["greedy_identical_fraction"] == 1.0
    assert mt["greedy_prefix_fraction"] == 1.0
    # sampling log-probs (cached decode) against teacher-forced ones (one forward): float32 in other orders through
    # 2 layers, K <= 128: within ~K u = 8e-6 of its terms' magnitudes a layer, ~20 such steps to the logits
    assert mt["rollout_vs_rescored_max_abs"] < 1e-4


def _quantized_from_checkpoint(base: torch.nn.Module, ckpt: Path) -> torch.nn.Module:
    q = copy.deepcopy(base)
    quantize_model_(q, PrecisionConfig(weights="int8", activations="int8"))
    load_compressed_checkpoint_(q, ckpt)
    return q


def test_good_checkpoint_passes_broken_one_fails(tmp_path: Path) -> None:
    base = _model()
    good = tmp_path / "good"
    good.mkdir()
    # a dense quantized model's state dict is the compressed-tensors tensor layout (test_precision_export
    # checks export writes exactly this); writing it directly keeps this file free of that slow import
    sim = copy.deepcopy(base)
    quantize_model_(sim, PrecisionConfig(weights="int8", activations="int8"))
    save_file({k: v.contiguous() for k, v in sim.state_dict().items()}, str(good / "model.safetensors"))
    rep = validate_precision(base, _quantized_from_checkpoint(base, good), PROMPTS, PrecisionValidationConfig(), **KW,
                             enforce=True)
    mt = rep["metrics"]
    assert rep["passed"] and 0 < mt["abs_prob_diff_mean"] < 0.02 and mt["k3_kl"] < 0.01
    assert mt["kl_exact"] > 0 and mt["top1_agreement"] >= 0.9

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in good.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    state = load_file(str(broken / "model.safetensors"))
    state = {k: v * 10 if k.endswith("weight_scale") else v for k, v in state.items()}
    save_file(state, str(broken / "model.safetensors"))
    bad_model = _quantized_from_checkpoint(base, broken)
    with pytest.raises(PrecisionValidationError, match=r"k3_kl = .* > 0.01 \(threshold rollout.precision.validation.max_k3_kl\)"):
        validate_precision(base, bad_model, PROMPTS, PrecisionValidationConfig(), **KW, enforce=True)
    rep_bad = validate_precision(base, bad_model, PROMPTS, PrecisionValidationConfig(), **KW)
    assert not rep_bad["passed"] and len(rep_bad["failures"]) >= 3
    j, md = write_report(rep_bad, tmp_path / "report")
    assert json.loads(j.read_text())["passed"] is False
    text = md.read_text()
    assert "FAILED" in text and "| k3_kl |" in text and "max_k3_kl" in text


def test_engine_path_agrees_with_model_path() -> None:
    """An Engine (here the HF sampler standing in for one) gives the same token statistics; without
    full distributions, kl_exact is not reported."""
    base = _model()
    q = copy.deepcopy(base)
    quantize_model_(q, PrecisionConfig(weights="fp8", activations="fp8"))
    as_model = validate_precision(base, q, PROMPTS, **KW)["metrics"]
    as_engine = validate_precision(base, ModelSampler(q, 0, 1), PROMPTS, **KW)["metrics"]
    assert as_engine["kl_exact"] is None and as_model["kl_exact"] is not None
    # the sampler's cached decode against the model's full forward (float32, fp8 codes): the log-probs within
    # ~1e-4 (as above) unless an fp8 activation code flips at a rounding edge: rel 1e-3, abs 1e-6 near 0
    for k in ("abs_prob_diff_mean", "k1_kl", "k3_kl", "top1_agreement", "greedy_prefix_mean"):
        assert as_engine[k] == pytest.approx(as_model[k], rel=1e-3, abs=1e-6), k


def test_accuracy_hook_and_threshold() -> None:
    base = _model()
    q = copy.deepcopy(base)
    with torch.no_grad():
        q.lm_head.weight.mul_(-1)  # a different policy: greedy answers change
    decode = lambda ids: " ".join(map(str, ids))  # noqa: E731
    answers = [decode(r[:1]) for r in ModelSampler(base, 0, 1).generate(
        PROMPTS, __import__("parity.core.sampling", fromlist=["SamplingSpec"]).SamplingSpec(
            temperature=0.0, max_new_tokens=8)).responses.tolist()]
    first_token = lambda texts, ans: [float(t.split(" ")[0] == a) for t, a in zip(texts, ans)]  # noqa: E731
    rep = validate_precision(base, q, PROMPTS, PrecisionValidationConfig(max_accuracy_drop=0.5), **KW, answers=answers,
                             decode=decode, accuracy_fn=first_token)
    mt = rep["metrics"]
    assert mt["accuracy_bf16"] == 1.0 and mt["accuracy_quant"] < 0.5
    assert mt["accuracy_drop"] == pytest.approx(1.0 - mt["accuracy_quant"])
    assert any("accuracy_drop" in f and "max_accuracy_drop" in f for f in rep["failures"])


def test_bad_validation_inputs() -> None:
    m = _model()
    with pytest.raises(ValueError, match="temperature must be > 0"):
        validate_precision(m, m, PROMPTS, temperature=0.0)
    with pytest.raises(ValueError, match="at least one token"):
        validate_precision(m, m, [[3], []])
