"""The decode step's draw in two Triton launches (parity.rollout.sampler_kernel) under Triton's CPU interpreter,
against a float64 inverse-CDF draw and the unfused draw the decode path uses otherwise (log-softmax, then
parity.rollout.sampling.sample_inverse_cdf). Skipped without Triton (the project's CPU environment); with it:

    TRITON_INTERPRET=1 python -m pytest -q tests/test_sampler_kernel_interpret.py
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # Triton fixes interpretation when its kernels are defined
    pytest.skip("set TRITON_INTERPRET=1 before Python starts to run the kernels under Triton's interpreter",
                allow_module_level=True)

from parity.rollout.sampler_kernel import BLOCK, fused_draw, inverse_temperature  # noqa: E402
from parity.rollout.sampling import sample_inverse_cdf  # noqa: E402


def _reference(logits: torch.Tensor, temperature: float, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                    torch.Tensor]:
    """float64: (token of the inverse-CDF draw in vocabulary order, log-probs [B, V], each row's distance from its
    target to the nearest CDF boundary relative to the total)."""
    x = logits.double() * inverse_temperature(temperature)
    logp = torch.log_softmax(x, -1)
    cdf = logp.exp().cumsum(-1)
    target = u.double()[:, None] * cdf[:, -1:]
    tok = torch.searchsorted(cdf, target).clamp_max(x.shape[1] - 1).squeeze(-1)
    margin = (cdf - target).abs().min(-1).values / cdf[:, -1]
    return tok, logp, margin


@pytest.mark.parametrize("V", [1028, 4 * BLOCK, 5000])  # one partial block, whole blocks, several and a partial
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_draw_matches_float64_and_the_unfused_draw(V, temperature):
    """Tokens equal the float64 draw's wherever the target is not within float32 rounding of a CDF boundary (and
    the unfused draw's there too), log-probs within float32 rounding of the float64 log-softmax."""
    g = torch.Generator().manual_seed(V + int(temperature * 10))
    B = 48
    logits = torch.randn(B, V, generator=g) * 4.0
    logits[: B // 4, : V // 3] += 6.0  # peaked rows: most of the mass in a few blocks
    u = torch.rand(B, generator=g, dtype=torch.float64)
    tok, lp = fused_draw(logits, temperature, u)
    ref_tok, ref_logp, margin = _reference(logits, temperature, u)
    unfused = sample_inverse_cdf(torch.log_softmax(logits * inverse_temperature(temperature), -1), u)
    safe = margin > 2e-6  # float32 sums of up to V terms: within 2e-6 of the total a boundary may fall either side
    assert safe.sum() >= 3 * B // 4 and int((tok == ref_tok).sum()) >= B - 2
    assert torch.equal(tok[safe], ref_tok[safe])
    assert torch.equal(tok[safe], unfused[safe])
    assert tok.dtype == torch.int64 and lp.dtype == torch.float32
    assert bool(((tok >= 0) & (tok < V)).all())
    want = ref_logp.gather(1, tok[:, None]).squeeze(1)
    assert float((lp.double() - want).abs().max()) < 2e-5  # |log-probs| up to ~40: float32 rounding of x - lse


def test_masked_blocks_are_never_drawn():
    """Logits of -inf (a whole block and scattered tokens) carry no mass: no NaN, never drawn, the log-probs of
    the rest as if they were absent."""
    g = torch.Generator().manual_seed(7)
    B, V = 32, 3 * BLOCK + 17
    logits = torch.randn(B, V, generator=g)
    logits[:, BLOCK:2 * BLOCK] = float("-inf")
    logits[:, ::5] = float("-inf")
    u = torch.rand(B, generator=g, dtype=torch.float64)
    tok, lp = fused_draw(logits, 1.0, u)
    assert bool(torch.isfinite(lp).all())
    assert bool(torch.isfinite(logits.gather(1, tok[:, None])).all())
    want = torch.log_softmax(logits.double(), -1).gather(1, tok[:, None]).squeeze(1)
    assert float((lp.double() - want).abs().max()) < 2e-5


def test_uniform_extremes_pick_the_first_and_last_tokens_with_mass():
    """u = 0 takes the first token (the unfused draw's searchsorted rule), u just below 1 the last with mass."""
    V = 2 * BLOCK + 5
    logits = torch.zeros(2, V)
    logits[:, -3:] = float("-inf")
    u = torch.tensor([0.0, 1.0 - 1e-9], dtype=torch.float64)
    tok, _ = fused_draw(logits, 1.0, u)
    unfused = sample_inverse_cdf(torch.log_softmax(logits, -1), u)
    assert int(tok[0]) == 0 == int(unfused[0])
    assert int(tok[1]) == V - 4


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="float32"):
        fused_draw(torch.zeros(2, 8, dtype=torch.bfloat16), 1.0, torch.zeros(2))


def test_the_decode_path_draws_through_it_tails_included(prepared_model, monkeypatch):
    """The decode path with the two-launch draw (on CPU here: where it applies is forced on): its log-probs of the
    tokens it drew equal the unfused path's log-probs of the same tokens replayed (forced tokens keep the unfused
    draw), and the tail states draw as the whole batch does (same tokens, the record says so)."""
    from parity.core.sampling import SamplingSpec
    from parity.rollout import cuda_decode
    from tests.test_cohort import _calls, _engines

    monkeypatch.setattr(cuda_decode, "fused_applies", lambda spec, forced, dev: not forced and not spec.topk_logprobs)
    monkeypatch.setattr(cuda_decode, "_TAIL_MIN_ROWS", 2)
    monkeypatch.setattr(cuda_decode, "_TAIL_SHARE", 16)
    monkeypatch.setattr(cuda_decode, "_DONE_CHECK", 4)
    (eng,) = _engines(prepared_model, None, n=1)
    prompts, spec, ids = _calls(prepared_model, 1)[0]
    spec = SamplingSpec(temperature=0.8, max_new_tokens=48, n=4, seed=spec.seed)
    whole = eng.cuda_decoder.generate(prompts, spec, ids, use_graphs=False)
    assert "+fused_sampler" in whole.meta["decode_path"], whole.meta
    again = eng.cuda_decoder.replay(prompts, spec, whole.responses, ids, use_graphs=False)
    assert "+fused_sampler" not in again.meta["decode_path"] and torch.equal(again.response_mask, whole.response_mask)
    m = whole.response_mask
    assert float((whole.rollout_logprobs - again.rollout_logprobs).abs()[m].max()) < 2e-5
    eng.compact_tail = True
    tail = eng.cuda_decoder.generate(prompts, spec, ids, use_graphs=False)
    assert tail.meta.get("decode_tail_rows") and "+fused_sampler" in tail.meta["decode_path"], tail.meta
    assert torch.equal(tail.responses, whole.responses)
    torch.testing.assert_close(tail.rollout_logprobs, whole.rollout_logprobs, rtol=0, atol=1e-4)
