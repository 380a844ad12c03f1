"""The two-launch draw (parity.rollout.sampler_kernel, PARITY_FUSED_SAMPLER=on) on the device: against a float64
inverse-CDF draw and the unfused draw at the Qwen3 vocabulary, and in the decode path, where its log-probs of the
tokens it drew equal the unfused path's log-probs of the same tokens replayed (CudaDecoder.replay: forced tokens
take the unfused path) to float32 rounding. Its CPU checks: tests/test_sampler_kernel*.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from parity.core.sampling import SamplingSpec  # noqa: E402
from parity.rollout.sampler_kernel import ENV, fused_draw, inverse_temperature  # noqa: E402
from parity.rollout.sampling import sample_inverse_cdf  # noqa: E402
from parity.rollout.torch_engine import TorchEngine  # noqa: E402
from tests.kv_packed_checks import teacher_forced_logprobs  # noqa: E402
from tests.test_cohort_cuda import BF16, model_dir  # noqa: E402, F401, F811  (model_dir: a fixture)

PROMPTS = [[3, 17, 29, 5, 8], [44, 2, 9], [7, 7, 1, 30, 12, 6, 2], [11, 4]]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_draw_against_float64_at_the_qwen3_vocabulary(temperature) -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    B, V = 64, 151_936
    logits = torch.randn(B, V, device="cuda", generator=g) * 3.0
    u = torch.rand(B, device="cuda", generator=g, dtype=torch.float64)
    tok, lp = fused_draw(logits, temperature, u)
    x = logits.double() * inverse_temperature(temperature)
    logp = torch.log_softmax(x, -1)
    cdf = logp.exp().cumsum(-1)
    target = u[:, None] * cdf[:, -1:]
    ref = torch.searchsorted(cdf, target).clamp_max(V - 1).squeeze(-1)
    # float32 sums over up to 151,936 terms: within 2e-6 of the total a boundary may fall on either side
    safe = (cdf - target).abs().min(-1).values / cdf[:, -1] > 2e-6
    unfused = sample_inverse_cdf(torch.log_softmax(logits / temperature, -1), u)
    assert int(safe.sum()) >= 3 * B // 4 and int((tok == ref).sum()) >= B - 2
    assert torch.equal(tok[safe], ref[safe]) and torch.equal(tok[safe], unfused[safe])
    gap = float((lp.double() - logp.gather(1, tok[:, None]).squeeze(1)).abs().max())
    print(f"fused draw, T = {temperature}: {int(safe.sum())} of {B} rows away from a boundary, all equal; "
          f"log-probs within {gap:.2e} of float64")
    assert gap < 5e-5


def test_the_decode_path_draws_through_it_and_its_logprobs_are_the_unfused_ones(model_dir, monkeypatch) -> None:  # noqa: F811
    spec = SamplingSpec(temperature=1.0, max_new_tokens=48, n=2, seed=3)
    monkeypatch.setenv(ENV, "off")
    eng = TorchEngine(model_dir, precision=BF16, dtype=torch.bfloat16, device="cuda", share_prefill=False)
    off = eng.generate(PROMPTS, spec)
    assert "+fused_sampler" not in off.meta["decode_path"], off.meta
    monkeypatch.setenv(ENV, "on")
    b = eng.generate(PROMPTS, spec)
    assert "+fused_sampler" in b.meta["decode_path"], b.meta
    assert eng.cuda_decoder.compile_error is None, eng.cuda_decoder.compile_error
    again = eng.cuda_decoder.replay(PROMPTS, spec, b.responses)  # forced tokens: the unfused path's log-probs
    assert torch.equal(again.response_mask, b.response_mask)
    m = b.response_mask
    d = (b.rollout_logprobs - again.rollout_logprobs).abs()[m]
    ref = teacher_forced_logprobs(eng, b, 1.0)
    noise = float((b.rollout_logprobs.to(ref.device) - ref).abs()[m.to(ref.device)].mean())
    print(f"decode with the fused draw: its log-probs against the unfused replay of its tokens mean "
          f"{float(d.mean()):.3g} max {float(d.max()):.3g}; the format's decode noise {noise:.3g}; "
          f"{int(m.sum())} tokens, {int((b.responses != off.responses).any(-1).sum())} of {m.shape[0]} rows "
          f"drew otherwise than the unfused path")
    assert float(d.mean()) <= 0.05 * noise, (float(d.mean()), noise)
