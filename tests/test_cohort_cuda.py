"""A cohort on the device (the fixed-input check of `parity study --cohorts`): three runs of one rollout format
decoded in one call through the CUDA decode path (graphs, compiled layers, bf16) give each run the log-probs its
own engine's path gives the same tokens. tests/test_cohort.py checks the same on CPU in float32 with the graphs
off, where the tokens agree exactly; in bf16 a stacked product sums in another order than a run's own, which may
tip a token drawn near a boundary of the inverse CDF, and every later token with it. So the cohort's own tokens are
replayed through each run's own engine (CudaDecoder.replay: the run's compiled layers, cache layout and attention
kernel, forced tokens) and the two log-probs of every token compared, against the format's own decode noise: the
run's decode's distance from a full forward of its own format on its own tokens, measured here on the same model."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from parity.config.schema import PrecisionConfig  # noqa: E402
from parity.core.sampling import SamplingSpec  # noqa: E402
from parity.rollout.cohort import CohortEngine  # noqa: E402
from tests.kv_packed_checks import teacher_forced_logprobs, write_small_qwen3  # noqa: E402
from tests.test_cohort import _engines  # noqa: E402

W4A4 = PrecisionConfig(weights="int4", activations="int4", kv_cache="int4_per_token_head")
BF16 = PrecisionConfig(weights="bf16", activations="bf16", kv_cache="bf16")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cohort_cuda_model")
    write_small_qwen3(d)
    return d


def _calls(n: int = 3) -> list[tuple]:
    """Run i: its own 4 prompts (other lengths than the other runs'), seed and prompt ids, 2 samples a prompt, all
    padded to the cohort's widest prompt (SamplingSpec.pad_prompts_to), as `parity study --cohorts` pads them."""
    g = torch.Generator().manual_seed(7)
    prompts = [[[int(x) for x in torch.randint(2, 512, (3 + 11 * j + 5 * i,), generator=g)] for j in range(4)]
               for i in range(n)]
    width = max(len(p) for ps in prompts for p in ps)
    return [(ps, SamplingSpec(temperature=1.0, top_p=1.0, max_new_tokens=48, n=2, topk_logprobs=3, seed=11 + i,
                              pad_prompts_to=width), [40 + 10 * i + j for j in range(4)])
            for i, ps in enumerate(prompts)]


@pytest.mark.parametrize("compile_layers", [False, True], ids=["graphs", "graphs+inductor"])
@pytest.mark.parametrize("precision", [BF16, W4A4], ids=["bf16", "w4a4-int4kv"])
def test_cohort_tokens_replayed_through_each_runs_own_path(model_dir, precision, compile_layers) -> None:
    engines = _engines(model_dir, precision, device="cuda", dtype=torch.bfloat16)
    cohort = CohortEngine(engines)
    for e in (cohort, *engines):
        e.cuda_decoder.compile = compile_layers
    calls = _calls()
    cohort.generate(calls)  # captures the graphs
    got = cohort.generate(calls)  # replays them
    assert got[0].meta["decode_path"].startswith("cuda_graph") and cohort.cuda_decoder.compile_error is None
    for i, (eng, (prompts, spec, ids), batch) in enumerate(zip(engines, calls, got, strict=True)):
        own = eng.cuda_decoder.replay(prompts, spec, batch.responses, ids)
        assert torch.equal(own.responses, batch.responses)
        assert own.meta.get("kv_cache_layout") == batch.meta.get("kv_cache_layout")
        m = batch.response_mask.to(eng.device)
        d = (batch.rollout_logprobs.to(eng.device) - own.rollout_logprobs.to(eng.device)).abs()[m]
        # the format's own decode noise: this run's own decode of its own tokens against a full forward of its format
        b = eng.generate(prompts, spec, ids)
        noise = (b.rollout_logprobs.to(eng.device) - teacher_forced_logprobs(eng, b, 1.0)).abs()[
            b.response_mask.to(eng.device)]
        print(f"run {i}, {precision.weights}/{precision.kv_cache}, compiled={compile_layers}: cohort vs own path on "
              f"the cohort's tokens mean {float(d.mean()):.3g} max {float(d.max()):.3g}; own decode vs its forward "
              f"mean {float(noise.mean()):.3g}")
        assert float(d.mean()) <= 2 * float(noise.mean()), (i, float(d.mean()), float(noise.mean()))
