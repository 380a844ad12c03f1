"""The packed KV cache's rows of the GPU benchmark (bench_gpu.py section `kv`, and tests/bench/gpu_packed_kv.py):
the Qwen3-0.6B shape, 128-token prompts, 256 sampled tokens, the same prompts and seeds for every row.

Rows: BF16, INT8 W8A8, W8A8 + INT4 KV (packed), W8A8 + FP8 KV (fp8_per_token_head, packed), BF16 + INT4 KV (packed),
and, for reference, W8A8 + INT4 KV simulated (the bf16 cache holding the codec's roundtrip, the previous design).
For each: decode tokens/s at batch 64 and the ratio to BF16's in the same run; the KV bytes a step reads (K and
V of every layer over the attended slots: codes and scales for a packed cache) and the weight bytes; the roof
counting both (copy bandwidth measured in the same run) and the fraction of it reached; the cache's bytes
against BF16's; the mean |log-prob - BF16 forward's| of the sampled tokens. Then the KV budget: the BF16 cache's
bytes at batch 64, the largest batch whose cache fits in it, and tokens/s at that batch.

`attention_us`: the decode attention alone at batch 64 (28 layers' caches cycled so they come from memory), the
packed kernel per format (int4: the rotated-basis kernel with its query launch, and the previous kernel) against the
simulated path's two matmuls over a bf16 cache, and the GB/s each reaches.
"""

from __future__ import annotations

import gc
import math
from types import SimpleNamespace

import torch
from gpu_bench_common import (
    BATCH,
    P_TOKENS,
    R_TOKENS,
    RESULTS,
    SHAPE,
    dump,
    graph_us,
    prompts,
    section,
    timed,
)

from parity.config.schema import PrecisionConfig

# label, weights (= activations), KV cache kind, packed cache
ROWS = [("bf16", "bf16", "bf16", True), ("int8_w8a8", "int8", "bf16", True),
        ("int8_w8a8_int4kv", "int8", "int4_per_token_head", True),
        ("int8_w8a8_fp8kv", "int8", "fp8_per_token_head", True),
        ("bf16_int4kv", "bf16", "int4_per_token_head", True),
        ("int8_w8a8_int4kv_simulated", "int8", "int4_per_token_head", False)]
SLOTS = -(-(P_TOKENS + R_TOKENS) // 64) * 64


def kv_bytes_per_step(eng, batch: int, packed: bool) -> float:
    """Mean over a call's steps of the KV bytes a decode step reads: K and V, every layer, the attended slots."""
    from parity.precision.kv_packed import cache_bytes_per_row
    from parity.rollout.cuda_decode import attended_length
    codec = eng.kv_codec or SimpleNamespace(kind="bf16", head_dim=eng.head_dim)
    layers = SHAPE["num_hidden_layers"]
    mean_slots = sum(attended_length(P_TOKENS, t, SLOTS) for t in range(R_TOKENS)) / R_TOKENS
    if packed and codec.kind != "bf16":
        return batch * cache_bytes_per_row(codec, layers, eng.n_kv, 1) * mean_slots
    return batch * 2.0 * layers * eng.n_kv * eng.head_dim * 2 * mean_slots


def _cache_bytes(eng) -> int:
    st = eng.cuda_decoder.state
    if "packed" in st.extras:
        return st.extras["packed"].nbytes()
    return sum(t.numel() * t.element_size() for pair in st.caches for t in pair)


def _tok_s(eng, ps: list, spec, reps: int) -> tuple[float, object]:
    eng.generate(ps, spec)  # compiles, captures the graphs
    t, b = timed(lambda: eng.generate(ps, spec), reps)
    n = len(ps) * spec.max_new_tokens
    assert int(b.response_mask.sum()) == n, "EOS cut some rows short: token count would be wrong"
    return n / t, b


def _gap(b, other) -> dict:
    """|b's rollout log-prob - `other`'s log-prob| [B, R] over b's response tokens."""
    m = b.response_mask.to(other.device)
    d = (b.rollout_logprobs.to(m.device) - other).abs()[m].float()
    return {"mean_abs_dlogp": float(d.mean()), "max_abs_dlogp": float(d.max()),
            "p99_abs_dlogp": float(d.quantile(0.99)) if d.numel() <= 16_000_000 else None, "tokens": int(d.numel())}


def _dlogp(eng, b) -> dict:
    """|rollout log-prob - teacher-forced log-prob| of b's own tokens, the teacher the same engine's full forward with
    the simulated cache (tests/kv_packed_checks.teacher_forced_logprobs; no codec: the plain forward)."""
    import sys
    from pathlib import Path
    root = str(Path(__file__).resolve().parents[2])
    if root not in sys.path:
        sys.path.insert(0, root)
    from tests.kv_packed_checks import teacher_forced_logprobs
    return _gap(b, teacher_forced_logprobs(eng, b, 1.0))


@section("kv")
def kv_rows(d: str, reps: int, rows: list | None = None, budget_batches: bool = True,
            teacher_forced: bool = True) -> None:
    from bench_gpu import profile_decode_step, teacher_forced_gap, weight_bytes

    import parity.rollout.cuda_decode as cd
    from parity.core.sampling import SamplingSpec
    from parity.rollout import decode_attention as da
    from parity.rollout.kv_budget import rows_that_fit
    from parity.rollout.torch_engine import TorchEngine
    out: dict = {}
    RESULTS["kv"] = out
    spec = SamplingSpec(temperature=1.0, top_p=1.0, max_new_tokens=R_TOKENS, n=1, seed=0)
    bw = RESULTS.get("ceilings", {}).get("copy_TBps", 4.3) * 1e12
    bf16_row = 2.0 * SHAPE["num_hidden_layers"] * SHAPE["num_key_value_heads"] * SLOTS * SHAPE["head_dim"] * 2
    budget = BATCH * bf16_row
    out["kv_budget_bytes"] = budget
    out["slots"] = SLOTS
    ref = None
    for label, wa, kv, packed in rows or ROWS:
        row: dict = {}
        out[label] = row
        # no EOS (id -1 is never sampled): every row decodes all 256 tokens, at batch 240 as at 64
        eng = TorchEngine(d, precision=PrecisionConfig(weights=wa, activations=wa, kv_cache=kv), device="cuda",
                          dtype=torch.bfloat16, eos_token_id=-1)
        if packed and kv != "bf16":
            # the kernels' self-check (codes and values bit for bit, attention to rounding) reported, but the
            # packed cache used whatever it says, so that a rare last-bit difference still leaves timings
            row["self_check_passed"] = da.usable(0, kv, bool(getattr(eng.kv_codec, "hadamard", False)), eng.head_dim,
                                                 torch.bfloat16)
            row["self_check_reason"] = da.unusable_reason
            eng.kv_packed = True
        keep, cd._PACKED_KV = cd._PACKED_KV, packed
        try:
            tok_s, b = _tok_s(eng, prompts(BATCH), spec, reps)
            row.update(linear_path=eng.linear_path, kv_cache_layout=b.meta.get("kv_cache_layout"),
                       decode_path=b.meta.get("decode_path"), kv_kernel=b.meta.get("kv_kernel"),
                       compile_error=eng.cuda_decoder.compile_error, tok_s_b64=tok_s,
                       weight_bytes=weight_bytes(eng.model))
            if label == "int8_w8a8_int4kv":  # the timed step's graphs, before the replays below set up others
                row["decode_step_profile"] = profile_decode_step(eng)
            is_packed = row["kv_cache_layout"] == "packed"
            kvb = kv_bytes_per_step(eng, BATCH, is_packed)
            roof = bw * BATCH / (row["weight_bytes"] + kvb)
            row.update(kv_bytes_per_step_b64=kvb, roof_with_kv_tok_s_b64=roof, of_roof_with_kv_b64=tok_s / roof,
                       kv_cache_bytes_b64=_cache_bytes(eng))
            if ref is None:
                ref = eng  # the BF16 row: its model is the teacher-forced reference, its figures the peer
            base = out["bf16"]
            row["over_bf16_b64"] = tok_s / base["tok_s_b64"]
            row["kv_bytes_per_step_over_bf16"] = kvb / base["kv_bytes_per_step_b64"]
            row["kv_cache_bytes_over_bf16"] = row["kv_cache_bytes_b64"] / base["kv_cache_bytes_b64"]
            row["mean_abs_dlogp_vs_bf16_forward"], row["max_abs_dlogp_vs_bf16_forward"] = teacher_forced_gap(
                ref.model, b)
            # every row: a packed row's distance from its own forward, and the two plain-cache rows' (BF16, W8A8) the
            # decode noise of their weight formats, the yardsticks of the one-format measure below
            if teacher_forced:
                row["dlogp_vs_teacher_forced_same_arithmetic"] = _dlogp(eng, b)
                # the decode path against the plain loop replaying its tokens (TorchEngine.replay: the reference
                # decode of its format, step by step), the "one INT4 format" measure
                row["dlogp_vs_replay"] = _gap(b, eng.replay(prompts(BATCH), spec, b.responses).rollout_logprobs)
                if b.meta.get("kv_cache_layout") == "packed":  # its tokens through the simulated cache, same route
                    cd._PACKED_KV = False
                    try:
                        sim = eng.cuda_decoder.replay(prompts(BATCH), spec, b.responses)
                    finally:
                        cd._PACKED_KV = packed
                    row["dlogp_vs_simulated_cache_same_route"] = _gap(b, sim.rollout_logprobs)
            dump()
            eng.kv_budget_bytes = budget
            fit = rows_that_fit(eng, SLOTS, torch.bfloat16, packed)
            row["max_batch_in_budget"] = fit
            if budget_batches and fit > BATCH:
                eng.cuda_decoder.reset()
                tok_max, _ = _tok_s(eng, prompts(fit), spec, max(2, reps - 1))
                kvm = kv_bytes_per_step(eng, fit, is_packed)
                roof_m = bw * fit / (row["weight_bytes"] + kvm)
                row.update(tok_s_max_batch=tok_max, over_bf16_b64_at_max_batch=tok_max / base["tok_s_b64"],
                           kv_bytes_per_step_max_batch=kvm, of_roof_with_kv_max_batch=tok_max / roof_m,
                           kv_cache_bytes_max_batch=_cache_bytes(eng))
        except Exception as e:  # noqa: BLE001 - one failing row must not hide the others
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        finally:
            cd._PACKED_KV = keep
            eng.kv_budget_bytes = None
            eng.cuda_decoder.reset()
        if eng is not ref:
            del eng
        gc.collect()
        torch.cuda.empty_cache()
        print(f"kv row {label}: {row}", flush=True)
        dump()
    packed_gap = out.get("int8_w8a8_int4kv", {}).get("dlogp_vs_teacher_forced_same_arithmetic")
    if packed_gap is not None:  # the packed cache against the simulated one, on the packed row's own tokens
        out["int4kv_packed_vs_simulated"] = {
            **packed_gap, "what": "|packed-cache rollout log-prob - simulated-cache full forward log-prob| of the "
                                  "packed row's sampled tokens (W8A8 + INT4 KV, same engine and weights)",
            "simulated_decode_same_measure": out.get("int8_w8a8_int4kv_simulated", {}).get(
                "dlogp_vs_teacher_forced_same_arithmetic"),
            "bf16_decode_same_measure": out.get("bf16", {}).get("dlogp_vs_teacher_forced_same_arithmetic")}
        # the criterion: the packed decode against the simulated decode of the same tokens, within twice the bf16
        # decode path's own distance from the bf16 plain loop
        same = out.get("int8_w8a8_int4kv", {}).get("dlogp_vs_simulated_cache_same_route")
        bf16_fwd = out.get("bf16", {}).get("dlogp_vs_teacher_forced_same_arithmetic")
        if same is not None and bf16_fwd is not None:  # the one-format criterion: packed against simulated, same tokens
            out["int4kv_packed_vs_simulated"].update(
                same_route=same, packed_within_twice_bf16_forward=same["mean_abs_dlogp"] <= 2 * bf16_fwd[
                    "mean_abs_dlogp"])
        # the same criterion against the W8A8 decode's own noise (W8A8 weights, plain bf16 cache, decode against its
        # full forward): the packed W8A8 rows' excess over twice bf16's, if the INT8 activations' rounding causes it,
        # is within twice this one
        w8_fwd = out.get("int8_w8a8", {}).get("dlogp_vs_teacher_forced_same_arithmetic")
        if same is not None and w8_fwd is not None:
            out["int4kv_packed_vs_simulated"].update(
                w8a8_decode_same_measure=w8_fwd,
                packed_within_twice_w8a8_forward=same["mean_abs_dlogp"] <= 2 * w8_fwd["mean_abs_dlogp"])
        rp, rb = (out.get(k, {}).get("dlogp_vs_replay") for k in ("int8_w8a8_int4kv", "bf16"))
        if rp is not None and rb is not None:
            out["int4kv_packed_vs_simulated"].update(
                vs_replay=rp, bf16_vs_replay=rb, ratio_to_bf16=rp["mean_abs_dlogp"] / max(rb["mean_abs_dlogp"], 1e-12),
                within_twice_bf16=rp["mean_abs_dlogp"] <= 2 * rb["mean_abs_dlogp"])
    out["summary"] = {k: {m: v.get(m) for m in ("tok_s_b64", "over_bf16_b64", "kv_bytes_per_step_over_bf16",
                                                "of_roof_with_kv_b64", "max_batch_in_budget", "tok_s_max_batch",
                                                "over_bf16_b64_at_max_batch")}
                      for k, v in out.items() if isinstance(v, dict) and "tok_s_b64" in v}
    del ref
    gc.collect()
    torch.cuda.empty_cache()


@section("kv_attention")
def attention_us(slots: tuple[int, ...] = (256, 384)) -> None:
    """Microseconds of one layer's decode attention at batch 64 (28 layers' caches cycled in a CUDA graph, so the
    cache comes from memory as in a decode step), and the bandwidth it reaches counting the cache bytes read."""
    from parity.precision.kv import make_kv_codec
    from parity.precision.kv_packed import PackedKVCache
    from parity.rollout import decode_attention as da
    out: dict = {}
    RESULTS["kv_attention"] = out
    B, n_kv, H, D = BATCH, SHAPE["num_key_value_heads"], SHAPE["num_attention_heads"], SHAPE["head_dim"]
    layers = SHAPE["num_hidden_layers"]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    S = max(slots)
    q = torch.randn(B, H, D, device=dev, generator=g).to(torch.bfloat16)
    key_ok = torch.ones(B, S, dtype=torch.bool, device=dev)
    scale = D ** -0.5
    kv = [(torch.randn(B, n_kv, S, D, device=dev, generator=g).to(torch.bfloat16),
           torch.randn(B, n_kv, S, D, device=dev, generator=g).to(torch.bfloat16)) for _ in range(layers)]
    for L in slots:
        slot = torch.tensor([L - 1], device=dev)
        kmask = (torch.arange(L, device=dev)[None, :] <= slot) & key_ok[:, :L]
        row: dict = {}
        out[f"L{L}"] = row
        bf16_bytes = 2 * B * n_kv * L * D * 2
        row["simulated_matmuls_bf16"] = us = graph_us(
            [(lambda k=k, v=v, L=L, m=kmask: da.torch_decode_attention(q, k[:, :, :L], v[:, :, :L], m, scale))
             for k, v in kv])
        row["simulated_matmuls_bf16_GBps"] = bf16_bytes / us / 1e3
        row["kernel_bf16"] = us = graph_us(
            [(lambda k=k, v=v, L=L, s=slot: da.raw_decode_attention(q, k, v, key_ok, s, L, scale)) for k, v in kv])
        row["kernel_bf16_GBps"] = bf16_bytes / us / 1e3
        for kind in ("int8", "fp8_per_token_head", "int4_per_token_head"):
            codec = make_kv_codec(kind, D)
            cache = PackedKVCache(codec, layers, B, n_kv, S, torch.bfloat16, dev)
            for layer, (k, v) in zip(cache.layers, kv):
                cache.write(layer, k, v, torch.zeros(1, dtype=torch.long, device=dev))
            row[f"kernel_{kind}"] = us = graph_us(
                [(lambda c=c, p=cache, L=L, s=slot: da.packed_decode_attention(q, p, c, key_ok, s, L, scale))
                 for c in cache.layers])
            row[f"kernel_{kind}_GBps"] = 2 * B * n_kv * L * codec.bytes_per_token_head() / us / 1e3
            if kind == "int4_per_token_head":  # A/B: the previous kernel (dequantizes every key and value)
                keep, da.INT4_ROTATED = da.INT4_ROTATED, False
                try:
                    row["kernel_int4_previous"] = us = graph_us(
                        [(lambda c=c, p=cache, L=L, s=slot: da.packed_decode_attention(q, p, c, key_ok, s, L, scale))
                         for c in cache.layers])
                finally:
                    da.INT4_ROTATED = keep
                row["kernel_int4_previous_GBps"] = 2 * B * n_kv * L * codec.bytes_per_token_head() / us / 1e3
            del cache
        print(f"kv attention L={L}: {row}", flush=True)
    del kv
    torch.cuda.empty_cache()
    out["splits_at_b64"] = {L: da.split_plan(B, n_kv, L, dev) for L in slots}
    out["note"] = f"GBps = cache bytes read / time; the copy ceiling this run: {RESULTS.get('ceilings')}"
    assert math.isfinite(out[f"L{slots[0]}"]["kernel_int4_per_token_head"])
