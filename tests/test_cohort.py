"""A cohort (parity.rollout.cohort): N runs of one rollout format decoded in one call give each run the batch its
own engine gives it, on the plain loop and on the CUDA decode path's logic run eagerly on CPU (graphs off; the
graphs and kernels themselves are the device's to check). Three engines of the prepared tiny model, each with its
own weights (the warm start moved by a different random step), each its own prompts (of other lengths), seeds and
sampling draws; plain float32 weights, simulated W4A4 + INT4 KV, and INT8 W8A8 (its integer product run per
run)."""

from __future__ import annotations

import pytest
import torch

from parity.config.schema import PrecisionConfig
from parity.core.sampling import SamplingSpec
from parity.rollout.cohort import CohortEngine
from parity.rollout.decode_layers import _rms, cohort_linear
from parity.rollout.torch_engine import TorchEngine
from tests.test_cpu_lanes import _threads

FIELDS = ("prompts", "prompt_mask", "responses", "response_mask", "truncated", "group_ids", "prompt_ids", "topk_ids")


def _engines(model_dir, precision, n: int = 3, device: str = "cpu", dtype: torch.dtype = torch.float32
             ) -> list[TorchEngine]:
    """n engines of the model, engine i's weights moved by 2% of their size along a direction drawn from seed i
    (engine 0 keeps the warm start), through the engine's own weight sync (re-quantizing where it quantizes)."""
    out = []
    for i in range(n):
        eng = TorchEngine(model_dir, precision=precision, dtype=dtype, device=device, share_prefill=False)
        if i:
            ref = TorchEngine(model_dir, dtype=torch.float32)
            g = torch.Generator().manual_seed(100 + i)
            eng.update_weights([(k, v + 0.02 * v.abs().mean() * torch.randn(v.shape, generator=g))
                                for k, v in ref.model.state_dict().items() if v.is_floating_point()])
        out.append(eng)
    return out


def _calls(model_dir, n: int = 3, pad_to: int = 0) -> list[tuple]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    calls = []
    for i in range(n):  # run i: its own 4 prompts (of other lengths than the other runs'), ids and seed
        prompts = [tok(f"{a}+{b}{'+1' * i}=")["input_ids"] for a, b in zip(range(3 + i, 99, 17), range(50, 2, -9))][:4]
        calls.append((prompts, SamplingSpec(temperature=1.0, max_new_tokens=16, n=2, topk_logprobs=3, seed=11 + i,
                                            pad_prompts_to=pad_to), [40 + 10 * i + j for j in range(4)]))
    return calls


W4A4 = PrecisionConfig(weights="int4", activations="int4", kv_cache="int4_per_token_head")
W8A8 = PrecisionConfig(weights="int8", activations="int8", kv_cache="bf16")


@pytest.mark.parametrize("fast", [False, True], ids=["plain-loop", "decode-path"])
@pytest.mark.parametrize(("precision", "same_width"), [(None, True), (None, False), (W4A4, True), (W8A8, True)],
                         ids=["fp32-same-width", "fp32-own-width", "w4a4-int4kv", "w8a8-int8"])
def test_cohort_gives_each_run_its_own_engines_batch(prepared_model, precision, same_width, fast) -> None:
    """same-width: every run's own call is padded to the cohort's widest prompt (SamplingSpec.pad_prompts_to), so a
    run's rows meet the same shapes alone and in the cohort; own-width (plain float32 weights): each run alone
    pads to its own widest prompt, so its attention has fewer masked slots than in the cohort. (With quantized
    activations that other rounding would flip whole code steps, about 5e-3 in a log-prob on INT8 W8A8: a
    formats' amplification of noise, not the cohort's.)"""
    with _threads(1):  # one thread: a product's rounding does not follow how a call's work is split over threads
        _compare(prepared_model, precision, same_width, fast)


def _compare(prepared_model, precision, same_width: bool, fast: bool) -> None:
    engines = _engines(prepared_model, precision)
    calls = _calls(prepared_model)
    if same_width:
        calls = _calls(prepared_model, pad_to=max(len(p) for c in calls for p in c[0]))
    cohort = CohortEngine(engines)
    got = cohort.generate(calls, fast=fast, use_graphs=False)
    for i, (eng, call, batch) in enumerate(zip(engines, calls, got, strict=True)):
        ref = eng.cuda_decoder.generate(*call, use_graphs=False) if fast else eng.generate(*call)
        for f in FIELDS:
            assert torch.equal(getattr(batch, f), getattr(ref, f)), (i, f)
        # float32 throughout: a batched product sums the same K terms as the run's own product, possibly in another
        # order (relative difference up to about K * 2^-24 = 1.5e-5 for K = 256), and a prompt padded to the
        # cohort's widest adds masked slots (exact zeros) to its attention; through the layers to a log-softmax the
        # log-probs stay within 1e-4
        torch.testing.assert_close(batch.rollout_logprobs, ref.rollout_logprobs, rtol=0, atol=1e-4)
        torch.testing.assert_close(batch.topk_logprobs, ref.topk_logprobs, rtol=0, atol=1e-4)
        assert batch.meta["cohort"] == 3 and batch.meta["cohort_run"] == i
        assert batch.meta["linear_path"] == eng.describe()["linear_path"]
        if fast:
            assert batch.meta["kv_cache_layout"] == ref.meta["kv_cache_layout"]
    # the runs are different runs: other weights, other prompts, other draws
    assert not torch.equal(got[0].responses, got[1].responses)


def test_cohort_products_and_norms_against_each_runs_own() -> None:
    """cohort_linear and _rms with a weight per run, on rows grouped by run, against F.linear / HF RMSNorm run by run
    (float64, so a batched product's other summation order stays at float64's rounding)."""
    g = torch.Generator().manual_seed(0)
    N, B, T, K, OUT = 3, 4, 2, 8, 5
    x = torch.randn(N * B, T, K, generator=g, dtype=torch.float64)
    w = torch.randn(N, OUT, K, generator=g, dtype=torch.float64)
    y = cohort_linear(x, (w, None, None, None))
    for i in range(N):
        torch.testing.assert_close(y[i * B:(i + 1) * B], torch.nn.functional.linear(x[i * B:(i + 1) * B], w[i]))
    ln = torch.randn(N, K, generator=g, dtype=torch.float64)
    r = _rms(x, ln, 1e-6)
    for i in range(N):
        xi = x[i * B:(i + 1) * B]
        torch.testing.assert_close(r[i * B:(i + 1) * B], ln[i] * (xi * torch.rsqrt(xi.pow(2).mean(-1, keepdim=True) + 1e-6)))


def test_cohort_refuses_what_is_not_one_format(prepared_model) -> None:
    plain = TorchEngine(prepared_model, dtype=torch.float32)
    w4 = TorchEngine(prepared_model, precision=PrecisionConfig(weights="int4", activations="int4", kv_cache="int4_per_token_head"),
                     dtype=torch.float32)
    with pytest.raises(ValueError, match="engine 1 differs from engine 0 in linear_path"):
        CohortEngine([plain, w4])
    cohort = CohortEngine([plain, TorchEngine(prepared_model, dtype=torch.float32)])
    calls = _calls(prepared_model, 2)
    with pytest.raises(ValueError, match="got 1 calls"):
        cohort.generate(calls[:1])
    short = (calls[1][0][:3], calls[1][1], calls[1][2][:3])
    with pytest.raises(ValueError, match=r"same number of rows, got \[8, 6\]"):
        cohort.generate([calls[0], short])
    other = (calls[1][0], SamplingSpec(temperature=0.7, max_new_tokens=16, n=2, topk_logprobs=3, seed=1), calls[1][2])
    with pytest.raises(ValueError, match="run 1's sampling differs from run 0's in temperature"):
        cohort.generate([calls[0], other])


def test_cohort_sees_its_engines_weight_updates_after_sync(prepared_model) -> None:
    """After the engines' weight syncs, `sync()` copies the new weights into the stacks in place: the cohort's next
    call (on a kept decode state) gives each run its updated engine's batch."""
    engines = _engines(prepared_model, W4A4, n=2)
    calls = _calls(prepared_model, 2)
    calls = _calls(prepared_model, 2, pad_to=max(len(p) for c in calls for p in c[0]))
    cohort = CohortEngine(engines)
    before = cohort.generate(calls, fast=True, use_graphs=False)
    ref = TorchEngine(prepared_model, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    engines[1].update_weights([(k, v + 0.05 * v.abs().mean() * torch.randn(v.shape, generator=g))
                               for k, v in ref.model.state_dict().items() if v.is_floating_point()])
    cohort.sync()
    after = cohort.generate(calls, fast=True, use_graphs=False)
    assert torch.equal(after[0].responses, before[0].responses)  # run 0's weights did not move
    assert not torch.equal(after[1].rollout_logprobs, before[1].rollout_logprobs)
    own = engines[1].cuda_decoder.generate(*calls[1], use_graphs=False)
    assert torch.equal(after[1].responses, own.responses)
    torch.testing.assert_close(after[1].rollout_logprobs, own.rollout_logprobs, rtol=0, atol=1e-4)
