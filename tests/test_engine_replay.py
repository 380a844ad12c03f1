"""TorchEngine.replay: the plain loop over given response tokens (teacher-forced decoding through the simulated
cache), the reference another decode path's tokens are scored against position by position (the packed INT4
cache's "one format" check, tests/bench/int4_decode_vs_forward.py). On the plain loop's own tokens it is the plain
loop itself, bit for bit; on the decode path's tokens it matches that path to float32 rounding; a forced token is
the token recorded and scored."""

from __future__ import annotations

import pytest
import torch

from parity.config.schema import PrecisionConfig
from parity.rollout.torch_engine import TorchEngine
from tests.test_cohort import _calls
from tests.test_cpu_lanes import _threads

W4A4 = PrecisionConfig(weights="int4", activations="int4", kv_cache="int4_per_token_head")


@pytest.mark.parametrize("precision", [None, W4A4], ids=["fp32", "w4a4-int4kv"])
def test_replay_of_the_plain_loops_own_tokens_is_the_plain_loop(prepared_model, precision) -> None:
    eng = TorchEngine(prepared_model, precision=precision, dtype=torch.float32)
    prompts, spec, ids = _calls(prepared_model, n=1)[0]
    with _threads(1):  # the plain loop in one lane: the same arithmetic as the replay's
        b = eng.generate(prompts, spec, ids)
        r = eng.replay(prompts, spec, b.responses, ids)
    for f in ("prompts", "responses", "response_mask", "truncated", "topk_ids"):
        assert torch.equal(getattr(r, f), getattr(b, f)), f
    assert torch.equal(r.rollout_logprobs, b.rollout_logprobs)
    assert r.meta["decode_path"] == "plain loop (replay)"


def test_replay_scores_the_decode_paths_tokens_and_forces_what_it_is_given(prepared_model) -> None:
    eng = TorchEngine(prepared_model, precision=W4A4, dtype=torch.float32)
    prompts, spec, ids = _calls(prepared_model, n=1)[0]
    with _threads(1):
        fast = eng.cuda_decoder.generate(prompts, spec, ids, use_graphs=False)  # the decode path's logic, eagerly
        r = eng.replay(prompts, spec, fast.responses, ids)
        assert torch.equal(r.responses, fast.responses) and torch.equal(r.response_mask, fast.response_mask)
        # float32 both ways: the decode path's products and attention sum in another order than the plain loop's
        torch.testing.assert_close(r.rollout_logprobs, fast.rollout_logprobs, rtol=0, atol=1e-4)
        # another token at position 1 of the longest row k: recorded and scored there, the row's later positions
        # conditioned on it; the other rows unchanged
        k = int(fast.response_mask.sum(-1).argmax())
        assert int(fast.response_mask[k].sum()) >= 4
        other = fast.responses.clone()
        other[k, 1] = next(t for t in range(3, 40) if t != int(other[k, 1]) and t != eng.eos_id)
        r2 = eng.replay(prompts, spec, other, ids)
    assert int(r2.responses[k, 1]) == int(other[k, 1])
    assert float(r2.rollout_logprobs[k, 1]) != float(r.rollout_logprobs[k, 1])
    assert float(r2.rollout_logprobs[k, 0]) == float(r.rollout_logprobs[k, 0])
    assert not torch.equal(r2.rollout_logprobs[k, 2:], r.rollout_logprobs[k, 2:])
    rest = [i for i in range(len(other)) if i != k]
    assert torch.equal(r2.rollout_logprobs[rest], r.rollout_logprobs[rest])
    with pytest.raises(ValueError, match="responses has 3 rows"):
        eng.replay(prompts, spec, fast.responses[:3], ids)


@pytest.mark.parametrize("precision", [None, W4A4], ids=["fp32", "w4a4-int4kv"])
def test_the_decode_paths_replay_of_its_own_tokens_is_that_path(prepared_model, precision) -> None:
    """CudaDecoder.replay: the decode path (its logic run eagerly on CPU here) over given tokens. On its own sampled
    tokens it gives its own batch bit for bit; on the plain loop's tokens it gives the plain loop's log-probs to
    float32 rounding (the two paths' products sum in other orders)."""
    eng = TorchEngine(prepared_model, precision=precision, dtype=torch.float32)
    prompts, spec, ids = _calls(prepared_model, n=1)[0]
    dec = eng.cuda_decoder
    with _threads(1):
        fast = dec.generate(prompts, spec, ids, use_graphs=False)
        again = dec.replay(prompts, spec, fast.responses, ids, use_graphs=False)
        plain = eng.generate(prompts, spec, ids)
        scored = dec.replay(prompts, spec, plain.responses, ids, use_graphs=False)
        after = dec.generate(prompts, spec, ids, use_graphs=False)  # sampling again after a replay
    for f in ("responses", "response_mask", "truncated", "topk_ids"):
        assert torch.equal(getattr(again, f), getattr(fast, f)), f
    assert torch.equal(again.rollout_logprobs, fast.rollout_logprobs)
    assert again.meta["replay"] is True and "replay" not in fast.meta
    assert torch.equal(scored.responses, plain.responses)
    torch.testing.assert_close(scored.rollout_logprobs, plain.rollout_logprobs, rtol=0, atol=1e-4)
    assert torch.equal(after.responses, fast.responses) and torch.equal(after.rollout_logprobs, fast.rollout_logprobs)
    with pytest.raises(ValueError, match="responses has 3 rows"):
        dec.replay(prompts, spec, fast.responses[:3], ids, use_graphs=False)
