"""The packed KV cache and the decode-attention kernel on the device (skipped without CUDA and Triton):

- the packed cache holds the codec's codes and scales and dequantizes to the simulated cache's values, bit for
  bit (every format, bf16 and fp32, head_dim 128 / 64 / 32: the three ways the int4 loader transforms);
- the kernel on random lengths, head counts, left padding and split counts against a float64 attention, under its
  pinned launch configuration and, on two shapes, every candidate of the autotuner's;
- the rotated int4 attention (parity.rollout.int4_attention) against a float64 attention over the codec's values
  computed from the codes, on random lengths, rows, KV heads and group sizes, every launch configuration the
  variant bench times, poisoned outputs; the fused pre-attention kernel against the step's torch functions;
- the decode path's log-probs with the packed cache, scored on its own tokens against the codec's full-sequence
  arithmetic, as close as the simulated cache's decode (CUDA graphs; once with the layers compiled by Inductor).

    python -m pytest -q tests/test_kv_packed_cuda.py        (needs torch, transformers, triton, pytest only)
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from parity.config.schema import PrecisionConfig  # noqa: E402
from parity.rollout import int4_attention as ia  # noqa: E402
from tests.kv_packed_checks import (  # noqa: E402
    FORMATS,
    SHAPES,
    attention_bound,
    check_attention,
    check_int4_attention,
    check_pre_attention,
    check_write_and_values,
    teacher_forced_logprobs,
    write_small_qwen3,
)

CUDA = torch.device("cuda")
DTYPES = [torch.bfloat16, torch.float32]


# head_dim 128 for every format; 64 and 32 for rotated int4 (its loader's fp16-dot and broadcast-sum transforms)
WRITE_CASES = [(k, h, 128) for k, h in FORMATS] + [("int4_per_token_head", True, 64), ("int4_per_token_head", True, 32)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind,hadamard,D", WRITE_CASES)
def test_packed_cache_equals_simulated_cache_values(kind, hadamard, D, dtype):
    for seed in range(3):
        check_write_and_values(kind, hadamard, D, dtype, CUDA, seed=seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind,hadamard", [*FORMATS, (None, False)])
def test_kernel_against_float64_on_random_lengths_and_heads(kind, hadamard, dtype, monkeypatch):
    import parity.rollout.decode_attention as da
    g = torch.Generator().manual_seed(7)
    shapes = list(SHAPES)
    for _ in range(4):  # and random ones: rows, KV heads, group size, slots, attended length, the step's slot
        S = int(torch.randint(16, 400, (1,), generator=g))
        L = int(torch.randint(1, S + 1, (1,), generator=g))
        shapes.append((int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 5, (1,), generator=g)),
                       int(torch.randint(1, 9, (1,), generator=g)), S, L, int(torch.randint(0, L, (1,), generator=g))))
    # the pinned launch configuration (decode_attention.ATTN_CONFIG) on every shape; on the first two, each of the
    # autotuner's candidates too (PARITY_KV_ATTENTION_TILE=timed may launch any of them)
    pinned = (dict(da.ATTN_CONFIG), da.ATTN_WARPS_FP32)
    candidates = [(dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages, warp_slots=0), c.num_warps)
                  for c in da._attn_tuned.configs]
    for i, shape in enumerate(shapes):
        for cfg, fp32_warps in [pinned, *(c for c in candidates if c != pinned)] if i < 2 else [pinned]:
            monkeypatch.setattr(da, "ATTN_CONFIG", cfg)
            monkeypatch.setattr(da, "ATTN_WARPS_FP32", fp32_warps)
            for D in (128, 64) if kind == "int4_per_token_head" and hadamard and dtype == torch.bfloat16 else (128,):
                for programs_per_sm in (2, 0):  # 0: one split, the kernel writes the output itself
                    monkeypatch.setattr(da, "_PROGRAMS_PER_SM", programs_per_sm)
                    err = check_attention(kind, hadamard, D, dtype, CUDA, shape, seed=i)
                    assert err < attention_bound(dtype), (shape, cfg, D, programs_per_sm, err)


@pytest.mark.parametrize("kind", ["int8", "fp8", "fp8_per_token_head", None], ids=["int8", "fp8", "fp8_pth", "raw"])
def test_warp_split_kernel_against_float64(kind, monkeypatch):
    """The dequantizing kernel's warp-split form (decode_attention_warps; the bench's configurations), bf16, on the
    shapes above and the decode shape, one split and several."""
    import parity.rollout.decode_attention as da
    for i, shape in enumerate([*SHAPES, (64, 8, 2, 384, 256, 255)]):
        for warps, slots in ((4, 16), (4, 32), (2, 32), (1, 32)):
            monkeypatch.setitem(da.ATTN_CONFIG, "num_warps", warps)
            monkeypatch.setitem(da.ATTN_CONFIG, "warp_slots", slots)
            for programs_per_sm in (2, 0):
                monkeypatch.setattr(da, "_PROGRAMS_PER_SM", programs_per_sm)
                err = check_attention(kind, False, 128, torch.bfloat16, CUDA, shape, seed=i)
                assert err < attention_bound(torch.bfloat16), (kind, shape, warps, slots, programs_per_sm, err)


# launch configurations of the rotated int4 kernel (tests/bench/gpu_int4_decode_variants.py times these)
# the pinned configuration (int4_attention.CONFIG), then changes to the blocks form pinned before it (BLOCKS_FORM)
INT4_CONFIGS = [{}, *({**ia.BLOCKS_FORM, **d} for d in (
    {}, {"ROWS": 8}, {"num_warps": 8}, {"ROWS": 32, "num_warps": 8}, {"num_stages": 3},
    {"asm": False}, {"maxnreg": 168}, {"programs_per_sm": 0}, {"programs_per_sm": 10**6},
    {"ROWS": 8, "merge": True, "maxnreg": 128}, {"warp_slots": 32}, {"warp_slots": 32, "merge": True},
    {"warp_slots": 64, "merge": True}, {"warp_slots": 32, "merge": True, "num_warps": 2},
    {"warp_slots": 32, "merge": True, "programs_per_sm": 10**6},
    {"warp_slots": 32, "merge": True, "maxnreg": 168}, {"warp_slots": 64, "merge": True, "num_warps": 2},
    {"warp_slots": 32, "merge": True, "num_warps": 1}, {"warp_slots": 64, "merge": True, "num_warps": 1},
    {"warp_slots": 32, "merge": True, "num_warps": 1, "programs_per_sm": 4},
    {"warp_slots": 64, "merge": True, "num_warps": 1, "programs_per_sm": 4},
    {"warp_slots": 64, "merge": True, "num_warps": 1, "num_stages": 3})),
    # the slot-groups form's alternatives to the pinned one (tests/bench/gpu_int4_attention_ncu.py --ab times them)
    *({**ia.CONFIG, **d} for d in ({"group_v": False, "l2_slots": 0}, {"quad_unpack": not ia.CONFIG["quad_unpack"]},
                                   {"pdl": not ia.CONFIG["pdl"]}))]


@pytest.mark.parametrize("cfg", INT4_CONFIGS, ids=[str(c) for c in INT4_CONFIGS])
def test_int4_rotated_attention_configurations(cfg):
    """Every launch configuration at the decode shape (batch 64, 8 KV heads, 2 query heads a KV head), bf16."""
    for i, shape in enumerate([(64, 8, 2, 384, 384, 383), (64, 8, 2, 384, 256, 200), (5, 3, 2, 300, 190, 150)]):
        err, sim = check_int4_attention(128, torch.bfloat16, CUDA, shape, True, seed=i, config=cfg)
        assert err < 4e-3, (shape, cfg, err, sim)


def test_the_v_operands_unpacked_four_at_a_time_change_nothing():
    """"quad_unpack" builds the V products' fp16 operands from the codes in one asm block instead of four: the same
    operands, so the same output bit for bit, at 1, 2, 3 and 4 query heads a KV head, one split and many."""
    from tests.kv_packed_checks import int4_attention_outputs
    for i, shape in enumerate([(64, 8, 2, 384, 256, 255), (2, 2, 1, 300, 300, 299), (2, 1, 3, 100, 90, 80),
                               (3, 1, 4, 96, 70, 51)]):
        for pps in (0, 10**6):
            outs = int4_attention_outputs(shape, 128, CUDA, [{**ia.CONFIG, "quad_unpack": quad, "programs_per_sm": pps}
                                                             for quad in (False, True)], seed=i)
            assert torch.equal(outs[0], outs[1]), (shape, pps)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("hadamard", [True, False], ids=["rotated", "plain"])
def test_int4_rotated_attention_against_float64(dtype, hadamard):
    """Random rows, KV heads, group sizes, lengths, left padding and step slots; one split and many."""
    g = torch.Generator().manual_seed(5 if hadamard else 6)
    shapes = [(2, 2, 2, 150, 150, 149), (3, 1, 4, 96, 70, 51)]
    for _ in range(4):
        S = int(torch.randint(16, 600, (1,), generator=g))
        L = int(torch.randint(1, S + 1, (1,), generator=g))
        shapes.append((int(torch.randint(1, 17, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g)),
                       [1, 2, 4, 8][int(torch.randint(0, 4, (1,), generator=g))], S, L,
                       int(torch.randint(0, L, (1,), generator=g))))
    bound = 4e-3 if dtype == torch.bfloat16 else 1e-5
    for i, shape in enumerate(shapes):
        # the pinned CONFIG, then changes to the blocks form (without its ROWS: the exact route keeps its smaller tile)
        blocks = {k: v for k, v in ia.BLOCKS_FORM.items() if k != "ROWS"}
        for cfg in ({}, {"programs_per_sm": 10**6}, blocks, {**blocks, "programs_per_sm": 10**6},
                    {**blocks, "warp_slots": 32, "merge": True}, {**blocks, "warp_slots": 16, "programs_per_sm": 10**6}):
            for D in (128, 64) if i < 2 else (128,):
                err, sim = check_int4_attention(D, dtype, CUDA, shape, hadamard, seed=i, config=cfg)
                assert err < bound, (shape, D, cfg, err, sim)


@pytest.mark.parametrize("kind,hadamard,rotated", [("int4_per_token_head", True, True),
                                                   ("int4_per_token_head", False, True),
                                                   ("fp8_per_token_head", False, False), ("int8", False, False)])
@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp32"])
@pytest.mark.parametrize("eager", [False, True], ids=["rounded-once", "eager-rounding"])
def test_fused_pre_attention(kind, hadamard, rotated, dtype, eager):
    for D in (128, 64):
        r = check_pre_attention(kind, hadamard, D, dtype, CUDA, rotated, seed=D, eager=eager)
        # the GPU's rsqrt is not the CPU's: a k value on a rounding boundary may take the neighbouring code
        assert r["k_codes_differing"] <= 0.02, r
        assert r["k_value_max_rel"] < 0.1, r
        assert r["q_rotated_rel" if rotated else "q_rel"] < (1e-5 if dtype == torch.float32 else 1e-2), r


@pytest.mark.parametrize("kind,hadamard", FORMATS)
def test_self_check_passes(kind, hadamard):
    from parity.rollout import decode_attention as da
    ok = da.usable(0, kind, hadamard, 128, torch.bfloat16)
    assert ok, da.unusable_reason


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A small random Qwen3 with the 0.6B model's head_dim (128) and grouped-query attention (4 heads, 2 KV)."""
    d = tmp_path_factory.mktemp("kv_packed_cuda_model")
    write_small_qwen3(d)
    return d


PROMPTS = [[int(x) for x in torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(n))]
           for n in (5, 17, 70, 1, 33, 64)]


def _gap(eng, b, temperature: float) -> torch.Tensor:
    """|rollout log-prob - teacher-forced log-prob| at the real response positions of `b`."""
    ref = teacher_forced_logprobs(eng, b, temperature)
    m = b.response_mask.to(eng.device)
    return (b.rollout_logprobs.to(eng.device) - ref).abs()[m]


def _run_with_engine(model_dir, kind: str, dtype: torch.dtype, packed: bool, spec, compile_layers: bool = False):
    import parity.rollout.cuda_decode as cd
    from parity.rollout.torch_engine import TorchEngine
    eng = TorchEngine(model_dir, precision=PrecisionConfig(weights="bf16", activations="bf16", kv_cache=kind),
                      device="cuda", dtype=dtype)
    eng.cuda_decoder.compile = compile_layers
    keep, cd._PACKED_KV = cd._PACKED_KV, packed
    try:
        eng.generate(PROMPTS, spec)  # captures the graphs
        b = eng.generate(PROMPTS, spec)  # replays them
    finally:
        cd._PACKED_KV = keep
    assert b.meta["decode_path"].startswith("cuda_graph")
    assert eng.cuda_decoder.compile_error is None, eng.cuda_decoder.compile_error
    return eng, b


# How the decode paths are compared. Both sample their own tokens; a token drawn near a boundary of the inverse
# CDF (near-uniform rows of this random model) or a K/V entry that rounds to the neighbouring code changes every
# later token, so neither the tokens nor the log-probs of two runs can be compared position by position over 80
# steps (measured on an H200: the same simulated engine called twice already differs in one greedy bf16 row).
# Instead each path's log-probs of its own tokens are scored against the codec's full-sequence arithmetic
# (teacher_forced_logprobs), and the packed path must be as close to it as the simulated path is. The prefill
# (the first response token) reads the same values in both paths: equal there, bit for bit, unless Inductor
# compiled the packed path's layers. Scale, measured with this helper on the plain decode loop (2-core CPU, 40
# tokens): float32 mean gap 5e-6 - 1e-4, max 5e-4 - 2e-3 (a K/V code flipped by rounding); bf16 mean 0.011 - 0.020,
# max 0.05 - 0.11. A wrong attention moves these log-probs by tenths to units.

@pytest.mark.parametrize("kind", ["int4_per_token_head", "int8", "fp8", "fp8_per_token_head"])
def test_decode_logprobs_packed_vs_simulated_fp32(model_dir, kind):
    """float32: the packed decode's log-probs of its own greedy tokens against the full-sequence forward with the
    codec, as close as the simulated decode's own; the prefill's top log-probs equal."""
    from parity.core.sampling import SamplingSpec
    from parity.rollout.decode_attention import unusable_reason
    spec = SamplingSpec(temperature=0.0, max_new_tokens=80, n=2, seed=1, topk_logprobs=4)
    eng, sim = _run_with_engine(model_dir, kind, torch.float32, False, spec)
    _, packed = _run_with_engine(model_dir, kind, torch.float32, True, spec)
    assert sim.meta["kv_cache_layout"] == "simulated"
    assert packed.meta["kv_cache_layout"] == "packed", unusable_reason
    assert torch.equal(packed.topk_logprobs[:, 0], sim.topk_logprobs[:, 0])
    assert torch.equal(packed.responses[:, 0], sim.responses[:, 0])
    g_sim, g_packed = _gap(eng, sim, 1.0), _gap(eng, packed, 1.0)
    print(f"fp32 {kind}: gap packed mean {float(g_packed.mean()):.3g} max {float(g_packed.max()):.3g}, simulated "
          f"mean {float(g_sim.mean()):.3g} max {float(g_sim.max()):.3g}")
    assert float(g_packed.mean()) <= 2 * float(g_sim.mean()) + 1e-4, (float(g_packed.mean()), float(g_sim.mean()))
    assert float(g_packed.max()) <= 2 * float(g_sim.max()) + 5e-3, (float(g_packed.max()), float(g_sim.max()))


@pytest.mark.parametrize("compile_layers", [False, True], ids=["graphs", "graphs+inductor"])
@pytest.mark.parametrize("kind", ["int4_per_token_head", "fp8_per_token_head"])
def test_decode_logprobs_packed_vs_simulated_bf16(model_dir, kind, compile_layers):
    """bf16: the simulated path rounds scores and probabilities to bf16 between its two matmuls, the kernel keeps
    them in float32; scored on their own sampled tokens (top-p 1) against the full-sequence forward, the packed
    path is as close as the simulated one. Compiled: both paths' layers compiled by Inductor."""
    if compile_layers and kind != "int4_per_token_head":
        pytest.skip("one compiled run: the seed's format")
    from parity.core.sampling import SamplingSpec
    spec = SamplingSpec(temperature=1.0, top_p=1.0, max_new_tokens=80, n=2, seed=2, topk_logprobs=4)
    # the peer runs the same route: Inductor's fused kernels round differently from the eager ones (measured on an
    # H200, int4: the compiled packed path 0.074 mean gap to the eager reference against the eager simulated path's
    # 0.027), so the compiled packed path is held to the compiled simulated path
    eng, sim = _run_with_engine(model_dir, kind, torch.bfloat16, False, spec, compile_layers)
    _, packed = _run_with_engine(model_dir, kind, torch.bfloat16, True, spec, compile_layers)
    assert packed.meta["kv_cache_layout"] == "packed"
    assert packed.meta["decode_path"].endswith("+inductor_layers") == compile_layers
    if not compile_layers:
        assert torch.equal(packed.topk_logprobs[:, 0], sim.topk_logprobs[:, 0])
    g_sim, g_packed = _gap(eng, sim, 1.0), _gap(eng, packed, 1.0)
    print(f"bf16 {kind} compiled={compile_layers}: gap packed mean {float(g_packed.mean()):.3g} max "
          f"{float(g_packed.max()):.3g}, simulated mean {float(g_sim.mean()):.3g} max {float(g_sim.max()):.3g}")
    assert float(g_packed.mean()) <= 1.5 * float(g_sim.mean()) + 5e-3, (float(g_packed.mean()), float(g_sim.mean()))
    assert float(g_packed.max()) <= 2 * float(g_sim.max()) + 0.1, (float(g_packed.max()), float(g_sim.max()))


@pytest.mark.parametrize("compile_layers", [False, True], ids=["graphs", "graphs+inductor"])
def test_one_int4_format_packed_tokens_replayed_through_the_simulated_cache(model_dir, compile_layers):
    """One INT4 format: the packed path's own tokens replayed through the decode path with the simulated cache
    (CudaDecoder.replay, the same route: same compiled layers, same codes) give log-probs within twice the bf16
    decode's own gap from its full forward (the criterion; the bf16 gap measured here on the same model and route)."""
    import parity.rollout.cuda_decode as cd
    from parity.core.sampling import SamplingSpec
    spec = SamplingSpec(temperature=1.0, top_p=1.0, max_new_tokens=80, n=2, seed=3, topk_logprobs=4)
    eng_bf16, b_bf16 = _run_with_engine(model_dir, "bf16", torch.bfloat16, True, spec, compile_layers)
    g_bf16 = float(_gap(eng_bf16, b_bf16, 1.0).mean())
    eng, packed = _run_with_engine(model_dir, "int4_per_token_head", torch.bfloat16, True, spec, compile_layers)
    assert packed.meta["kv_cache_layout"] == "packed"
    keep, cd._PACKED_KV = cd._PACKED_KV, False
    try:
        sim = eng.cuda_decoder.replay(PROMPTS, spec, packed.responses)
    finally:
        cd._PACKED_KV = keep
    assert sim.meta["kv_cache_layout"] == "simulated" and torch.equal(sim.responses, packed.responses)
    m = packed.response_mask.to(eng.device)
    d = (packed.rollout_logprobs.to(eng.device) - sim.rollout_logprobs.to(eng.device)).abs()[m]
    print(f"one format, compiled={compile_layers}: packed vs simulated on the same tokens mean {float(d.mean()):.3g} "
          f"max {float(d.max()):.3g}; bf16 decode vs its forward mean {g_bf16:.3g}")
    assert float(d.mean()) <= 2 * g_bf16, (float(d.mean()), g_bf16)
