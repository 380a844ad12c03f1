"""One device run for the rotated int4 decode attention and the packed-KV decode step: checks, timings, one JSON.

    PYTHONPATH=$PWD/platform:$PWD/tests/bench PYTHONUNBUFFERED=1 python3 tests/bench/gpu_int4_decode_variants.py \\
        --out $OUT/int4_variants.json

Sections (each writes the JSON as it finishes; --budget seconds bounds the run, later sections are skipped with a
note when it is spent):
1. `variants`: every launch configuration in VARIANTS (parity.rollout.int4_attention) checked against a float64
   attention over the codec's values computed from the codes (fresh random inputs, NaN-poisoned outputs: the batch-64
   shape at L = 384 and 256 and two random shapes), then timed alone at batch 64 x 8 KV heads x 2 query heads,
   L = 256 and 384: a CUDA graph of 56 launches cycling 28 layers' caches (0.5 / 0.75 GB of int4 cache: far past
   the 50 MB L2), 20 replays each between CUDA events, median; GB/s = cache bytes read (codes and scale words) /
   time. The same for the previous int4 kernel (dequantizing every key and value), the kernel over a bf16 cache and
   over fp8 per-token-head codes (that one also under each of the autotuner's four candidates, against the pinned
   decode_attention.ATTN_CONFIG). The fastest variant that passed is what the rows below launch.
2. `length_sweep`: the fastest variant and the fp8 and bf16 kernels timed the same way at L = 128 to 1024, each
   fitted as a fixed time a launch plus a streaming rate (GB/s of the slope): which of the two bounds GB/s at 256.
3. `ceilings`: copy bandwidth and bf16 matmul rate (bench_gpu.ceilings).
4. `kv` rows at batch 64, Qwen3-0.6B shape, 128 + 256 tokens (gpu_bench_kv.kv_rows): BF16, INT8 W8A8, W8A8 + INT4
   KV, W8A8 + FP8 KV, BF16 + INT4 KV (packed), tokens/s and ratios to BF16, KV bytes a step, the INT4 row's decode
   step profile, and the log-prob gaps against a teacher-forced forward of the same tokens (every row, the plain-
   cache BF16 and W8A8 rows the yardsticks of their weight formats' decode noise; for the INT4 row: the
   packed cache against the simulated cache, `int4kv_packed_vs_simulated`). Then an A/B row: W8A8 + INT4 KV with
   the unfused pre-attention functions (cuda_decode._FUSED_PRE = False). The BF16 row is timed once more with its
   plain cache on the raw-value kernel (its fastest route), each row's ratio to it beside the default route's. With
   --max-batch each packed row also decodes at the largest batch whose KV cache fits in BF16's bytes at batch 64
   (240 rows for INT4, 124 for FP8).
5. `--tests`: tests/test_kv_packed_cuda.py first (time-boxed), when asked.
6. `--route-ab` alone (nothing else runs): the plain-cache BF16 and INT8 W8A8 rows under the three routes of
   cuda_decode's plain-cache attention (batched matmuls outside the compiled layer functions, the default; compiled
   with o_proj and the MLP per attended length, _ATTENTION_PER_L; the raw-value kernel, PARITY_PLAIN_ATTENTION=
   kernel, with its decode noise), twice in turn: the BF16 row is the denominator of every ratio above.
7. `--pre-ab` alone (nothing else runs): BF16 and W8A8 + INT4 KV (the rotated kernel) with the fused pre-attention
   on and off, the two settings in turn twice: what the fused pre-attention is worth in one run.
Prints a short table last. Needs torch, transformers, triton (pytest for --tests) only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from gpu_bench_common import BATCH, OUT_PATH, RESULTS, SHAPE, build_model_dir, dump

from parity.rollout.int4_attention import BLOCKS_FORM
from parity.rollout.int4_attention import CONFIG as PINNED

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.kv_packed_checks

# launch configurations of the rotated int4 kernel: each a whole configuration (every int4_attention.CONFIG key),
# named from its own values, so that a name says what ran whatever CONFIG is pinned to; the first is the pinned one,
# the others changes to the blocks form (rows16-warps4-stages2-pps1-blocks, pinned before the warp-split form)
_BASE = dict(BLOCKS_FORM)


def variant_name(cfg: dict) -> str:
    """rows{ROWS}-warps{num_warps}-stages{num_stages}-pps{programs_per_sm}, then -reg{maxnreg}, -noasm, -blocks
    (each column group's slots one block), -merge (the query's two parts in one product) and -rowscale (the V
    weights relative to each row's largest scale); the warp-split form (int4_attention_warps) as
    ws{warp_slots}-warps{num_warps}-stages{num_stages}-pps{programs_per_sm}, -reg, -noasm and -merge (ROWS, blocks and
    row_scale do not apply to it), -prefetchok (the next iteration's key mask loaded an iteration ahead), -fwht (the
    output rotation in float32 butterflies on the heads' rows), -groups (slot groups in the products' rows,
    int4_attention_groups, whose rotation is the butterflies), -groupv (its V product a group at a time), -l2pf{n}
    (its first n slots prefetched into L2 as a program starts), -quad (its V operands unpacked four at a time), -pdl."""
    tail = (f"-warps{cfg['num_warps']}-stages{cfg['num_stages']}-pps{cfg['programs_per_sm']}"
            + (f"-reg{cfg['maxnreg']}" if cfg.get("maxnreg") else "") + ("" if cfg["asm"] else "-noasm"))
    if cfg.get("warp_slots"):
        return (f"ws{cfg['warp_slots']}" + tail + ("-merge" if cfg.get("merge") else "")
                + ("-prefetchok" if cfg.get("prefetch_ok") else "") + ("-fwht" if cfg.get("fwht") else "")
                + ("-groups" if cfg.get("groups") else "") + ("-groupv" if cfg.get("group_v") else "")
                + (f"-l2pf{cfg['l2_slots']}" if cfg.get("l2_slots") else "")
                + ("-quad" if cfg.get("quad_unpack") else "") + ("-pdl" if cfg.get("pdl") else ""))
    return (f"rows{cfg['ROWS']}" + tail + ("-blocks" if cfg.get("blocks") else "")
            + ("-merge" if cfg.get("merge") else "") + ("-rowscale" if cfg.get("row_scale") else ""))


VARIANTS = {variant_name(c): c for c in (dict(PINNED), *({**_BASE, **d} for d in (
    {}, {"blocks": False}, {"row_scale": True}, {"merge": True}, {"row_scale": True, "merge": True}, {"num_stages": 3},
    {"programs_per_sm": 4}, {"ROWS": 8}, {"maxnreg": 168}, {"asm": False},
    # one wave at batch 64 (512 programs): 126 registers, four programs an SM (tests/bench/kv_kernels_sm90.py)
    {"ROWS": 8, "merge": True, "maxnreg": 128},
    # the warp-split form: 1,446 / 1,276 / 1,488 / 1,309 warp instructions per 64 slots in the loop against the
    # pinned form's 1,954, 3 barriers an iteration against 9; programs an SM by registers at one split (sm_90a): 2
    # at 4 warps (192, 234), 3 at 4 warps capped at 168, 5 and 4 at 2 warps (191, 250): one wave at 512 programs
    # (docs/PERFORMANCE.md, "The INT4 attention's warp-split form")
    {"warp_slots": 32, "merge": True}, {"warp_slots": 64, "merge": True},
    {"warp_slots": 32, "merge": True, "maxnreg": 168},
    {"warp_slots": 32, "merge": True, "num_warps": 2}, {"warp_slots": 64, "merge": True, "num_warps": 2},
    # one warp a program: no merge between warps at all, 7,338 / 6,677 warp instructions a program at 256 slots
    # against the pinned form's 10,948, at about 4 warps an SM; and split in two (about 8 warps an SM, one wave)
    {"warp_slots": 32, "merge": True, "num_warps": 1}, {"warp_slots": 64, "merge": True, "num_warps": 1},
    {"warp_slots": 32, "merge": True, "num_warps": 1, "programs_per_sm": 4},
    # the one-warp 64-slot program (the fastest on one H100, 2026-12-05: 15.26 us at L = 256) split in two (about 8
    # warps an SM instead of 4) and with a third stage of loads in flight
    {"warp_slots": 64, "merge": True, "num_warps": 1, "programs_per_sm": 4},
    {"warp_slots": 64, "merge": True, "num_warps": 1, "num_stages": 3},
    # the same with the key mask loaded an iteration ahead (its load was a memory round trip every iteration that
    # nothing hid: Nsight Compute, docs/PERFORMANCE.md), with two and three stages of the cache's loads in flight
    {"warp_slots": 64, "merge": True, "num_warps": 1, "prefetch_ok": True},
    {"warp_slots": 64, "merge": True, "num_warps": 1, "num_stages": 3, "prefetch_ok": True},
    # the pinned form with two warps a program (the output rotation in butterflies shortened the part after the
    # loop, which the second warp does not share; docs/PERFORMANCE.md, "The output rotation in butterflies")
    {"warp_slots": 64, "merge": True, "num_warps": 2, "num_stages": 3, "prefetch_ok": True, "fwht": True},
    # the warp-split form with the butterflies and no slot groups (pinned before the groups), the slot groups as
    # pinned before the V product a group at a time and the L2 prefetch, without the prefetch, and with the V operands
    # unpacked one at a time (pinned before)
    {"warp_slots": 64, "merge": True, "num_warps": 1, "num_stages": 3, "prefetch_ok": True, "fwht": True},
    {**PINNED, "group_v": False, "l2_slots": 0}, {**PINNED, "l2_slots": 0},
    {**PINNED, "quad_unpack": False})))}
# (warps, slots a warp) of the dequantizing kernel's warp-split form (decode_attention_warps) timed for FP8 and the
# raw bf16 cache beside its pinned form (docs/PERFORMANCE.md, "The INT4 attention's warp-split form")
DEQUANT_FORMS = ((4, 16), (4, 32), (2, 32), (1, 32))
T0 = time.perf_counter()


def left(budget: float) -> float:
    return budget - (time.perf_counter() - T0)


def event_us(calls: list, launches: int = 56, replays: int = 20) -> float:
    """Microseconds a call: a CUDA graph of `launches` calls cycling through `calls` (each run once before, so that
    compilation and workspaces stay outside), replayed `replays` times between CUDA events; the median."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(launches):
            calls[i % len(calls)]()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / launches)
    del g
    return round(statistics.median(times), 3)


def warm_up(cache, qs, key_ok, scale: float, slots: tuple[int, ...]) -> None:
    """Compile every variant (one split and several) in threads before anything is timed: Triton's passes and
    ptxas run outside the interpreter lock, so the compiles overlap. Each thread has its own workspace."""
    from concurrent.futures import ThreadPoolExecutor

    from parity.rollout import int4_attention as ia
    c = cache.layers[0]
    B = qs.rotated.shape[0]

    def one(cfg: dict) -> None:
        ws = ia.Workspace()
        for L in slots:
            for pps in (cfg.get("programs_per_sm", ia.CONFIG["programs_per_sm"]), 0, 10**6):
                ia.int4_attention(qs, c.k, c.v, c.k_scale, c.v_scale, key_ok, torch.tensor([L - 1], device="cuda"),
                                  L, scale, True, torch.bfloat16, ws, {**cfg, "programs_per_sm": pps})
    t = time.perf_counter()
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(one, VARIANTS.values()))
    torch.cuda.synchronize()
    RESULTS.setdefault("variants", {})["compile_s"] = round(time.perf_counter() - t, 1)
    print(f"compiled the variants in {time.perf_counter() - t:.0f} s (B = {B})", flush=True)


def timing_inputs(S: int, seed: int) -> tuple:
    """What the timings read, at the Qwen3-0.6B decode shape (batch 64): random bf16 queries q and their rotated
    int4 side qs, every slot allowed, the softmax scale, 28 layers' random bf16 K and V of S slots, and the same
    values in packed int4 and fp8 per-token-head caches. (device, q, qs, key_ok, scale, kv, int4, fp8)."""
    from parity.precision.kv import make_kv_codec
    from parity.precision.kv_packed import PackedKVCache
    from parity.rollout import int4_attention as ia
    B, n_kv, H, D = BATCH, SHAPE["num_key_value_heads"], SHAPE["num_attention_heads"], SHAPE["head_dim"]
    layers = SHAPE["num_hidden_layers"]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(B, H, D, device=dev, generator=g).to(torch.bfloat16)
    key_ok = torch.ones(B, S, dtype=torch.bool, device=dev)
    scale = D ** -0.5
    kv = [(torch.randn(B, n_kv, S, D, device=dev, generator=g).to(torch.bfloat16),
           torch.randn(B, n_kv, S, D, device=dev, generator=g).to(torch.bfloat16)) for _ in range(layers)]
    caches = {}
    for kind in ("int4_per_token_head", "fp8_per_token_head"):
        caches[kind] = c = PackedKVCache(make_kv_codec(kind, D), layers, B, n_kv, S, torch.bfloat16, dev)
        for layer, (k, v) in zip(c.layers, kv):
            c.write(layer, k, v, torch.zeros(1, dtype=torch.long, device=dev))
    int4, fp8 = caches["int4_per_token_head"], caches["fp8_per_token_head"]
    qs = ia.prepare_queries(q, True)
    return dev, q, qs, key_ok, scale, kv, int4, fp8


def variants(slots: tuple[int, ...] = (256, 384)) -> None:
    from parity.rollout import decode_attention as da
    from parity.rollout import int4_attention as ia
    from tests.kv_packed_checks import check_int4_attention
    out: dict = RESULTS.setdefault("variants", {})
    out["method"] = ("CUDA graph of 56 launches over 28 layers' caches, 20 replays between CUDA events, median; "
                     "GBps = cache bytes read (codes + scale words) / time")
    B, n_kv, D, S = BATCH, SHAPE["num_key_value_heads"], SHAPE["head_dim"], max(slots)
    dev, q, qs, key_ok, scale, kv, int4, fp8 = timing_inputs(S, seed=0)
    warm_up(int4, qs, key_ok, scale, slots)
    gen = torch.Generator().manual_seed(1)
    shapes = [(B, n_kv, 2, S, 384, 383), (B, n_kv, 2, S, 256, 200)]
    for _ in range(2):  # random rows, KV heads, lengths (the model's 2 query heads a KV head: other group sizes are
        s_ = int(torch.randint(32, 500, (1,), generator=gen))  # tests/test_kv_packed_cuda.py's, one compile each)
        L_ = int(torch.randint(1, s_ + 1, (1,), generator=gen))
        shapes.append((int(torch.randint(1, 33, (1,), generator=gen)), int(torch.randint(1, 9, (1,), generator=gen)),
                       2, s_, L_, int(torch.randint(0, L_, (1,), generator=gen))))
    best, best_us = None, float("inf")
    for name, cfg in VARIANTS.items():
        row: dict = {"config": {**ia.CONFIG, **cfg}}
        out[name] = row
        try:
            errs = [check_int4_attention(D, torch.bfloat16, dev, shp, True, seed=i, config=cfg)[0]
                    for i, shp in enumerate(shapes)]
            row["max_rel_err_vs_f64"] = max(errs)
            row["passed"] = bool(max(errs) < 4e-3)
            for L in slots:
                st = torch.tensor([L - 1], device=dev)
                us = event_us([(lambda c=c, L=L, st=st, cfg=cfg: ia.int4_attention(
                    qs, c.k, c.v, c.k_scale, c.v_scale, key_ok, st, L, scale, True, torch.bfloat16,
                    da._workspace(int4), cfg)) for c in int4.layers])
                row[f"L{L}_us"] = us
                row[f"L{L}_GBps"] = round(2 * B * n_kv * L * int4.codec.bytes_per_token_head() / us / 1e3, 1)
                row[f"L{L}_splits"] = ia.split_plan(B, n_kv, L, dev, ia.iteration_slots(row["config"], 2),
                                                    row["config"]["programs_per_sm"])[0]
            if row["passed"] and row["L256_us"] + row["L384_us"] < best_us:
                best, best_us = name, row["L256_us"] + row["L384_us"]
        except Exception as e:  # noqa: BLE001 - a variant that fails to compile or run is reported, not fatal
            row["error"] = f"{type(e).__name__}: {e}"[:600]
        print(f"variant {name}: {row}", flush=True)
        dump()
    out["best"] = best
    if best is not None:
        ia.CONFIG.update(VARIANTS[best])
    ref: dict = {}
    out["reference_kernels"] = ref
    for L in slots:
        st = torch.tensor([L - 1], device=dev)
        bf16_bytes = 2 * B * n_kv * L * D * 2
        us = event_us([(lambda k=k, v=v, L=L, st=st: da.raw_decode_attention(q, k, v, key_ok, st, L, scale))
                       for k, v in kv])
        ref[f"bf16_kernel_L{L}"] = {"us": us, "GBps": round(bf16_bytes / us / 1e3, 1)}
        us = event_us([(lambda c=c, L=L, st=st: da.packed_decode_attention(q, fp8, c, key_ok, st, L, scale))
                       for c in fp8.layers])
        ref[f"fp8_per_token_head_kernel_L{L}"] = {
            "us": us, "GBps": round(2 * B * n_kv * L * fp8.codec.bytes_per_token_head() / us / 1e3, 1)}
        i4b = 2 * B * n_kv * L * int4.codec.bytes_per_token_head()
        us = event_us([(lambda c=c, L=L, st=st: da.packed_decode_attention(q, int4, c, key_ok, st, L, scale))
                       for c in int4.layers])
        ref[f"int4_rotated_with_query_launch_L{L}"] = {"us": us, "GBps": round(i4b / us / 1e3, 1)}
        keep, da.INT4_ROTATED = da.INT4_ROTATED, False
        try:
            us = event_us([(lambda c=c, L=L, st=st: da.packed_decode_attention(q, int4, c, key_ok, st, L, scale))
                           for c in int4.layers])
        finally:
            da.INT4_ROTATED = keep
        ref[f"int4_previous_kernel_L{L}"] = {"us": us, "GBps": round(i4b / us / 1e3, 1)}
        # the dequantizing kernel (FP8 here) under each of the autotuner's candidates, against the pinned one
        # (decode_attention.ATTN_CONFIG, the launches above): whether the pin costs this shape anything
        keep_cfg = dict(da.ATTN_CONFIG)
        try:
            for c in da._attn_tuned.configs:
                da.ATTN_CONFIG.update(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
                us = event_us([(lambda c_=c_, L=L, st=st: da.packed_decode_attention(q, fp8, c_, key_ok, st, L, scale))
                               for c_ in fp8.layers])
                ref[f"fp8_per_token_head_kernel_L{L}_tile{c.kwargs['BLOCK_N']}_warps{c.num_warps}"] = {
                    "us": us, "GBps": round(2 * B * n_kv * L * fp8.codec.bytes_per_token_head() / us / 1e3, 1)}
            # its warp-split form (decode_attention_warps), FP8 and the raw bf16 cache (the plain caches' kernel route)
            for warps, ws in DEQUANT_FORMS:
                da.ATTN_CONFIG.update(keep_cfg, num_warps=warps, warp_slots=ws)
                us = event_us([(lambda c_=c_, L=L, st=st: da.packed_decode_attention(q, fp8, c_, key_ok, st, L, scale))
                               for c_ in fp8.layers])
                ref[f"fp8_per_token_head_kernel_L{L}_warps{warps}_ws{ws}"] = {
                    "us": us, "GBps": round(2 * B * n_kv * L * fp8.codec.bytes_per_token_head() / us / 1e3, 1)}
                us = event_us([(lambda k=k, v=v, L=L, st=st: da.raw_decode_attention(q, k, v, key_ok, st, L, scale))
                               for k, v in kv])
                ref[f"bf16_kernel_L{L}_warps{warps}_ws{ws}"] = {"us": us, "GBps": round(bf16_bytes / us / 1e3, 1)}
        finally:
            da.ATTN_CONFIG.clear()
            da.ATTN_CONFIG.update(keep_cfg)
        print(f"reference kernels L={L}: { {k: v for k, v in ref.items() if k.endswith(f'L{L}')} }", flush=True)
        dump()
    # the dequantizing kernel's form for what follows (the sweep, the formats' rows: FP8 and BF16's kernel route):
    # the warp-split configuration with the least FP8 + bf16 time over both lengths, if less than the pinned form's
    def total(tag: str) -> float:
        return sum(ref[f"{kind}_L{L}{tag}"]["us"] for L in slots for kind in ("fp8_per_token_head_kernel", "bf16_kernel"))
    forms = {(w, s_): total(f"_warps{w}_ws{s_}") for w, s_ in DEQUANT_FORMS}
    (w, s_), t = min(forms.items(), key=lambda x: x[1])
    if t < total(""):
        da.ATTN_CONFIG.update(num_warps=w, warp_slots=s_)
    ref["dequant_config_for_rows"] = dict(da.ATTN_CONFIG)
    print(f"dequantizing kernel for the rows: {da.ATTN_CONFIG} (pinned form {total(''):.1f} us, warp-split "
          f"{ {f'{a}x{b}': round(v, 1) for (a, b), v in forms.items()} })", flush=True)
    del kv
    torch.cuda.empty_cache()


def line_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares line y = a + b x through (x, y) points: (a, b)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (y - my) for x, y in points) / sxx
    return my - b * mx, b


def fixed_and_streaming(us_at: dict[int, float], bytes_per_slot: float) -> dict:
    """A kernel's time against the attended length L as a fixed part (the fit's value at L = 0: launch, the query
    side, the merge and the output, the last wave's tail) and a streaming rate (cache bytes per microsecond of the
    fit's slope, GB/s); what time at L = 256 a 2 TB/s read would need, for comparison."""
    a, b = line_fit(sorted(us_at.items()))
    return {"us": {str(k): v for k, v in sorted(us_at.items())}, "fixed_us": round(a, 2),
            "streaming_GBps": round(bytes_per_slot / b / 1e3, 1) if b > 0 else None,
            "max_residual_us": round(max(abs(v - a - b * k) for k, v in us_at.items()), 2),
            "us_for_2TBps_at_L256": round(256 * bytes_per_slot / 2e6, 2)}


def length_sweep(slots: tuple[int, ...] = (128, 192, 256, 384, 512, 768, 1024)) -> None:
    """The best variant and the reference kernels timed over attended lengths (event_us, 28 layers' caches of
    max(slots) slots), each fitted as a fixed time plus a streaming rate (fixed_and_streaming): whether a kernel's
    GB/s at L = 256 is bound by what it pays once a launch or by how fast it reads."""
    from parity.rollout import decode_attention as da
    from parity.rollout import int4_attention as ia
    out: dict = RESULTS.setdefault("length_sweep", {})
    B, n_kv, D, S = BATCH, SHAPE["num_key_value_heads"], SHAPE["head_dim"], max(slots)
    dev, q, qs, key_ok, scale, kv, int4, fp8 = timing_inputs(S, seed=2)
    kernels = {  # name: (bytes a slot over the batch's KV heads, one launch over a layer's cache at L)
        f"int4_rotated_{RESULTS.get('variants', {}).get('best') or 'default'}": (
            2 * B * n_kv * int4.codec.bytes_per_token_head(),
            lambda c, L, st: ia.int4_attention(qs, c.k, c.v, c.k_scale, c.v_scale, key_ok, st, L, scale, True,
                                               torch.bfloat16, da._workspace(int4), {})),
        "fp8_per_token_head": (2 * B * n_kv * fp8.codec.bytes_per_token_head(),
                               lambda c, L, st: da.packed_decode_attention(q, fp8, c, key_ok, st, L, scale)),
        "bf16": (2 * B * n_kv * D * 2, lambda kv_, L, st: da.raw_decode_attention(q, *kv_, key_ok, st, L, scale)),
    }
    per_layer = {"fp8_per_token_head": fp8.layers, "bf16": kv}
    for name, (bps, call) in kernels.items():
        us_at = {}
        try:
            for L in slots:
                st = torch.tensor([L - 1], device=dev)
                us_at[L] = event_us([(lambda c=c, L=L, st=st, call=call: call(c, L, st))
                                     for c in per_layer.get(name, int4.layers)])
            out[name] = fixed_and_streaming(us_at, bps)
        except Exception as e:  # noqa: BLE001 - one kernel failing leaves the others' sweeps
            out[name] = {"us": {str(k): v for k, v in us_at.items()}, "error": f"{type(e).__name__}: {e}"[:400]}
        print(f"length sweep {name}: {out[name]}", flush=True)
        dump()
    del kv
    torch.cuda.empty_cache()


def cuda_tests(timeout: int, workers: int) -> None:
    from gpu_packed_kv import cuda_tests as run
    run(timeout, workers)


def rows(reps: int, budget: float, max_batch: bool = False) -> None:
    from bench_gpu import ceilings
    from gpu_bench_kv import kv_rows

    import parity.rollout.cuda_decode as cd
    ceilings()
    d = build_model_dir()
    kv_rows(d, reps, rows=[("bf16", "bf16", "bf16", True), ("int8_w8a8", "int8", "bf16", True),
                           ("int8_w8a8_int4kv", "int8", "int4_per_token_head", True),
                           ("int8_w8a8_fp8kv", "int8", "fp8_per_token_head", True),
                           ("bf16_int4kv", "bf16", "int4_per_token_head", True)], budget_batches=max_batch)
    main = RESULTS["kv"]
    kernel_route_peer(d, reps, main)
    if left(budget) > 60:  # A/B: the same INT4 row with the unfused pre-attention functions
        keep, saved = cd._FUSED_PRE, RESULTS.pop("kv")
        try:
            kv = pre_pass(d, reps, False, "int8_w8a8_int4kv_unfused_pre")
            main["ab_unfused_pre_attention"] = {k: kv.get(k, {}).get(m) for k, m in (
                ("bf16", "tok_s_b64"), ("int8_w8a8_int4kv_unfused_pre", "tok_s_b64"),
                ("int8_w8a8_int4kv_unfused_pre", "over_bf16_b64"))}
        finally:
            cd._FUSED_PRE = keep
            RESULTS["kv"] = saved
    else:
        main["ab_unfused_pre_attention"] = "skipped: budget spent"
    dump()


@contextlib.contextmanager
def plain_route(value: str):
    """PARITY_PLAIN_ATTENTION set to `value` (decode_attention.plain_kernel reads it at each call), then restored."""
    env = os.environ.get("PARITY_PLAIN_ATTENTION")
    os.environ["PARITY_PLAIN_ATTENTION"] = value
    try:
        yield
    finally:
        if env is None:
            os.environ.pop("PARITY_PLAIN_ATTENTION", None)
        else:
            os.environ["PARITY_PLAIN_ATTENTION"] = env


def kernel_route_peer(d: str, reps: int, main: dict) -> None:
    """The BF16 row again with its plain cache's attention on the raw-value kernel (PARITY_PLAIN_ATTENTION=kernel,
    its fastest route), in the same run: each row's tok/s over it as `over_bf16_kernel_route_b64` beside the
    default route's `over_bf16_b64`."""
    from gpu_bench_kv import kv_rows
    saved = RESULTS.pop("kv")
    try:
        with plain_route("kernel"):
            kv_rows(d, reps, rows=[("bf16", "bf16", "bf16", True)], budget_batches=False, teacher_forced=False)
        peer = RESULTS["kv"].get("bf16", {}).get("tok_s_b64")
    finally:
        RESULTS["kv"] = saved
    main["bf16_kernel_route_tok_s_b64"] = peer
    for row in main.get("summary", {}).values():
        if peer and row.get("tok_s_b64"):
            row["over_bf16_kernel_route_b64"] = row["tok_s_b64"] / peer
    dump()


def route_ab(reps: int) -> None:
    """The plain-cache rows (bf16, INT8 W8A8) under the three routes of cuda_decode's plain-cache attention: the
    batched matmuls outside the compiled layer functions (the default), compiled with o_proj and the MLP for each
    attended length (_ATTENTION_PER_L), and decode_attention's kernel over the raw values (PARITY_PLAIN_ATTENTION=
    kernel); each route's rows in one pass, the three passes twice in turn: the bf16 row is every ratio's denominator."""
    from gpu_bench_kv import kv_rows

    import parity.rollout.cuda_decode as cd
    d = build_model_dir()
    keep, out = cd._ATTENTION_PER_L, {}
    try:
        for rep in range(2):
            for route, per_l, plain in (("outside", False, "torch"), ("per_L", True, "torch"),
                                        ("kernel", False, "kernel")):
                cd._ATTENTION_PER_L = per_l
                with plain_route(plain):
                    kv_rows(d, reps, rows=[("bf16", "bf16", "bf16", True), ("int8_w8a8", "int8", "bf16", True)],
                            budget_batches=False, teacher_forced=route == "kernel" and rep == 0)
                for label in ("bf16", "int8_w8a8"):
                    row = RESULTS["kv"].get(label, {})
                    out.setdefault(f"{label}_{route}", []).append(row.get("tok_s_b64"))
                    if route == "kernel" and rep == 0:  # its decode noise beside the default route's (INT4 bench)
                        out[f"{label}_kernel_dlogp_vs_teacher_forced"] = row.get(
                            "dlogp_vs_teacher_forced_same_arithmetic")
                RESULTS["route_ab"] = dict(out, what="tok/s at batch 64, each route's rows in turn, twice")
                dump()
                print(f"route {route} pass {rep}: {out}", flush=True)
    finally:
        cd._ATTENTION_PER_L = keep
    RESULTS.pop("kv", None)


def pre_pass(d: str, reps: int, fused: bool, label: str = "int8_w8a8_int4kv") -> dict:
    """The BF16 row and the W8A8 + INT4 KV row (`label`) at batch 64 with cuda_decode._FUSED_PRE = fused (the caller
    restores it), without teacher-forced gaps or larger batches: that pass's RESULTS["kv"]."""
    from gpu_bench_kv import kv_rows

    import parity.rollout.cuda_decode as cd
    cd._FUSED_PRE = fused
    kv_rows(d, reps, rows=[("bf16", "bf16", "bf16", True), (label, "int8", "int4_per_token_head", True)],
            budget_batches=False, teacher_forced=False)
    return RESULTS["kv"]


def pre_ab(reps: int, knob: str = "fused") -> None:
    """The W8A8 + INT4 KV row (the rotated kernel) beside the BF16 row with the fused pre-attention on and off (or, knob
    "pdl", int4_attention.CONFIG["pdl"] with it on), each setting's rows in one pass, in turn twice: its worth in one run."""
    import parity.rollout.cuda_decode as cd
    import parity.rollout.int4_attention as ia
    d = build_model_dir()
    keep, keep_pdl, out = cd._FUSED_PRE, ia.CONFIG["pdl"], {}
    try:
        for _ in range(2):
            for on in (True, False):
                key = ("pdl" if on else "nopdl") if knob == "pdl" else ("fused" if on else "unfused")
                ia.CONFIG["pdl"] = on if knob == "pdl" else keep_pdl
                kv = pre_pass(d, reps, on or knob == "pdl")
                for label in ("bf16", "int8_w8a8_int4kv"):
                    out.setdefault(f"{label}_{key}", []).append(kv.get(label, {}).get("tok_s_b64"))
                out[f"kv_kernel_{key}"] = kv.get("int8_w8a8_int4kv", {}).get("kv_kernel")
                if all(out.get(f"{r}_{key}") and None not in out[f"{r}_{key}"] for r in ("bf16", "int8_w8a8_int4kv")):
                    out[f"over_bf16_{key}"] = (statistics.mean(out[f"int8_w8a8_int4kv_{key}"])
                                               / statistics.mean(out[f"bf16_{key}"]))
                RESULTS["pre_ab"] = dict(out, what="tok/s at batch 64; the two settings' passes in turn, twice")
                dump()
                print(f"pre-attention {key}: {out}", flush=True)
    finally:
        cd._FUSED_PRE, ia.CONFIG["pdl"] = keep, keep_pdl
    RESULTS.pop("kv", None)


def table() -> None:
    print("\n== rotated int4 decode attention, batch 64 x 8 KV heads x 2 query heads (GB/s of cache read)")
    v = RESULTS.get("variants", {})
    for name, row in v.items():
        if isinstance(row, dict) and "config" in row:  # one line a variant
            print(f"{name:28s} ok={row.get('passed')} err={row.get('max_rel_err_vs_f64', float('nan')):.2e} "
                  f"L256 {row.get('L256_us', '-')} us {row.get('L256_GBps', '-')} GB/s  "
                  f"L384 {row.get('L384_us', '-')} us {row.get('L384_GBps', '-')} GB/s {row.get('error', '')[:80]}")
    for k, r in v.get("reference_kernels", {}).items():
        if "us" in r:  # the timed kernels (beside them the dequantizing configuration the rows ran)
            print(f"{k:40s} {r['us']:8.2f} us {r['GBps']:8.1f} GB/s")
        else:
            print(f"{k:40s} {r}")
    print(f"best variant: {v.get('best')}; ceilings: {RESULTS.get('ceilings')}")
    for k, r in RESULTS.get("length_sweep", {}).items():
        if isinstance(r, dict) and "fixed_us" in r:
            print(f"{k:40s} fixed {r['fixed_us']:6.2f} us, streaming {r['streaming_GBps']} GB/s "
                  f"(2 TB/s at L = 256 needs {r['us_for_2TBps_at_L256']} us)")
    kv = RESULTS.get("kv", {})
    print(f"\n{'row':30s} {'tok/s b64':>10s} {'x bf16':>7s} {'KV x bf16':>9s} {'dlogp mean/max vs own forward':>30s}")
    for label, r in kv.items():
        if isinstance(r, dict) and "tok_s_b64" in r:
            gap = r.get("dlogp_vs_teacher_forced_same_arithmetic") or {}
            print(f"{label:30s} {r['tok_s_b64']:10.0f} {r.get('over_bf16_b64', 0):7.3f} "
                  f"{r.get('kv_bytes_per_step_over_bf16', 0):9.3f} "
                  f"{gap.get('mean_abs_dlogp', float('nan')):14.4f} / {gap.get('max_abs_dlogp', float('nan')):.3f}")
        elif isinstance(r, dict) and "error" in r:
            print(f"{label:30s} error: {r['error'][:100]}")
    peer = kv.get("bf16_kernel_route_tok_s_b64")
    if peer:
        print(f"BF16 on the kernel route {peer:.0f} tok/s; over it: " + ", ".join(
            f"{k} {r['over_bf16_kernel_route_b64']:.3f}" for k, r in kv.get("summary", {}).items()
            if r.get("over_bf16_kernel_route_b64")))
    prof = kv.get("int8_w8a8_int4kv", {}).get("decode_step_profile", {})
    if prof:
        print(f"W8A8 + INT4 step: {prof.get('kernel_ms_per_step', 0):.3f} ms kernels, "
              f"{prof.get('replay_ms_per_step', 0):.3f} ms replay, {prof.get('kernels_per_step')} kernels")
    print(f"A/B unfused pre-attention: {kv.get('ab_unfused_pre_attention')}")
    print(f"packed vs simulated (same tokens): {kv.get('int4kv_packed_vs_simulated')}")
    print(f"total {RESULTS.get('total_s', 0):.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "int4_variants.json"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--budget", type=float, default=450.0, help="seconds; later sections are skipped past it")
    p.add_argument("--tests", action="store_true", help="run tests/test_kv_packed_cuda.py first (time-boxed)")
    p.add_argument("--test-timeout", type=int, default=200)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--skip-rows", action="store_true")
    p.add_argument("--max-batch", action="store_true", help="the kv rows also at the largest batch in BF16's KV bytes")
    p.add_argument("--route-ab", action="store_true", help="only the plain-cache rows under the three decode routes")
    p.add_argument("--pre-ab", action="store_true", help="only the W8A8 + INT4 row with the fused pre-attention on, off")
    p.add_argument("--pdl-ab", action="store_true", help="as --pre-ab, the INT4 attention's \"pdl\" on and off")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(f"{__file__}: needs a CUDA device; nothing measured on this machine")
        return
    OUT_PATH[0] = args.out
    import parity.rollout.cuda_decode as cd
    import parity.rollout.decode_attention as da
    # the paths under measurement (the project's defaults), whatever the environment says
    da.INT4_ROTATED = cd._FUSED_PRE = True
    RESULTS.update(device=torch.cuda.get_device_name(), torch=torch.__version__, budget_s=args.budget,
                   env={k: os.environ.get(k) for k in ("PARITY_FUSED_SAMPLER", "PARITY_PLAIN_ATTENTION")})
    if args.tests:
        cuda_tests(args.test_timeout, args.workers)
    if args.route_ab or args.pre_ab or args.pdl_ab:
        route_ab(args.reps) if args.route_ab else pre_ab(args.reps, "pdl" if args.pdl_ab else "fused")
        RESULTS["total_s"] = time.perf_counter() - T0
        dump()
        return
    try:
        variants()
    except Exception as e:  # noqa: BLE001
        RESULTS.setdefault("errors", {})["variants"] = f"{type(e).__name__}: {e}"[:800]
    dump()
    if left(args.budget) > 90:
        try:
            length_sweep()
        except Exception as e:  # noqa: BLE001
            RESULTS.setdefault("errors", {})["length_sweep"] = f"{type(e).__name__}: {e}"[:800]
    else:
        RESULTS["length_sweep"] = {"skipped": f"budget: {left(args.budget):.0f} s left"}
    dump()
    if not args.skip_rows:
        if left(args.budget) > 120:
            rows(args.reps, args.budget, args.max_batch)
        else:
            RESULTS["kv"] = {"skipped": f"budget: {left(args.budget):.0f} s left"}
    RESULTS["total_s"] = time.perf_counter() - T0
    dump()
    print(json.dumps({k: v for k, v in RESULTS.items() if k in ("errors", "cuda_tests")}, default=str)[:2000])
    table()


if __name__ == "__main__":
    main()
