"""The packed KV cache on CPU (its torch backend: the codec's own pack and unpack), in the decode path, and the KV
budget that chunks a call. The Triton kernels are tested by test_kv_packed_cuda.py on the device and by
test_kv_packed_interpret.py under Triton's interpreter.

The packed cache with the torch backend holds the codec's codes and returns the codec's values, and attends with
the simulated path's arithmetic: the decode path must give the simulated cache's tokens and log-probs exactly."""

from __future__ import annotations

import pytest
import torch

from parity.config.schema import PrecisionConfig, TinyModelConfig
from parity.core.sampling import SamplingSpec
from parity.models.tiny import build_tiny_model
from parity.precision.kv import make_kv_codec
from parity.precision.kv_packed import PackedKVCache, cache_bytes_per_row
from parity.rollout.torch_engine import TorchEngine
from tests.kv_packed_checks import FORMATS, check_write_and_values

CPU = torch.device("cpu")
PROMPTS = [[5, 9, 12, 3, 7], [4, 4], [11, 2, 8, 30, 1, 6, 6, 2], [7, 1, 7]]


@pytest.mark.parametrize("kind,hadamard", FORMATS)
def test_torch_backend_stores_the_codecs_codes_and_values(kind, hadamard):
    check_write_and_values(kind, hadamard, 32, torch.float32, CPU)


@pytest.mark.parametrize("kind,per_head", [("int4_per_token_head", 68), ("int8", 132), ("fp8_per_token_head", 132),
                                           ("fp8", 128)])
def test_cache_bytes(kind, per_head):
    """Codes and scales as the codec counts them (int4 at head_dim 128: 64 bytes of codes + a 4-byte word)."""
    codec = make_kv_codec(kind, 128)
    cache = PackedKVCache(codec, 3, 2, 4, 10, torch.bfloat16, CPU)
    assert cache.nbytes() == 2 * 3 * 2 * 4 * 10 * per_head
    assert cache_bytes_per_row(codec, 3, 4, 10) == 2 * 3 * 4 * 10 * per_head
    assert cache_bytes_per_row(codec, 3, 4, 10, packed=False) == 2 * 3 * 4 * 10 * 256  # bf16 values


def test_packed_cache_rejects_unpacked_kinds():
    with pytest.raises(ValueError, match="kind 'bf16' is not packed"):
        PackedKVCache(make_kv_codec("bf16", 32), 1, 1, 1, 4, torch.float32, CPU)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("kv_packed_model")
    build_tiny_model("qwen3", TinyModelConfig(), seed=3).save_pretrained(str(d))
    return d


def _engine(model_dir, kind: str, packed: bool) -> TorchEngine:
    eng = TorchEngine(model_dir, precision=PrecisionConfig(weights="bf16", activations="bf16", kv_cache=kind),
                      dtype=torch.float32)
    eng.kv_packed = packed
    return eng


GREEDY = SamplingSpec(temperature=0.0, max_new_tokens=20, n=2, seed=1)
SAMPLED = SamplingSpec(temperature=1.0, top_p=1.0, max_new_tokens=20, n=2, seed=5, topk_logprobs=4)


@pytest.mark.parametrize("kind,spec", [("int4_per_token_head", GREEDY), ("int4_per_token_head", SAMPLED),
                                       ("int8", SAMPLED), ("fp8", GREEDY)], ids=["int4-greedy", "int4-sampled",
                                                                                 "int8-sampled", "fp8-greedy"])
def test_decode_path_packed_equals_simulated(model_dir, kind, spec):
    sim = _engine(model_dir, kind, False).cuda_decoder.generate(PROMPTS, spec, use_graphs=False)
    eng = _engine(model_dir, kind, True)
    packed = eng.cuda_decoder.generate(PROMPTS, spec, use_graphs=False)
    assert sim.meta["kv_cache_layout"] == "simulated" and packed.meta["kv_cache_layout"] == "packed"
    assert eng.cuda_decoder.state.extras["packed"].backend == "torch"
    # the run's record names the attention kernel (the torch backend here: no Triton launch to configure)
    assert packed.meta["kv_kernel"] == {"name": "packed_dequant", "fused_pre_attention": False}
    assert torch.equal(packed.responses, sim.responses)
    assert torch.equal(packed.rollout_logprobs, sim.rollout_logprobs)
    if spec.topk_logprobs:
        assert torch.equal(packed.topk_ids, sim.topk_ids)


def test_kv_budget_chunks_a_call_into_rows_that_fit(model_dir):
    """A budget of 5 rows' float32 cache (128 bytes a token-head at head_dim 32) holds 5 rows unpacked: the call of
    4 prompts x 2 samples runs as 2 chunks of 2 prompts; packed int4 (20 bytes a token-head) it holds 32 rows, one
    call. Either way the rows are the unbudgeted call's."""
    from parity.rollout.kv_budget import row_bytes, rows_that_fit
    spec = SamplingSpec(temperature=1.0, max_new_tokens=12, n=2, seed=3)
    whole = _engine(model_dir, "int4_per_token_head", False).cuda_decoder.generate(PROMPTS, spec, use_graphs=False)
    S = 64  # prompt 8 + 12 new tokens, rounded up to the cache granularity
    for packed, chunks in ((False, 2), (True, None)):
        eng = _engine(model_dir, "int4_per_token_head", packed)
        eng.kv_budget_bytes = 5 * row_bytes(eng, S, torch.float32, packed_on=False)
        assert rows_that_fit(eng, S, torch.float32) == (32 if packed else 5)
        b = eng.cuda_decoder.generate(PROMPTS, spec, use_graphs=False)
        assert b.meta.get("kv_budget_chunks") == chunks
        assert torch.equal(b.responses, whole.responses) and torch.equal(b.group_ids, whole.group_ids)
        assert torch.equal(b.prompts, whole.prompts) and torch.equal(b.prompt_ids, whole.prompt_ids)
        # the same rows in calls of other row counts: float32 kernels may sum in another order (4 layers, K <= 512,
        # typically sqrt(45) u ~ 4e-7 of a log-prob's terms); the same int4 codes unless one sits on a tie
        torch.testing.assert_close(b.rollout_logprobs, whole.rollout_logprobs, atol=1e-5, rtol=0)
    eng.kv_budget_bytes = 100
    with pytest.raises(ValueError, match=r"engine.kv_budget_bytes=100: one batch row's KV cache of 64 slots"):
        eng.cuda_decoder.generate(PROMPTS, spec, use_graphs=False)


def test_the_record_carries_the_autotuned_attention_variant(monkeypatch):
    """What the autotuner chose (its cache: key -> launch configuration) is what a run records as its kernel's
    variant, one entry a tuned key."""
    from types import SimpleNamespace

    from parity.rollout import decode_attention as da
    chosen = {(2, True, 64, 16, False, None): "BLOCK_N: 64, num_warps: 4, num_stages: 2"}
    monkeypatch.setattr(da, "_attn_tuned", SimpleNamespace(cache=chosen), raising=False)
    assert da.tuned_configs() == {"(2, True, 64, 16, False, None)": "BLOCK_N: 64, num_warps: 4, num_stages: 2"}
    monkeypatch.setattr(da, "_attn_tuned", SimpleNamespace(cache={}), raising=False)
    assert da.tuned_configs() == {}


def test_the_int4_kernels_tile_by_their_form():
    """A launch configuration's slots an iteration (the split plan's unit and the workspace's size): the pinned
    form's rows x column groups; the warp-split form's warps x slots, its query parts merged only up to 8 heads a KV
    head, and unmerged at most 32 slots a warp; the exact route never takes the warp-split form."""
    from parity.rollout import int4_attention as ia
    cfg = {**ia.BLOCKS_FORM, "warp_slots": 64, "merge": True}
    assert ia.warp_form(ia.BLOCKS_FORM, 2) == (0, False) and ia.iteration_slots(ia.BLOCKS_FORM, 2) == 16 * 8
    assert ia.warp_form(cfg, 2) == (64, True) and ia.iteration_slots(cfg, 2) == 4 * 64
    # the pinned configuration: one warp of 64 slots, merged; the exact route launches the blocks form's smaller tile
    assert ia.warp_form(ia.CONFIG, 2) == (64, True) and ia.iteration_slots(ia.CONFIG, 2) == 64
    exact = ia.launch_config(True)
    assert ia.warp_form(exact, 2, exact=True) == (0, False) and exact["num_warps"] == 4
    assert ia.iteration_slots(exact, 2, exact=True) == ia.EXACT_ROWS * 8
    assert ia.warp_form(cfg, 8) == (64, True) and ia.warp_form(cfg, 16) == (32, False)
    assert ia.warp_form({**cfg, "merge": False}, 2) == (32, False)
    assert ia.warp_form(cfg, 2, exact=True) == (0, False) and ia.iteration_slots(cfg, 2, exact=True) == 128
    assert ia.split_plan(64, 8, 384, CPU, ia.iteration_slots(cfg, 2), 1) == (1, 512)


def test_the_dequantizing_kernel_launches_one_configuration_unless_timed(monkeypatch):
    """The Triton backend's record carries the pinned launch configuration; PARITY_KV_ATTENTION_TILE=timed hands
    the choice to the autotuner and the record carries its picks; any other value is an error naming the
    variable."""
    from types import SimpleNamespace

    from parity.rollout import decode_attention as da
    from parity.rollout import int4_attention as ia
    cache = SimpleNamespace(backend="triton", kind_id=da.KIND_INT4, head_dim=64, dtype=torch.bfloat16)
    monkeypatch.delenv("PARITY_KV_ATTENTION_TILE", raising=False)
    assert not da.timed_tiles()
    # the int4 cache on the rotated route (the default) records the rotated kernel's pinned configuration
    monkeypatch.setattr(da, "INT4_ROTATED", True)
    assert da.kv_kernel_meta(cache, False) == {"kv_kernel": {
        "name": "int4_rotated", "fused_pre_attention": False, "config": dict(ia.CONFIG)}}
    monkeypatch.setattr(da, "INT4_ROTATED", False)  # PARITY_INT4_ATTENTION=dequant
    assert da.kv_kernel_meta(cache, False) == {"kv_kernel": {
        "name": "packed_dequant", "fused_pre_attention": False,
        "config": {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "warp_slots": 0}}}
    # a float32 cache: the same tile with 8 warps (4 spill there)
    fp32 = SimpleNamespace(**{**vars(cache), "dtype": torch.float32})
    assert da.kv_kernel_meta(fp32, False)["kv_kernel"]["config"] == {"BLOCK_N": 64, "num_warps": 8, "num_stages": 2,
                                                                "warp_slots": 0}
    monkeypatch.setenv("PARITY_KV_ATTENTION_TILE", "timed")
    chosen = {(2, True, 64, 16, False, None): "BLOCK_N: 32, num_warps: 8, num_stages: 2"}
    monkeypatch.setattr(da, "_attn_tuned", SimpleNamespace(cache=chosen), raising=False)
    assert da.kv_kernel_meta(cache, False)["kv_kernel"]["tuned"] == {
        "(2, True, 64, 16, False, None)": "BLOCK_N: 32, num_warps: 8, num_stages: 2"}
    monkeypatch.setenv("PARITY_KV_ATTENTION_TILE", "fastest")
    with pytest.raises(ValueError, match="PARITY_KV_ATTENTION_TILE='fastest'"):
        da.kv_kernel_meta(cache, False)


def test_the_plain_cache_route_by_its_switch(monkeypatch):
    """PARITY_PLAIN_ATTENTION: a plain cache's attention is the batched matmuls by default and off CUDA; 'kernel' on
    CUDA is the raw-value kernel, which a call records with its launch (a float32 cache's with 8 warps); any other
    value is an error naming the variable."""
    from types import SimpleNamespace

    from parity.rollout import decode_attention as da
    from parity.rollout.decode_attention import plain_kernel
    from parity.rollout.decode_layers import _decode_attention, plain_decode_attention
    g = torch.Generator().manual_seed(0)
    B, H, n_kv, S, D, L = 3, 4, 2, 16, 8, 11
    q, ck, cv = torch.randn(B, H, D, generator=g), torch.randn(B, n_kv, S, D, generator=g), torch.randn(
        B, n_kv, S, D, generator=g)
    key_ok = torch.ones(B, S, dtype=torch.bool)
    key_ok[1, :3] = False
    slot = torch.tensor([L - 1])
    kmask = (torch.arange(L)[None, :] <= slot) & key_ok[:, :L]
    want = _decode_attention(q, ck[:, :, :L], cv[:, :, :L], kmask, 0.35)
    monkeypatch.delenv("PARITY_PLAIN_ATTENTION", raising=False)
    assert not plain_kernel() and da.kv_kernel_meta(None, False, SimpleNamespace(is_cuda=True)) == {}
    assert torch.equal(plain_decode_attention(q, ck, cv, key_ok, kmask, slot, L, 0.35), want)
    monkeypatch.setenv("PARITY_PLAIN_ATTENTION", "kernel")
    assert plain_kernel()
    assert torch.equal(plain_decode_attention(q, ck, cv, key_ok, kmask, slot, L, 0.35), want)  # CPU: the matmuls
    assert da.kv_kernel_meta(None, False, ck) == {}  # a CPU cache: no kernel ran
    for dtype, warps in ((torch.bfloat16, 4), (torch.float32, 8)):
        assert da.kv_kernel_meta(None, False, SimpleNamespace(is_cuda=True, dtype=dtype)) == {"kv_kernel": {
            "name": "plain_raw", "config": {"BLOCK_N": 64, "num_warps": warps, "num_stages": 2, "warp_slots": 0}}}
    monkeypatch.setenv("PARITY_PLAIN_ATTENTION", "flash")
    with pytest.raises(ValueError, match="PARITY_PLAIN_ATTENTION='flash'"):
        plain_kernel()


def test_a_runs_record_keeps_one_path_while_the_autotuner_adds_launches():
    """A run records the distinct rollout paths its batches took; the attention kernel's autotuned launches grow
    as new shapes are tuned (one more entry, not another path), while another kernel is another path."""
    from types import SimpleNamespace

    from parity.training.run_folder import RolloutPaths

    def batch(kernel: dict) -> SimpleNamespace:
        return SimpleNamespace(meta={"engine": "torch", "kv_cache_layout": "packed", "kv_kernel": kernel})

    paths = RolloutPaths()
    paths.see(batch({"name": "packed_dequant", "tuned": {"a": "BLOCK_N: 64"}}))
    paths.see(batch({"name": "packed_dequant", "tuned": {"a": "BLOCK_N: 64", "b": "BLOCK_N: 32"}}))
    assert paths.seen == [{"engine": "torch", "kv_cache_layout": "packed", "decode_path": "plain_loop",
                           "kv_kernel": {"name": "packed_dequant", "tuned": {"a": "BLOCK_N: 64", "b": "BLOCK_N: 32"}}}]
    paths.see(batch({"name": "int4_rotated", "config": {"rows": 16}}))
    assert [p["kv_kernel"]["name"] for p in paths.seen] == ["packed_dequant", "int4_rotated"]


def test_the_int4_routes_are_read_from_the_environment(monkeypatch):
    """PARITY_INT4_ATTENTION: the rotated kernel by default, the dequantizing one when asked;
    PARITY_FUSED_PRE_ATTENTION: on by default, off when asked; a bad value named."""
    from parity.rollout import decode_attention as da
    monkeypatch.delenv("PARITY_INT4_ATTENTION", raising=False)
    monkeypatch.delenv("PARITY_FUSED_PRE_ATTENTION", raising=False)
    assert da.int4_rotated_route() is True and da.fused_pre_attention_route() is True
    monkeypatch.setenv("PARITY_INT4_ATTENTION", "dequant")
    monkeypatch.setenv("PARITY_FUSED_PRE_ATTENTION", "off")
    assert da.int4_rotated_route() is False and da.fused_pre_attention_route() is False
    monkeypatch.setenv("PARITY_INT4_ATTENTION", "fast")
    with pytest.raises(ValueError, match="PARITY_INT4_ATTENTION='fast'"):
        da.int4_rotated_route()
    monkeypatch.setenv("PARITY_FUSED_PRE_ATTENTION", "yes")
    with pytest.raises(ValueError, match="PARITY_FUSED_PRE_ATTENTION='yes'"):
        da.fused_pre_attention_route()
