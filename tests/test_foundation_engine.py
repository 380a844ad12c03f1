"""Torch rollout engine: log-probs agree with a separate forward, sampling is shard-invariant."""

from __future__ import annotations

import pytest
import torch

from parity.config.schema import TinyModelConfig
from parity.core.sampling import SamplingSpec
from parity.models.tiny import build_tiny_model
from parity.models.tokenizer import save_char_tokenizer
from parity.rollout.torch_engine import TorchEngine


@pytest.fixture(scope="module")
def random_model(tmp_path_factory):
    d = tmp_path_factory.mktemp("rand_model")
    model = build_tiny_model("qwen3", TinyModelConfig(), seed=1)
    model.save_pretrained(str(d))
    tok = save_char_tokenizer(d)
    return d, tok, model


def _prompts(tok):
    return [tok(s)["input_ids"] for s in ["12+3= Answer in \\boxed{}.\n", "7*8=", "100-1 ok\n"]]


def test_sampled_logprobs_equal_a_separate_forward(random_model):
    d, tok, model = random_model
    eng = TorchEngine(d)
    b = eng.generate(_prompts(tok), SamplingSpec(temperature=0.8, max_new_tokens=20, n=4, topk_logprobs=16, seed=5))
    ref = model.to(torch.bfloat16).eval()
    am = b.attention_mask
    with torch.no_grad():
        logits = ref(input_ids=b.input_ids, attention_mask=am,
                     position_ids=(am.long().cumsum(-1) - 1).clamp_min(0)).logits.float()
    P = b.prompts.shape[1]
    lp = torch.log_softmax(logits[:, P - 1:-1] / 0.8, -1)
    sampled = lp.gather(-1, b.responses[..., None]).squeeze(-1)
    m = b.response_mask
    diff = (sampled.exp() - b.rollout_logprobs.exp()).abs()[m]
    assert m.sum() > 40
    # BF16 vs BF16 with different kernels (cached decode vs one full forward): ~45 roundings of 2^-8 to the logits
    # (4 layers), typically sqrt(45) 2^-8 ~ 2.6e-2 relative of a logit; in p (<= 1, |dp| <= p |dlp|) below 2e-2
    assert diff.mean() < 2e-3 and diff.max() < 2e-2
    assert b.rollout_logprobs.dtype == torch.float32
    assert bool((b.rollout_logprobs[~m] == 0).all())
    # top-K: sorted, normalised over the full vocabulary, contains the sampled token when it ranks in the top-K
    tk = b.topk_logprobs
    assert bool((tk[..., :-1] >= tk[..., 1:])[m].all())
    ref_topk = lp.topk(16, -1).values
    assert torch.allclose(tk[m], ref_topk[m], atol=3e-2)  # log-probs: the 2.6e-2 estimate above
    in_topk = (b.topk_ids.long() == b.responses[..., None]).any(-1)
    lp_s, kth = b.rollout_logprobs[m], tk[m][:, -1]
    assert bool((lp_s[in_topk[m]] >= kth[in_topk[m]]).all())  # in the top-K -> at least the K-th value
    assert bool(in_topk[m][lp_s > kth].all())  # strictly above the K-th value -> in the top-K (BF16 ties aside)
    assert torch.allclose(tk.exp().sum(-1)[m], lp.topk(16, -1).values.exp().sum(-1)[m], atol=2e-2)  # sum of p: as p


def _full_and_part(d, tok, dtype):
    """The three prompts in one call, and the third alone padded to the same prompt width."""
    eng = TorchEngine(d, dtype=dtype)
    spec = SamplingSpec(temperature=1.0, max_new_tokens=16, n=3, seed=11)
    full = eng.generate(_prompts(tok), spec)
    P = full.prompts.shape[1]
    part = eng.generate(_prompts(tok)[2:], SamplingSpec(**{**spec.__dict__, "pad_prompts_to": P}), prompt_ids=[2])
    return eng, full, part


def _agree_up_to_the_first_differing_token(full, part, bound: float) -> None:
    """Rows 6-8 of the one call against the same prompt's call alone: the first token (the prefill runs in chunks of
    a fixed shape) the same with the same log-prob, and up to each row's first differing token, if any, the log-probs
    within `bound`."""
    a, b = full.responses[6:9], part.responses
    assert torch.equal(a[:, 0], b[:, 0])
    assert torch.equal(full.rollout_logprobs[6:9, 0], part.rollout_logprobs[:, 0])
    for r in range(3):
        differ = (a[r] != b[r]).nonzero()
        first = int(differ[0]) if len(differ) else min(a.shape[1], b.shape[1])
        gap = (full.rollout_logprobs[6 + r, :first] - part.rollout_logprobs[r, :first]).abs()
        assert float(gap.max()) <= bound, (r, float(gap.max()), bound)


def test_shard_invariance_and_eos_handling(random_model):
    """float32: a decode step of 9 rows and one of 3 may take different matrix-product kernels on some CPUs (MKL's
    strict reproducibility mode, which `import parity` sets, keeps them apart on Intel's AVX512 Xeons; an AMD EPYC
    with AVX512-BF16 still rounded 12 of 45 log-probs one float32 ulp apart, 4.8e-7 on log-probs between 4 and 8).
    Bound: a forward is about 45 roundings to a logit, each at most 2^-24 relative, so a logit moves by at most
    45 x 2^-24 = 2.7e-6 of its size, a log-softmax by at most twice the logits' largest change (this random model's
    logits are of order 1: 1.03 at most on these prompts, so 2 x 2.7e-6 x 1.1 = 5.9e-6), and the log-softmax's own
    subtraction and log round to a few ulps of the log-prob (4 ulps of a value below 8: 1.9e-6)."""
    d, tok, _ = random_model
    eng, full, part = _full_and_part(d, tok, torch.float32)
    _agree_up_to_the_first_differing_token(full, part, 2 * 45 * 2.0 ** -24 * 1.1 + 4 * 2.0 ** -24 * 8)
    # after EOS nothing is sampled: the mask is a prefix and truncated means "no EOS within the budget"
    m = full.response_mask.long()
    assert bool((m[:, 1:] <= m[:, :-1]).all())
    for row in range(full.batch_size):
        n = int(m[row].sum())
        has_eos = n > 0 and int(full.responses[row, n - 1]) == eng.eos_id
        assert bool(full.truncated[row]) == (not has_eos)


def test_shard_invariance_in_bfloat16_up_to_a_rounding(random_model):
    """bfloat16 matmuls on CPU go through oneDNN, which on some CPUs (AVX512 without native bf16) picks its kernel by
    the row count: a decode step of 9 rows and one of 3 can round an output to neighbouring bf16 values, and a
    sampled token can then flip. What holds on every CPU: the first token (the prefill runs in chunks of a fixed
    shape) is the same with the same log-prob, and until a row's first differing token its log-probs agree within
    bf16 rounding of a whole forward (about 45 roundings of 2^-8 to the logits, typically sqrt(45) 2^-8 = 2.6e-2
    relative of a logit; its log-softmax moves by at most twice the logits' change: 5e-2 for logits of order 1)."""
    d, tok, _ = random_model
    _, full, part = _full_and_part(d, tok, torch.bfloat16)
    _agree_up_to_the_first_differing_token(full, part, 5e-2)


def test_greedy_equals_tiny_top_p(random_model):
    d, tok, _ = random_model
    eng = TorchEngine(d)
    g = eng.generate(_prompts(tok), SamplingSpec(temperature=0.0, max_new_tokens=10, n=1))
    p = eng.generate(_prompts(tok), SamplingSpec(temperature=1.0, top_p=1e-6, max_new_tokens=10, n=1, seed=3))
    assert torch.equal(g.responses, p.responses)


def test_prompt_too_long_is_a_clear_error(random_model):
    d, tok, _ = random_model
    eng = TorchEngine(d)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        eng.generate([[5] * 250], SamplingSpec(max_new_tokens=16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shared_prefill_gives_the_per_row_prefill_batch(random_model, dtype):
    """One prompt forward per distinct prompt, its cache copied to the prompt's rollout.n rows: the batch of a
    prompt forward per row up to rounding (the matrix products of 3 rows and of 12 may take different kernels;
    prompts of different lengths, top-K on, EOS inside the budget)."""
    d, tok, _ = random_model
    eng = TorchEngine(d, dtype=dtype)
    spec = SamplingSpec(temperature=1.0, max_new_tokens=12, n=4, topk_logprobs=8, seed=11)
    eng.share_prefill = True  # rollout.shared_prefill
    shared = eng.generate(_prompts(tok), spec)
    eng.share_prefill = False
    per_row = eng.generate(_prompts(tok), spec)
    for f in ("responses", "response_mask", "truncated"):
        assert torch.equal(getattr(shared, f), getattr(per_row, f)), f
    tol = 1e-5 if dtype == torch.float32 else 5e-2  # a bf16 rounding flip of an activation
    for f in ("rollout_logprobs", "topk_logprobs"):
        err = float((getattr(shared, f) - getattr(per_row, f)).abs().max())
        print(f"{dtype} {f}: max |shared - per row| = {err:.2e}")
        assert err <= tol, (f, err)


def test_rollout_shared_prefill_key_reaches_the_torch_engine(random_model, quick_cfg):
    """`rollout.shared_prefill` (on by default) and `rollout.cpu_lanes` are the engine's options, set by build_engine."""
    from parity.rollout import build_engine

    d, _, _ = random_model
    assert build_engine(quick_cfg(), d).share_prefill is True
    assert build_engine(quick_cfg("rollout.shared_prefill=false"), d).share_prefill is False
    assert build_engine(quick_cfg(), d).cpu_lanes == 2
    assert build_engine(quick_cfg("rollout.cpu_lanes=1"), d).cpu_lanes == 1
