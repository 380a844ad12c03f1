"""The CUDA fast decode path's logic, run eagerly on CPU (graphs off): it must give what the plain loop gives.

Greedy and top-p decoding use the same sampling rule in both paths, so tokens must be identical and
log-probs equal to float32 rounding (the attention is written differently). With top_p = 1 the fast path
draws in vocabulary order: checked against hand-computed draws and against the exact distribution.
The CUDA-graph replay itself is checked on the device by tests/bench/bench_gpu.py (--check)."""

from __future__ import annotations

import pytest
import torch

from parity.config.schema import PrecisionConfig, TinyModelConfig
from parity.core.sampling import SamplingSpec
from parity.models.tiny import build_tiny_model
from parity.rollout.cuda_decode import _decode_attention, sample_inverse_cdf, supports
from parity.rollout.torch_engine import TorchEngine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu_paths_model")
    build_tiny_model("qwen3", TinyModelConfig(), seed=3).save_pretrained(str(d))
    return TorchEngine(d, dtype=torch.float32)


PROMPTS = [[5, 9, 12, 3, 7], [4, 4], [11, 2, 8, 30, 1, 6, 6, 2]]


def _both(eng: TorchEngine, spec: SamplingSpec):
    plain = eng.generate(PROMPTS, spec)
    fast = eng.cuda_decoder.generate(PROMPTS, spec, use_graphs=False)
    return plain, fast


@pytest.mark.parametrize("spec", [
    SamplingSpec(temperature=0.0, max_new_tokens=24, n=2, seed=1),
    SamplingSpec(temperature=0.9, top_p=0.8, max_new_tokens=24, n=3, topk_logprobs=5, seed=7),
])
def test_fast_path_equals_plain_loop(engine, spec):
    assert supports(engine)
    plain, fast = _both(engine, spec)
    assert torch.equal(fast.responses, plain.responses)
    assert torch.equal(fast.response_mask, plain.response_mask)
    assert torch.equal(fast.truncated, plain.truncated)
    assert torch.equal(fast.prompts, plain.prompts)
    torch.testing.assert_close(fast.rollout_logprobs, plain.rollout_logprobs, atol=2e-5, rtol=0)
    if spec.topk_logprobs:
        assert torch.equal(fast.topk_ids, plain.topk_ids)
        torch.testing.assert_close(fast.topk_logprobs, plain.topk_logprobs, atol=2e-5, rtol=0)


@pytest.mark.parametrize("bucket", [4, 7])
def test_attending_over_the_filled_prefix_only_equals_the_plain_loop(engine, bucket, monkeypatch):
    """Steps attend over the cache's first L slots (the filled prefix rounded up to the bucket): with small
    buckets one call crosses many L, and each step must still give the plain loop's tokens and log-probs."""
    import parity.rollout.cuda_decode as cd
    monkeypatch.setattr(cd, "_L_BUCKET", bucket)
    engine.cuda_decoder.reset()
    assert [cd.attended_length(8, t, 64) for t in (0, 1, 3, 4)] == [-(-(9 + t) // bucket) * bucket for t in (0, 1, 3, 4)]
    assert cd.attended_length(8, 100, 64) == 64  # never past the cache
    spec = SamplingSpec(temperature=0.9, top_p=0.8, max_new_tokens=24, n=2, topk_logprobs=3, seed=5)
    plain, fast = _both(engine, spec)
    assert torch.equal(fast.responses, plain.responses)
    torch.testing.assert_close(fast.rollout_logprobs, plain.rollout_logprobs, atol=2e-5, rtol=0)
    torch.testing.assert_close(fast.topk_logprobs, plain.topk_logprobs, atol=2e-5, rtol=0)
    engine.cuda_decoder.reset()


def test_second_call_reuses_state_and_still_matches(engine):
    spec = SamplingSpec(temperature=0.0, max_new_tokens=10, n=1, seed=2)
    before = dict(vars(engine))
    engine.cuda_decoder.generate(PROMPTS, spec, use_graphs=False)
    state = engine.cuda_decoder.state
    again = engine.cuda_decoder.generate([[3, 1, 4, 1, 5], [9, 2], [6, 5, 3]], spec, use_graphs=False)
    assert engine.cuda_decoder.state is state  # same shapes: same buffers (a graph would be replayed)
    # the fast path keeps its state in the decoder the engine owns, none in the engine
    assert vars(engine).keys() == before.keys() and all(vars(engine)[k] is v for k, v in before.items())
    plain = engine.generate([[3, 1, 4, 1, 5], [9, 2], [6, 5, 3]], spec)
    assert torch.equal(again.responses, plain.responses)


def test_two_shapes_keep_their_states_and_a_third_evicts_the_oldest(engine):
    """A run alternates its rollouts' shape and its held-out calls' (trainer.eval_rows): the decoder keeps both
    states (no new cache or capture at each switch), and a third shape frees the least recently used one; each
    call still gives the plain loop's tokens."""
    import parity.rollout.cuda_decode as cd
    engine.cuda_decoder.reset()
    spec = SamplingSpec(temperature=0.0, max_new_tokens=10, n=1, seed=2)
    wide = SamplingSpec(temperature=0.0, max_new_tokens=10, n=2, seed=2)
    engine.cuda_decoder.generate(PROMPTS, spec, use_graphs=False)
    small = engine.cuda_decoder.state
    engine.cuda_decoder.generate(PROMPTS, wide, use_graphs=False)
    large = engine.cuda_decoder.state
    assert large is not small
    again = engine.cuda_decoder.generate(PROMPTS, spec, use_graphs=False)
    assert engine.cuda_decoder.state is small
    assert torch.equal(again.responses, engine.generate(PROMPTS, spec).responses)
    assert engine.cuda_decoder.generate(PROMPTS, wide, use_graphs=False) is not None
    assert engine.cuda_decoder.state is large
    assert cd._KEEP_STATES == 2
    engine.cuda_decoder.generate(PROMPTS, SamplingSpec(temperature=0.0, max_new_tokens=10, n=3, seed=2),
                                 use_graphs=False)  # a third shape: `small`, used longest ago, goes
    assert small not in engine.cuda_decoder._kept.values() and large in engine.cuda_decoder._kept.values()
    engine.cuda_decoder.reset()
    assert engine.cuda_decoder.state is None and not engine.cuda_decoder._kept


def test_sampled_logprobs_match_a_teacher_forced_forward(engine):
    spec = SamplingSpec(temperature=0.7, max_new_tokens=16, n=4, seed=11)
    b = engine.cuda_decoder.generate(PROMPTS, spec, use_graphs=False)
    am = b.attention_mask
    with torch.no_grad():
        logits = engine.model(input_ids=b.input_ids, attention_mask=am,
                              position_ids=(am.long().cumsum(-1) - 1).clamp_min(0)).logits.double()
    P = b.prompts.shape[1]
    ref = torch.log_softmax(logits[:, P - 1:-1] / 0.7, -1).gather(-1, b.responses[..., None]).squeeze(-1)
    m = b.response_mask
    assert m.sum() > 0
    assert (b.rollout_logprobs[m].double() - ref[m]).abs().max() < 1e-4


def test_inverse_cdf_by_hand():
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64)
    logp = p.log()
    # cdf = 0.1 0.3 0.6 1.0: u in (0, .1] -> 0, (.1, .3] -> 1, (.3, .6] -> 2, (.6, 1] -> 3
    for u, want in [(0.05, 0), (0.1, 0), (0.25, 1), (0.31, 2), (0.6, 2), (0.61, 3), (0.999, 3)]:
        assert int(sample_inverse_cdf(logp, torch.tensor([u], dtype=torch.float64))) == want


def test_inverse_cdf_distribution_is_exact():
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(1, 50, generator=g, dtype=torch.float64) * 2, -1)
    u = torch.rand(200_000, generator=g, dtype=torch.float64)
    draws = sample_inverse_cdf(logp.expand(len(u), -1), u)
    freq = torch.bincount(draws, minlength=50).double() / len(u)
    p = logp.exp()[0]
    # 5 standard errors of a binomial proportion
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / len(u)).sqrt() + 1e-12).all()


@pytest.mark.parametrize("block", [4, 16])
def test_two_level_inverse_cdf_equals_the_full_scan(block):
    """Block sums then one block's scan pick the token a full-vocabulary scan picks (float64: no boundary
    within rounding here), by hand and on random rows; the block length is found for Qwen's vocabulary."""
    from parity.rollout.cuda_decode import _cdf_block
    assert _cdf_block(151_936) == 128 and _cdf_block(50) == 0 and _cdf_block(2048) == 1024
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4] * 4], dtype=torch.float64) / 4
    for u, want in [(0.01, 0), (0.024, 0), (0.026, 1), (0.26, 4), (0.2501, 4), (0.49, 7), (0.999, 15)]:
        assert int(sample_inverse_cdf(p.log(), torch.tensor([u], dtype=torch.float64), block=block)) == want
    g = torch.Generator().manual_seed(2)
    logp = torch.log_softmax(torch.randn(300, 64, generator=g, dtype=torch.float64) * 3, -1)
    u = torch.rand(300, generator=g, dtype=torch.float64)
    assert torch.equal(sample_inverse_cdf(logp, u, block=block), sample_inverse_cdf(logp, u, block=0))
    freq = torch.bincount(sample_inverse_cdf(logp[:1].expand(100_000, -1), torch.rand(100_000, generator=g,
                          dtype=torch.float64), block=block), minlength=64).double() / 100_000
    q = logp[0].exp()
    assert ((freq - q).abs() <= 5 * (q * (1 - q) / 100_000).sqrt() + 1e-12).all()


def test_grouped_attention_equals_repeated_heads():
    g = torch.Generator().manual_seed(1)
    B, H, n_kv, S, D = 3, 8, 2, 11, 16
    q = torch.randn(B, H, D, generator=g, dtype=torch.float64)
    ck = torch.randn(B, n_kv, S, D, generator=g, dtype=torch.float64)
    cv = torch.randn(B, n_kv, S, D, generator=g, dtype=torch.float64)
    kmask = torch.rand(B, S, generator=g) > 0.3
    kmask[:, 0] = True
    out = _decode_attention(q, ck, cv, kmask, 0.25).view(B, H, D)
    k = ck.repeat_interleave(H // n_kv, dim=1)  # HF's repeat_kv: query head h reads KV head h // g
    v = cv.repeat_interleave(H // n_kv, dim=1)
    s = torch.einsum("bhd,bhsd->bhs", q, k) * 0.25
    s = s.masked_fill(~kmask[:, None], float("-inf"))
    ref = torch.einsum("bhs,bhsd->bhd", s.softmax(-1), v)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)  # scores and softmax run in float32 by design


@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_stacked_projections_follow_weight_updates(tmp_path, weights):
    """q/k/v and gate/up run as one product each from stacked copies of the weights; a weight sync between
    calls (in place, re-quantizing for INT8) must reach those copies: after it the fast path still gives the plain
    loop's tokens, and the stacked weight equals the modules' weights."""

    from parity.rollout import cuda_decode as cd
    build_tiny_model("qwen3", TinyModelConfig(), seed=4).save_pretrained(str(tmp_path))
    prec = None if weights == "bf16" else PrecisionConfig(weights="int8", activations="int8", kv_cache="bf16")
    eng = TorchEngine(tmp_path, dtype=torch.float32, precision=prec)
    spec = SamplingSpec(temperature=0.0, max_new_tokens=12, n=1, seed=2)
    eng.cuda_decoder.generate(PROMPTS, spec, use_graphs=False)
    fused = eng.cuda_decoder.state.extras["fused"]
    n_layers = len(eng.model.model.layers)
    assert len(fused) == 2 * n_layers and [f.sizes[-1] for f in fused[:2]] == [
        eng.model.model.layers[0].self_attn.v_proj.out_features, eng.model.model.layers[0].mlp.up_proj.out_features]
    g = torch.Generator().manual_seed(9)
    new = [(k, v + 0.05 * torch.randn(v.shape, generator=g)) for k, v in eng.model.state_dict().items()
           if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight"))]
    eng.update_weights(new)
    fast = eng.cuda_decoder.generate(PROMPTS, spec, use_graphs=False)
    layer0 = eng.model.model.layers[0].self_attn
    assert torch.equal(fused[0].lin[0], torch.cat([layer0.q_proj.weight, layer0.k_proj.weight, layer0.v_proj.weight]))
    plain = eng.generate(PROMPTS, spec)
    assert torch.equal(fast.responses, plain.responses)
    torch.testing.assert_close(fast.rollout_logprobs, plain.rollout_logprobs, atol=2e-5, rtol=0)
    pair = cd._Fused.build([layer0.q_proj, layer0.k_proj])
    assert pair is not None and pair.sizes == (layer0.q_proj.out_features, layer0.k_proj.out_features)


def test_projections_of_different_formats_are_not_stacked():
    from parity.precision.linear import QuantLinear
    from parity.rollout import cuda_decode as cd
    a, b = torch.nn.Linear(16, 8, bias=False), torch.nn.Linear(16, 24, bias=False)
    qb = QuantLinear.from_linear(b, "int8", "int8")
    fused: list = []
    lins, sizes = cd._group([a, qb], fused)
    assert fused == [] and len(lins) == 2 and sizes == (8, 24)
    x = torch.randn(3, 16)
    y1, y2 = cd._project(x, lins, sizes)
    torch.testing.assert_close(y1, a(x))
    torch.testing.assert_close(y2, qb(x))
    lins, sizes = cd._group([a, b], fused)
    assert len(fused) == 1 and len(lins) == 1 and sizes == (8, 24)
    z1, z2 = cd._project(x, lins, sizes)
    torch.testing.assert_close(z1, a(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(z2, b(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("kv_cache", "fused_write"), [("bf16", False), ("int4_per_token_head", True)])
def test_cache_write_routes_equal_the_plain_loop(tmp_path, kv_cache, fused_write, monkeypatch):
    """The decode step writes k/v into the cache inside the pre-attention function (bf16 cache) or after it
    (a low-precision cache's roundtrip in between, or _FUSED_CACHE_WRITE off): both give the plain loop's tokens
    and log-probs; with an INT4 KV cache the fused route is not taken even when switched on."""

    from parity.rollout import cuda_decode as cd
    monkeypatch.setattr(cd, "_FUSED_CACHE_WRITE", fused_write)
    build_tiny_model("qwen3", TinyModelConfig(), seed=5).save_pretrained(str(tmp_path))
    prec = None if kv_cache == "bf16" else PrecisionConfig(weights="bf16", activations="bf16", kv_cache=kv_cache)
    eng = TorchEngine(tmp_path, dtype=torch.float32, precision=prec)
    spec = SamplingSpec(temperature=0.9, top_p=0.8, max_new_tokens=16, n=2, seed=3)
    plain, fast = _both(eng, spec)
    assert torch.equal(fast.responses, plain.responses)
    torch.testing.assert_close(fast.rollout_logprobs, plain.rollout_logprobs, atol=2e-5, rtol=0)


def test_simulated_products_keep_their_weight_dequantized_and_follow_updates(tmp_path):
    """FP8 weights with INT4 activations (both sides fake-quantized, a float32 product): the decode path multiplies
    by w_hat = codes x scales computed once a call instead of inside every product. Tokens and log-probs are the
    plain loop's, before and after a weight sync, and equal to the path that dequantizes in every product bit for
    bit; the kept weights are the modules' dequantized codes after the sync. (W4A4 multiplies its integer codes
    instead, `int_codes`: nothing to keep.)"""
    from parity.precision.linear import PREPARED, simulated_weight
    from parity.rollout import cuda_decode as cd
    build_tiny_model("qwen3", TinyModelConfig(), seed=5).save_pretrained(str(tmp_path))
    prec = PrecisionConfig(weights="fp8", activations="int4", kv_cache="bf16")
    eng = TorchEngine(tmp_path, dtype=torch.float32, precision=prec)
    spec = SamplingSpec(temperature=0.9, top_p=0.8, max_new_tokens=12, n=2, seed=3)  # top_p < 1: the same sampler
    first = eng.cuda_decoder.generate(PROMPTS, spec, use_graphs=False)
    prepared = eng.cuda_decoder.state.extras["prepared"]
    n_layers = len(eng.model.model.layers)
    assert len(prepared) == 4 * n_layers  # q/k/v stacked, o, gate/up stacked, down
    assert all(p.lin[3][2] == PREPARED and p.lin[0].dtype == torch.float32 for p in prepared)
    plain = eng.generate(PROMPTS, spec)
    assert torch.equal(first.responses, plain.responses)
    torch.testing.assert_close(first.rollout_logprobs, plain.rollout_logprobs, atol=2e-5, rtol=0)

    g = torch.Generator().manual_seed(9)
    new = [(k, v + 0.5 * torch.randn(v.shape, generator=g)) for k, v in  # large: the tiny model's layers are faint
           build_tiny_model("qwen3", TinyModelConfig(), seed=5).state_dict().items()
           if k.endswith(("proj.weight",))]
    eng.update_weights(new)
    fast = eng.cuda_decoder.generate(PROMPTS, spec, use_graphs=False)
    down = eng.model.model.layers[1].mlp.down_proj
    kept = [p for p in prepared if p.source[0] is down.weight]
    assert len(kept) == 1 and torch.equal(kept[0].lin[0], simulated_weight(down.weight, down.weight_scale, "fp8"))
    plain = eng.generate(PROMPTS, spec)
    assert torch.equal(fast.responses, plain.responses)
    torch.testing.assert_close(fast.rollout_logprobs, plain.rollout_logprobs, atol=2e-5, rtol=0)
    assert not torch.equal(fast.rollout_logprobs, first.rollout_logprobs)  # the sync changed the policy

    eng.cuda_decoder.reset()
    try:
        cd._PREPARE_SIMULATED = False
        each = eng.cuda_decoder.generate(PROMPTS, spec, use_graphs=False)
        assert eng.cuda_decoder.state.extras["prepared"] == []
    finally:
        cd._PREPARE_SIMULATED = True
        eng.cuda_decoder.reset()
    assert torch.equal(each.responses, fast.responses) and torch.equal(each.rollout_logprobs, fast.rollout_logprobs)
