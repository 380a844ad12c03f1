"""The packed KV cache's Triton kernels under Triton's CPU interpreter (TRITON_INTERPRET=1): the checks of
tests/kv_packed_checks.py that tests/test_kv_packed_cuda.py runs on the device, here on CPU tensors, so the
kernels' indexing, masking and numerics are proven without a GPU. Skipped where Triton is not installed (the
project's CPU environment); with it (`uv pip install triton==3.6.0` into the venv) these take about four minutes:

    TRITON_INTERPRET=1 .venv/bin/python -m pytest -q tests/test_kv_packed_interpret.py

The interpreter's casts and bf16 dots are patched to round like the GPU (tests/triton_interpret.py)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # Triton fixes interpretation when its kernels are defined
    pytest.skip("set TRITON_INTERPRET=1 before Python starts to run the kernels under Triton's interpreter",
                allow_module_level=True)

from parity.config.schema import PrecisionConfig
from tests.kv_packed_checks import FORMATS, SHAPES, attention_bound, check_attention, check_write_and_values  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def gpu_rounding():
    from tests.triton_interpret import patch_casts
    patch_casts()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("D", [32, 128])
@pytest.mark.parametrize("kind,hadamard", FORMATS)
def test_write_and_dequantize_bit_exact(kind, hadamard, D, dtype):
    check_write_and_values(kind, hadamard, D, dtype, CPU)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind,hadamard", [*FORMATS, (None, False)])
def test_attention_against_float64(kind, hadamard, dtype, monkeypatch):
    import parity.rollout.decode_attention as da
    for i, shape in enumerate(SHAPES[:2]):  # the interpreter is slow: two shapes (the CUDA test takes all)
        D = 128 if i % 2 == 0 else 64
        # 0 programs per SM: one split (the kernel writes the output itself); tiles of 64 and 32 slots (the candidates)
        for programs_per_sm, tile in ((2, 64), (0, 32)):
            monkeypatch.setattr(da, "_PROGRAMS_PER_SM", programs_per_sm)
            monkeypatch.setitem(da.ATTN_CONFIG, "BLOCK_N", tile)
            err = check_attention(kind, hadamard, D, dtype, CPU, shape, seed=i)
            assert err < attention_bound(dtype), (shape, programs_per_sm, err)


@pytest.mark.parametrize("kind", ["int8", "fp8", "fp8_per_token_head", None], ids=["int8", "fp8", "fp8_pth", "raw"])
def test_warp_split_attention_against_float64(kind, monkeypatch):
    """The dequantizing attention's warp-split form (parity.rollout.decode_attention_warps; ATTN_CONFIG's
    "warp_slots") on the kinds it serves, bf16: one split and many, 4, 2 and 1 warps, 32 and 16 slots a warp."""
    import parity.rollout.decode_attention as da
    for i, shape in enumerate(SHAPES[:3]):
        D = 128 if i % 2 == 0 else 64
        for programs_per_sm, warps, slots in ((2, 4, 32), (0, 2, 16), (10**6, 4, 16), (0, 1, 32)):
            monkeypatch.setattr(da, "_PROGRAMS_PER_SM", programs_per_sm)
            monkeypatch.setitem(da.ATTN_CONFIG, "warp_slots", slots)
            monkeypatch.setitem(da.ATTN_CONFIG, "num_warps", warps)
            err = check_attention(kind, False, D, torch.bfloat16, CPU, shape, seed=i)
            assert err < attention_bound(torch.bfloat16), (kind, shape, programs_per_sm, warps, slots, err)


def test_split_plan():
    from parity.rollout.decode_attention import split_plan
    assert split_plan(64, 8, 384, CPU) == (1, 6)  # 512 programs already fill 132 SMs twice over
    assert split_plan(1, 8, 384, CPU) == (6, 1)
    assert split_plan(2, 2, 1000, CPU) == (16, 1)
    assert split_plan(32, 8, 1000, CPU) == (2, 8)  # 256 programs: two splits of 8 tiles


@pytest.mark.parametrize("kind,fused,residual", [("int4_per_token_head", True, True),
                                                 ("int4_per_token_head", False, True),
                                                 ("fp8_per_token_head", True, True),
                                                 ("int4_per_token_head", True, False)],
                         ids=["int4-fused", "int4", "fp8-fused", "int4-fused-residual-apart"])
def test_decode_path_interpreted_equals_simulated(kind, fused, residual, tmp_path, monkeypatch):
    """The whole decode path with the packed cache and the kernels (interpreted) against the simulated cache,
    float32: the same greedy tokens, log-probs to float32 rounding of the attention sum. Fused: the step's norms,
    rotary, cache write and query preparation in one kernel (parity.rollout.pre_attention); else the torch
    functions, the write kernel and the attention's own query launch."""
    import parity.rollout.cuda_decode as cd
    from parity.config.schema import TinyModelConfig
    from parity.core.sampling import SamplingSpec
    from parity.models.tiny import build_tiny_model
    from parity.rollout.torch_engine import TorchEngine
    build_tiny_model("qwen3", TinyModelConfig(), seed=3).save_pretrained(str(tmp_path))
    eng = TorchEngine(tmp_path, precision=PrecisionConfig(weights="bf16", activations="bf16", kv_cache=kind),
                      dtype=torch.float32)
    prompts = [[5, 9, 12, 3, 7], [4, 4], [11, 2, 8, 30, 1, 6, 6, 2]]
    spec = SamplingSpec(temperature=0.0, max_new_tokens=6, n=2, seed=1)
    import parity.rollout.decode_attention as da
    monkeypatch.setattr(cd, "_FUSED_PRE", fused)
    monkeypatch.setattr(cd, "_FUSED_RESIDUAL", residual)  # False: o_proj + MLP and the next q/k/v product apart
    monkeypatch.setattr(da, "INT4_ROTATED", fused)  # the new paths together, the measured ones together
    monkeypatch.setattr(cd, "_PACKED_KV", False)
    sim = eng.cuda_decoder.generate(prompts, spec, use_graphs=False)
    monkeypatch.setattr(cd, "_PACKED_KV", True)
    eng.kv_packed = True
    packed = eng.cuda_decoder.generate(prompts, spec, use_graphs=False)
    assert packed.meta["kv_cache_layout"] == "packed" and sim.meta["kv_cache_layout"] == "simulated"
    assert eng.cuda_decoder.state.extras["packed"].backend == "triton"
    # the simulated cache's step takes the fused route's norms and rotary too (rollout/fused_step.py)
    assert sim.meta.get("fused_pre_attention", False) == fused
    assert torch.equal(packed.responses, sim.responses)
    # packed vs simulated int4 KV: the same codes, the attention's float32 sums over the cache in another order
    # (Triton's blocks): ~S u of the scores' terms, S <= 64 slots
    torch.testing.assert_close(packed.rollout_logprobs, sim.rollout_logprobs, atol=1e-4, rtol=0)


def test_the_fused_route_of_a_simulated_cache_rounds_as_the_eager_step(tmp_path, monkeypatch):
    """bf16, the step's layer functions uncompiled: the fused route's kernel norms and rotates q and k as the eager
    functions round them (eager_rounding). The torch route's sampled tokens, replayed through the fused route with
    a simulated INT4 cache, get their log-probs back to within a tenth of the distance the kernel's other rounding
    (the rotary rounded once) leaves. Not bit for bit: the kernel's float32 sum of squares and the torch mean add in
    different orders (and torch's order depends on the CPU's vector width), so a norm may land an ulp apart."""
    import parity.rollout.cuda_decode as cd
    from parity.config.schema import TinyModelConfig
    from parity.core.sampling import SamplingSpec
    from parity.models.tiny import build_tiny_model
    from parity.rollout import pre_attention
    from parity.rollout.torch_engine import TorchEngine
    build_tiny_model("qwen3", TinyModelConfig(), seed=4).save_pretrained(str(tmp_path))
    eng = TorchEngine(tmp_path, precision=PrecisionConfig(weights="bf16", activations="bf16",
                                                          kv_cache="int4_per_token_head"), dtype=torch.bfloat16)
    prompts = [[5, 9, 12, 3, 7], [4, 4], [11, 2, 8, 30, 1, 6, 6, 2]]
    spec = SamplingSpec(temperature=1.0, max_new_tokens=8, n=2, seed=2)
    monkeypatch.setattr(cd, "_PACKED_KV", False)
    monkeypatch.setattr(cd, "_FUSED_PRE", False)
    ref = eng.cuda_decoder.generate(prompts, spec, use_graphs=False)
    assert not ref.meta.get("fused_pre_attention", False)
    monkeypatch.setattr(cd, "_FUSED_PRE", True)
    m = ref.response_mask.bool()
    gaps = {}
    norm_rope = pre_attention.fused_norm_rope
    for eager in (True, False):
        monkeypatch.setattr(pre_attention, "fused_norm_rope",
                            lambda *a, eager_rounding, _e=eager, **k: norm_rope(*a, eager_rounding=_e, **k))
        rep = eng.cuda_decoder.replay(prompts, spec, ref.responses, use_graphs=False)
        assert rep.meta.get("fused_pre_attention") and torch.equal(rep.responses, ref.responses)
        gaps[eager] = float((rep.rollout_logprobs - ref.rollout_logprobs).abs()[m].mean())
    assert gaps[False] > 0 and gaps[True] <= 0.1 * gaps[False], gaps


def test_a_cohort_decodes_without_the_fused_pre_attention(tmp_path, monkeypatch):
    """With the fused pre-attention switched on, a cohort's decoder keeps to the functions' route (the kernel reads
    one run's q/k norms, a cohort's rows carry several runs'): the same tokens and log-probs as with it off,
    recorded as `fused_pre_attention: False` in each run's batch, while a run's own decoder takes the kernel."""
    import parity.rollout.cuda_decode as cd
    from parity.config.schema import TinyModelConfig
    from parity.core.sampling import SamplingSpec
    from parity.models.tiny import build_tiny_model
    from parity.rollout.cohort import CohortEngine
    from tests.test_cohort import _engines
    build_tiny_model("qwen3", TinyModelConfig(), seed=3).save_pretrained(str(tmp_path))
    engines = _engines(tmp_path, PrecisionConfig(weights="bf16", activations="bf16", kv_cache="int4_per_token_head"),
                       n=2)
    for e in engines:
        e.kv_packed = True
    monkeypatch.setattr(cd, "_PACKED_KV", True)
    calls = [([[5, 9, 12, 3, 7][: 3 + i], [4, 4, 8]], SamplingSpec(temperature=1.0, max_new_tokens=6, n=2, seed=11 + i,
                                                                pad_prompts_to=5), [40 + 10 * i, 41 + 10 * i])
             for i in range(2)]
    got = {}
    for fused in (False, True):
        monkeypatch.setattr(cd, "_FUSED_PRE", fused)
        got[fused] = CohortEngine(engines).generate(calls, fast=True, use_graphs=False)
    for off, on in zip(got[False], got[True], strict=True):
        assert on.meta["kv_cache_layout"] == "packed" and on.meta["kv_kernel"]["fused_pre_attention"] is False
        assert torch.equal(off.responses, on.responses) and torch.equal(off.rollout_logprobs, on.rollout_logprobs)
    own = engines[0].cuda_decoder.generate(*calls[0], use_graphs=False)
    assert own.meta["kv_kernel"]["fused_pre_attention"] is True
