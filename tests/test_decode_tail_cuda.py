"""rollout.compact_tail on the device: a call's unfinished rows go on in smaller states with their own captured
graphs and the compiled layers' specialisations for their row count. Forced tokens (CudaDecoder.replay) end row r
at step 4 + 6r, so the tail states are reached the same way every time; their log-probs against the whole batch's
(the same route without the tail) are held to the format's own decode noise (the decode's distance from a full
forward of its format on the same model), since a bf16 product over fewer rows may round otherwise. A single engine
(bf16, W4A4 + packed INT4 KV) and a cohort of three runs. tests/test_decode_tail.py checks the same on CPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from parity.core.sampling import SamplingSpec  # noqa: E402
from parity.rollout import cuda_decode  # noqa: E402
from parity.rollout.cohort import CohortEngine  # noqa: E402
from tests.kv_packed_checks import teacher_forced_logprobs, write_small_qwen3  # noqa: E402
from tests.test_cohort import _engines  # noqa: E402
from tests.test_cohort_cuda import BF16, W4A4, _calls  # noqa: E402

R, N = 96, 4  # tokens a row, samples a prompt: 16 rows a run


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tail_cuda_model")
    write_small_qwen3(d)
    return d


def _forced(rows: int, eos: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(2, 512, (rows, R), generator=g)
    toks[toks == eos] = 3 if eos != 3 else 4
    for r in range(rows):
        toks[r, min(R - 1, 4 + 6 * r)] = eos
    return toks


def _noise(eng, prompts, spec, ids) -> float:
    b = eng.generate(prompts, spec, ids)
    d = (b.rollout_logprobs.to(eng.device) - teacher_forced_logprobs(eng, b, 1.0)).abs()
    return float(d[b.response_mask.to(eng.device)].mean())


@pytest.mark.parametrize("compile_layers", [False, True], ids=["graphs", "graphs+inductor"])
@pytest.mark.parametrize("precision", [BF16, W4A4], ids=["bf16", "w4a4-int4kv"])
def test_tail_states_on_the_device_replay_the_whole_batchs_logprobs(model_dir, precision, compile_layers,
                                                                    monkeypatch) -> None:
    monkeypatch.setattr(cuda_decode, "_TAIL_MIN_ROWS", 2)
    monkeypatch.setattr(cuda_decode, "_TAIL_SHARE", 16)
    monkeypatch.setattr(cuda_decode, "_TAIL_LEVELS", 4)
    (eng,) = _engines(model_dir, precision, n=1, device="cuda", dtype=torch.bfloat16)
    eng.cuda_decoder.compile = compile_layers
    prompts, spec, ids = _calls(1)[0]
    spec = SamplingSpec(temperature=1.0, max_new_tokens=R, n=N, topk_logprobs=3, seed=11,
                        pad_prompts_to=spec.pad_prompts_to)
    forced = _forced(len(prompts) * N, eng.eos_id, 1)
    ref = eng.cuda_decoder.replay(prompts, spec, forced, ids)
    eng.compact_tail = True
    got = eng.cuda_decoder.replay(prompts, spec, forced, ids)  # captures the tail states' graphs
    again = eng.cuda_decoder.replay(prompts, spec, forced, ids)  # replays them
    assert eng.cuda_decoder.compile_error is None
    rows = got.meta["decode_tail_rows"]
    assert rows and rows == sorted(rows, reverse=True) and rows[0] <= 8 and again.meta["decode_tail_rows"] == rows
    noise = _noise(eng, prompts, spec, ids)
    for b in (got, again):
        assert torch.equal(b.response_mask, ref.response_mask) and torch.equal(b.truncated, ref.truncated)
        m = ref.response_mask
        d = (b.rollout_logprobs - ref.rollout_logprobs).abs()[m]
        print(f"{precision.weights}/{precision.kv_cache}, compiled={compile_layers}, tail {rows}: against the whole "
              f"batch mean {float(d.mean()):.3g} max {float(d.max()):.3g}; decode noise {noise:.3g}")
        assert float(d.mean()) <= noise, (float(d.mean()), noise)


def test_a_cohorts_tail_states_on_the_device(model_dir, monkeypatch) -> None:
    monkeypatch.setattr(cuda_decode, "_TAIL_MIN_ROWS", 2)
    monkeypatch.setattr(cuda_decode, "_TAIL_SHARE", 16)
    monkeypatch.setattr(cuda_decode, "_TAIL_LEVELS", 4)
    engines = _engines(model_dir, W4A4, device="cuda", dtype=torch.bfloat16)
    calls = [(p, SamplingSpec(temperature=1.0, max_new_tokens=R, n=N, topk_logprobs=3, seed=s.seed,
                              pad_prompts_to=s.pad_prompts_to), i) for p, s, i in _calls()]
    cohort = CohortEngine(engines)
    forced = [_forced(len(c[0]) * N, engines[0].eos_id, 2 + k) for k, c in enumerate(calls)]
    # the cohort's replay: each run's forced tokens through the cohort's decoder (rows grouped by run)
    from parity.core.layout import layout_batch, left_pad
    lays = [layout_batch(c[0], c[1], c[2], cohort.pad_id, cohort.model.config.max_position_embeddings) for c in calls]
    width = max(lay.width for lay in lays)
    rows = [lay.prompts[r, lay.prompt_mask[r]].tolist() for lay in lays for r in range(lay.size)]
    prompts, pmask = left_pad(rows, cohort.pad_id, width=width)
    uniforms = torch.cat([lay.uniforms() for lay in lays]).cuda()
    force = torch.cat([lay.forced(f, cohort.pad_id) for lay, f in zip(lays, forced, strict=True)])
    dec = cohort.cuda_decoder
    ref = dec.run(prompts, pmask, uniforms, calls[0][1], True, forced=force)
    ref_lp, ref_mask = ref.logps.clone(), ref.rmask.clone()
    cohort.compact_tail = True
    got = dec.run(prompts, pmask, uniforms, calls[0][1], True, forced=force)
    tail = got.extras.get("tail_rows")
    assert tail and all(t % 3 == 0 for t in tail), tail
    assert torch.equal(got.rmask, ref_mask)
    noise = _noise(engines[0], *calls[0])
    d = (got.logps - ref_lp).abs()[ref_mask]
    print(f"cohort of 3, tail {tail}: against the whole batch mean {float(d.mean()):.3g} max {float(d.max()):.3g}; "
          f"run 0's decode noise {noise:.3g}")
    assert float(d.mean()) <= noise
