"""Decode attention over a packed KV cache (parity.precision.kv_packed): one Triton kernel, flash-decoding style.

The int4 per-token-head cache with head_dim >= 64 takes parity.rollout.int4_attention instead (`INT4_ROTATED`, the
default; PARITY_INT4_ATTENTION=dequant turns it off): attention in the rotated basis, which reads the codes without
dequantizing them. The kernel below serves the other formats, and int4 with `INT4_ROTATED = False` (the previous
design, for A/B runs):

One query token per batch row attends over the cache's first L slots, of which it sees slot j when j <= slot (the
step's own, just written) and key_ok[b, j] (no left padding). A program takes one (row, KV head) and one split of
the slots: the query heads of that KV head (grouped-query attention: query head h reads KV head h // G, as in HF)
form the rows of its tiles, so K and V are read once per KV head, not once per query head. It walks its slots in
tiles of BLOCK_N, dequantizes each K and V tile in registers with kv_packed's tile loader (the codec's values bit
for bit) and keeps a running max, sum and weighted V sum in float32 (online softmax); the partial results of the
splits are combined by a second kernel. With enough (row, KV head) pairs to fill the GPU there is one split and
the first kernel writes the output itself.

The arithmetic differs from the simulated path's two matmuls (bf16 scores, softmax, bf16 probabilities) only in
rounding of the attention sum. `torch_decode_attention` is that reference (and the CPU path without Triton).
"""

from __future__ import annotations

import functools
import math
import os

import torch

from parity.precision.kv import make_kv_codec
from parity.precision.kv_packed import (
    KIND_INT4,
    KIND_RAW,
    PACKED_KINDS,
    PackedKVCache,
    PackedLayer,
    kernel_shape_ok,
    transform_mode,
)

try:
    import triton
    import triton.language as tl

    from parity.precision.kv_packed import _kv_cols, _kv_consts, _kv_tile
except ImportError:  # CPU installs
    triton = None

BLOCK_N = 64  # slots per split unit (splits cover multiples of it); the kernel's tile is 64 or 32
# programs to aim for: splits are added while (rows x KV heads x splits) is below this many per SM
_PROGRAMS_PER_SM = 2
# The kernel's launch configuration: slots a tile (64 or 32), warps, pipeline depth. Triton's autotuner, which
# times the four (64 | 32 slots) x (4 | 8 warps) candidates at a format's first call, drew all four for the same
# format and shapes in the study's runs sharing one GPU, and with them the bits of a run's rollouts: a lottery
# under contention. So one configuration everywhere, the one drawn most often there (and the interpreter's);
# PARITY_KV_ATTENTION_TILE=timed lets the autotuner choose, as before. docs/PERFORMANCE.md, "One launch
# configuration for the dequantizing attention".
# "warp_slots": 0, this module's kernel; n > 0, its warp-split form (parity.rollout.decode_attention_warps: each warp
# n slots of its own an iteration), for the caches other than int4 and queries other than float32.
ATTN_CONFIG = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2, "warp_slots": 0}
# Float32 caches (float32 models, the tests) launch it with 8 warps: at 4 the float32 int4 tile spills 396-420 bytes
# a thread at head_dim 128, at 8 none (Triton's compile for sm_90a, tests/bench/kv_kernels_sm90.py)
ATTN_WARPS_FP32 = 8
_DEFAULT_SMS = 132
unusable_reason: str | None = None  # why usable() said no, for reports


def int4_rotated_route() -> bool:
    """PARITY_INT4_ATTENTION: 'rotated' (the default: int4 per-token-head caches attend in the rotated basis,
    parity.rollout.int4_attention) or 'dequant' (this module's kernel, which dequantizes every key and value). Read
    once, when the module is imported."""
    v = os.environ.get("PARITY_INT4_ATTENTION", "rotated")
    if v not in ("rotated", "dequant"):
        raise ValueError(f"PARITY_INT4_ATTENTION={v!r}: expected 'rotated' (the default) or 'dequant'")
    return v == "rotated"


def fused_pre_attention_route() -> bool:
    """PARITY_FUSED_PRE_ATTENTION: 'on' (the default: a packed cache's q/k norms, rotary, cache write and query
    preparation as one Triton kernel, parity.rollout.pre_attention; a simulated cache's step the same norms and
    rotary, parity.rollout.fused_step; cuda_decode._FUSED_PRE; a cohort's decoder never takes it) or 'off' (the
    compiled function, the write kernel and the attention's own query launch). On by default since every CUDA test
    file passed with it on, the packed cache measured one format with the simulated cache on its route, and W8A8 +
    INT4 KV decodes 1.12-1.16x faster with it (docs/INT4_DECODE.md). Read once, when cuda_decode is imported."""
    v = os.environ.get("PARITY_FUSED_PRE_ATTENTION", "on")
    if v not in ("off", "on"):
        raise ValueError(f"PARITY_FUSED_PRE_ATTENTION={v!r}: expected 'on' (the default) or 'off'")
    return v == "on"


# True: int4 per-token-head caches attend in the rotated basis (parity.rollout.int4_attention): the default since
# the packed path and the simulated one measured one format on it (the CUDA tests' one-format checks, the Countdown
# model, the 0.6B shape: docs/INT4_DECODE.md). False: this module's kernel
INT4_ROTATED = int4_rotated_route()


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_SMS


def split_plan(B: int, n_kv: int, L: int, device: torch.device) -> tuple[int, int]:
    """(splits, tiles per split) for B rows x n_kv heads over L slots: enough programs for every SM, no split
    without a tile."""
    tiles = -(-L // BLOCK_N)
    want = -(-_PROGRAMS_PER_SM * _sm_count(device) // (B * n_kv))
    per = -(-tiles // max(1, min(tiles, want)))
    return -(-tiles // per), per


def use_packed(engine, dtype: torch.dtype) -> bool:
    """Whether the decode path stores this engine's KV cache packed: a packed kind, `engine.kv_packed` not False,
    and (unless it is True, which forces the packed cache with the torch backend off CUDA) a CUDA device whose
    kernels pass their self-check for the format (`usable`)."""
    codec, want = engine.kv_codec, getattr(engine, "kv_packed", None)
    if codec is None or codec.kind not in PACKED_KINDS or want is False:
        return False
    if want:
        return True
    dev = engine.device
    return dev.type == "cuda" and usable(dev.index or 0, codec.kind, bool(getattr(codec, "hadamard", False)),
                                         codec.head_dim, dtype)


def packed_cache_for(engine, batch: int, slots: int, dtype: torch.dtype) -> PackedKVCache | None:
    """The decode path's packed cache for `batch` rows of `slots` slots, or None (use_packed says no)."""
    if not use_packed(engine, dtype):
        return None
    return PackedKVCache(engine.kv_codec, len(engine.model.model.layers), batch, engine.n_kv, slots, dtype,
                         engine.device)


def torch_decode_attention(q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, kmask: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """q [B, H, D] against values [B, n_kv, L, D] (kmask [B, L]): the simulated path's arithmetic (two batched
    matmuls in the values' dtype, softmax in float32), [B, H * D]."""
    B, H, D = q.shape
    n_kv = ck.shape[1]
    qg = q.to(ck.dtype).view(B, n_kv, H // n_kv, D)
    scores = torch.matmul(qg, ck.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~kmask[:, None, None, :], float("-inf"))
    p = torch.softmax(scores, dim=-1).to(cv.dtype)
    return torch.matmul(p, cv).reshape(B, H * D)


def _workspace(cache: PackedKVCache):
    """The rotated int4 attention's split buffers of this cache, shared by its layers (they run one after another)."""
    ws = getattr(cache, "_int4_workspace", None)
    if ws is None:
        from parity.rollout.int4_attention import Workspace
        ws = cache._int4_workspace = Workspace()
    return ws


def timed_tiles() -> bool:
    """Whether the autotuner picks the launch configuration (PARITY_KV_ATTENTION_TILE=timed) instead of ATTN_CONFIG
    (pinned, the default)."""
    v = os.environ.get("PARITY_KV_ATTENTION_TILE", "pinned")
    if v not in ("pinned", "timed"):
        raise ValueError(f"PARITY_KV_ATTENTION_TILE={v!r}: expected 'pinned' (the default) or 'timed'")
    return v == "timed"


def plain_kernel() -> bool:
    """Whether a plain (or simulated) cache's decode attention on CUDA is the flash-decoding kernel over the raw
    values (PARITY_PLAIN_ATTENTION=kernel: one or two launches a layer, scores kept in float32, nothing compiled per
    attended length) instead of the batched matmuls of _decode_attention (torch, the default)."""
    v = os.environ.get("PARITY_PLAIN_ATTENTION", "torch")
    if v not in ("torch", "kernel"):
        raise ValueError(f"PARITY_PLAIN_ATTENTION={v!r}: expected 'torch' (the default) or 'kernel'")
    return v == "kernel"


def pinned_config(dtype: torch.dtype) -> dict:
    """The launch configuration of the dequantizing kernel for queries and cache of `dtype`."""
    return {**ATTN_CONFIG, "num_warps": ATTN_WARPS_FP32} if dtype == torch.float32 else dict(ATTN_CONFIG)


def tuned_configs() -> dict[str, str]:
    """The launch configurations (BLOCK_N, warps, stages) the autotuner chose for this module's attention kernel so
    far in this process, by its key (format, rotation, head_dim, group rows, one split, dot precision): the
    variant a run's rollout used, for its record. Empty without Triton or before the first CUDA call."""
    cache = getattr(globals().get("_attn_tuned"), "cache", None) or {}
    return {str(k): str(v) for k, v in cache.items()}


def int4_rotated(cache: PackedKVCache) -> bool:
    """Whether this cache's attention is parity.rollout.int4_attention's (rotated basis, Triton backend)."""
    return (INT4_ROTATED and cache.backend == "triton" and cache.kind_id == KIND_INT4 and cache.head_dim >= 64)


def kv_kernel_meta(packed: PackedKVCache | None, fused_pre: bool, plain_cache: torch.Tensor | None = None) -> dict:
    """A decode call's record of its attention kernel for a packed cache (rotated int4 or the dequantizing kernel
    with its pinned launch configuration, or the configurations the autotuner chose when timed) and whether the fused
    pre-attention kernel (`fused_pre`, cuda_decode._FUSED_PRE, where usable) feeds it. For a plain or simulated
    cache (`plain_cache`, one of its tensors): nothing where the batched matmuls attend, the kernel's launch where
    plain_kernel() has this module's kernel read the raw values on CUDA."""
    if packed is None:
        if plain_cache is None or not plain_cache.is_cuda or not plain_kernel():
            return {}
        return {"kv_kernel": {"name": "plain_raw", **_launch_record(plain_cache.dtype)}}
    from parity.rollout import pre_attention

    rotated = int4_rotated(packed)
    kernel = {"name": "int4_rotated" if rotated else "packed_dequant",
              "fused_pre_attention": bool(fused_pre and pre_attention.usable(packed))}
    if rotated:
        from parity.rollout.int4_attention import CONFIG
        kernel["config"] = dict(CONFIG)
    elif packed.backend == "triton":
        kernel.update(_launch_record(packed.dtype))
    return {"kv_kernel": kernel}


def _launch_record(dtype: torch.dtype) -> dict:
    """What _launch runs on CUDA, for a call's record: the autotuner's picks when timed, else the pinned launch."""
    return {"tuned": tuned_configs()} if timed_tiles() else {"config": pinned_config(dtype)}


def packed_decode_attention(q: torch.Tensor, cache: PackedKVCache, layer: PackedLayer, key_ok: torch.Tensor,
                            slot: torch.Tensor, L: int, scale: float, queries=None) -> torch.Tensor:
    """Attention of q [B, H, D] over slots [0, L) of one layer of the packed cache: [B, H * D] in q's dtype.
    key_ok [B, S] bool; slot long [1] (the step's slot: later slots are not seen). For the rotated int4 route,
    `queries` (int4_attention.Queries of q, from the fused pre-attention kernel) saves the query launch; q may
    then be None."""
    if int4_rotated(cache):
        from parity.rollout import int4_attention as ia
        qs = queries if queries is not None else ia.prepare_queries(q, cache.hadamard)
        return ia.int4_attention(qs, layer.k, layer.v, layer.k_scale, layer.v_scale, key_ok, slot, L, scale,
                                 cache.hadamard, cache.dtype, _workspace(cache))
    B, H, D = q.shape
    if cache.backend == "torch":
        ck, cv = cache.values(layer, L)
        kmask = (torch.arange(L, device=q.device)[None, :] <= slot) & key_ok[:, :L]
        return torch_decode_attention(q, ck, cv, kmask, scale).to(q.dtype)
    ks = layer.k if layer.k_scale is None else layer.k_scale
    vs = layer.v if layer.v_scale is None else layer.v_scale
    return _launch(q, layer.k, layer.v, ks, vs, key_ok, slot, L, scale, cache.kind_id, cache.hadamard,
                   cache.fp8_scale, cache.h_even, cache.h_odd, cache.signs_over_d)


def raw_decode_attention(q: torch.Tensor, ck: torch.Tensor, cv: torch.Tensor, key_ok: torch.Tensor,
                         slot: torch.Tensor, L: int, scale: float) -> torch.Tensor:
    """The same kernel over a plain bf16 / fp32 cache [B, n_kv, S, D] (no dequantization): for A/B runs and
    tests of the kernel's attention alone."""
    dummy = torch.zeros(1, dtype=torch.int8, device=q.device)
    return _launch(q, ck, cv, ck, cv, key_ok, slot, L, scale, KIND_RAW, False, 1.0, dummy, dummy,
                   torch.zeros(1, device=q.device))


def _launch(q, kc, vc, ks, vs, key_ok, slot, L: int, scale: float, kind: int, hadamard: bool, fp8_scale: float,
            he, ho, sg) -> torch.Tensor:
    B, H, D = q.shape
    n_kv, S = kc.shape[1], kc.shape[2]
    G = H // n_kv
    q = q.contiguous()
    out = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    splits, per = split_plan(B, n_kv, L, q.device)
    if splits > 1:
        m = torch.empty(B, H, splits, dtype=torch.float32, device=q.device)
        lsum = torch.empty_like(m)
        acc = torch.empty(B, H, splits, D, dtype=torch.float32, device=q.device)
    else:
        m = lsum = acc = out
    ok = key_ok.view(torch.uint8) if key_ok.dtype == torch.bool else key_ok
    # ATTN_CONFIG; timed (on CUDA), the autotuner times the candidates per format the first time (outside any graph
    # capture: the decode path's first step of each length runs for real before its capture)
    kernel, cfg = (_attn_tuned, {}) if q.is_cuda and timed_tiles() else (_attn_kernel, pinned_config(q.dtype))
    warps = cfg.pop("warp_slots", 0)
    if warps and kind != KIND_INT4 and q.dtype != torch.float32:  # the warp-split form
        from parity.rollout.decode_attention_warps import _attn_warps_kernel
        _attn_warps_kernel[(B * n_kv, splits)](
            q, kc, vc, ks, vs, ok, slot, out, m, lsum, acc, fp8_scale, scale * math.log2(math.e), L, S, n_kv, H,
            per * BLOCK_N, splits, ok.stride(0), G=G, BLOCK_G=max(16, triton.next_power_of_2(G)),
            W=cfg["num_warps"], SLOTS=warps, D=D, KIND=kind, ONE_SPLIT=splits == 1, num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"])
    else:
        kernel[(B * n_kv, splits)](
            q, kc, vc, ks, vs, ok, slot, out, m, lsum, acc, he, ho, sg, fp8_scale, scale * math.log2(math.e),
            L, S, n_kv, H, per * BLOCK_N, splits, ok.stride(0),
            G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), D=D, KIND=kind, HADAMARD=hadamard,
            DC=kc.shape[-1], TMODE=transform_mode(D), ONE_SPLIT=splits == 1,
            DOT_PREC="ieee" if q.dtype == torch.float32 else None, **cfg)
    if splits > 1:
        _reduce_kernel[(B * H,)](m, lsum, acc, out, splits, D=D, BLOCK_S=triton.next_power_of_2(splits),
                                 num_warps=4)
    return out.view(B, H * D)


if triton is not None:
    @triton.jit
    def _attn_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, ok_ptr, slot_ptr, o_ptr, m_ptr, l_ptr, acc_ptr,
                     he_ptr, ho_ptr, sg_ptr, fp8_scale, qk_scale, L, S, n_kv, H, split_slots, n_split, ok_stride,
                     G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                     KIND: tl.constexpr, HADAMARD: tl.constexpr, DC: tl.constexpr, TMODE: tl.constexpr,
                     ONE_SPLIT: tl.constexpr, DOT_PREC: tl.constexpr):
        bh = tl.program_id(0)
        sp = tl.program_id(1)
        b = bh // n_kv
        kvh = bh % n_kv
        g = tl.arange(0, BLOCK_G)
        g_ok = g < G
        head = (b * H + kvh * G + g).to(tl.int64)  # [BLOCK_G] rows of q / out, as b * H + h
        col0, col1 = _kv_cols(KIND, HADAMARD, D)
        OUT = q_ptr.dtype.element_ty
        q0 = tl.load(q_ptr + head[:, None] * D + col0[None, :], mask=g_ok[:, None], other=0.0)
        q1 = tl.load(q_ptr + head[:, None] * D + col1[None, :], mask=g_ok[:, None], other=0.0)
        he, ho, sg0, sg1 = _kv_consts(he_ptr, ho_ptr, sg_ptr, KIND, HADAMARD, D)
        kc = kc_ptr + bh.to(tl.int64) * S * DC
        vc = vc_ptr + bh.to(tl.int64) * S * DC
        ks = ks_ptr + bh.to(tl.int64) * S
        vs = vs_ptr + bh.to(tl.int64) * S
        slot = tl.load(slot_ptr)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc0 = tl.zeros([BLOCK_G, D // 2], tl.float32)
        acc1 = tl.zeros([BLOCK_G, D // 2], tl.float32)
        lo = sp * split_slots
        hi = tl.minimum(lo + split_slots, L)
        for start in range(lo, hi, BLOCK_N):
            offs = start + tl.arange(0, BLOCK_N)
            in_l = offs < hi
            seen = tl.load(ok_ptr + b.to(tl.int64) * ok_stride + offs, mask=in_l, other=0) != 0
            seen = seen & in_l & (offs <= slot)
            k0, k1 = _kv_tile(kc, ks, offs, in_l, he, ho, sg0, sg1, fp8_scale, KIND, HADAMARD, D, OUT, TMODE)
            s = tl.dot(q0, tl.trans(k0), input_precision=DOT_PREC)
            s = tl.dot(q1, tl.trans(k1), s, input_precision=DOT_PREC)
            s = tl.where(seen[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet: no NaN
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v0, v1 = _kv_tile(vc, vs, offs, in_l, he, ho, sg0, sg1, fp8_scale, KIND, HADAMARD, D, OUT, TMODE)
            pv = p.to(OUT)
            acc0 = tl.dot(pv, v0, acc0 * alpha[:, None], input_precision=DOT_PREC)
            acc1 = tl.dot(pv, v1, acc1 * alpha[:, None], input_precision=DOT_PREC)
            m_i = m_new
        if ONE_SPLIT:
            inv = 1.0 / l_i
            out = o_ptr + head[:, None] * D
            tl.store(out + col0[None, :], (acc0 * inv[:, None]).to(OUT), mask=g_ok[:, None])
            tl.store(out + col1[None, :], (acc1 * inv[:, None]).to(OUT), mask=g_ok[:, None])
        else:
            part = head * n_split + sp
            tl.store(m_ptr + part, m_i, mask=g_ok)
            tl.store(l_ptr + part, l_i, mask=g_ok)
            pa = acc_ptr + part[:, None] * D
            tl.store(pa + col0[None, :], acc0, mask=g_ok[:, None])
            tl.store(pa + col1[None, :], acc1, mask=g_ok[:, None])

    _attn_tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st)
                 for n, w, st in ((64, 4, 2), (64, 8, 2), (32, 4, 2), (32, 8, 2))],
        key=["KIND", "HADAMARD", "D", "BLOCK_G", "ONE_SPLIT", "DOT_PREC"])(_attn_kernel)

    @triton.jit
    def _reduce_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, n_split, D: tl.constexpr, BLOCK_S: tl.constexpr):
        """Combine the splits of one (row, query head): out = sum_i 2^(m_i - M) acc_i / sum_i 2^(m_i - M) l_i."""
        row = tl.program_id(0).to(tl.int64)
        sp = tl.arange(0, BLOCK_S)
        ok = sp < n_split
        m = tl.load(m_ptr + row * n_split + sp, mask=ok, other=float("-inf"))
        lsum = tl.load(l_ptr + row * n_split + sp, mask=ok, other=0.0)
        top = tl.max(m, 0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - top))
        d = tl.arange(0, D)
        acc = tl.load(acc_ptr + (row * n_split + sp)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.sum(lsum * w, 0)
        tl.store(o_ptr + row * D + d, out.to(o_ptr.dtype.element_ty))


def self_check(codec, dtype: torch.dtype, device: torch.device) -> str | None:
    """None when, on random K/V, the packed cache's write and dequantization give the codec's codes and values
    bit for bit and the attention kernel the torch reference's output to rounding; else what differed."""
    g = torch.Generator(device="cpu").manual_seed(0)
    B, n_kv, H, S, D = 3, 2, 6, 200, codec.head_dim
    cache = PackedKVCache(codec, 1, B, n_kv, S, dtype, device, backend="triton")
    layer = cache.layers[0]
    k = (torch.randn(B, n_kv, S, D, generator=g) * 2).to(dtype).to(device)
    v = torch.randn(B, n_kv, S, D, generator=g).to(dtype).to(device)
    cache.write(layer, k, v, torch.zeros(1, dtype=torch.long, device=device))
    ref = codec.pack(k)
    got = cache.state(layer, "k", 0, S)
    if not torch.equal(got.codes.view(torch.uint8), ref.codes.view(torch.uint8)):
        return f"{codec.kind}: codes differ from the codec's ({int((got.codes.view(torch.uint8) != ref.codes.view(torch.uint8)).sum())})"
    if ref.scale is not None and not torch.equal(got.scale, ref.scale):
        return f"{codec.kind}: {int((got.scale != ref.scale).sum())} of {ref.scale.numel()} scales differ"
    if ref.zero is not None and not torch.equal(got.zero, ref.zero):
        return f"{codec.kind}: {int((got.zero != ref.zero).sum())} of {ref.zero.numel()} zero points differ"
    kh, vh = cache.values(layer, S)
    for got_v, want_v in ((kh, codec.roundtrip(k)), (vh, codec.roundtrip(v))):
        if not torch.equal(got_v, want_v):
            return (f"{codec.kind}: {int((got_v != want_v).sum())} of {want_v.numel()} dequantized values differ "
                    f"from the codec's roundtrip (max abs {float((got_v.float() - want_v.float()).abs().max()):.3g})")
    q = torch.randn(B, H, D, generator=g).to(dtype).to(device)
    key_ok = torch.ones(B, S, dtype=torch.bool, device=device)
    key_ok[0, :7] = False
    slot = torch.tensor([S - 9], device=device)
    L = S - 8
    out = packed_decode_attention(q, cache, layer, key_ok, slot, L, D ** -0.5)
    kmask = (torch.arange(L, device=device)[None, :] <= slot) & key_ok[:, :L]
    want = torch_decode_attention(q.double(), kh[:, :, :L].double(), vh[:, :, :L].double(), kmask, D ** -0.5)
    err = float((out.double() - want).norm() / want.norm())
    if not err < 2e-2:
        return f"{codec.kind}: attention differs from float64 by {err:.3g} (relative norm)"
    return None


@functools.cache
def usable(device_index: int, kind: str, hadamard: bool, head_dim: int, dtype: torch.dtype) -> bool:
    """True when the packed cache's kernels run on this CUDA device and pass `self_check` for this format;
    otherwise False with the reason in `unusable_reason` (the decode path then keeps the simulated cache).
    PARITY_KV_PACKED=0 turns the packed cache off."""
    global unusable_reason
    if (triton is None or not torch.cuda.is_available() or os.environ.get("PARITY_KV_PACKED", "1") == "0"
            or not kernel_shape_ok(head_dim)):
        unusable_reason = (f"no Triton, no CUDA, PARITY_KV_PACKED=0, or head_dim {head_dim} not a power of two "
                           f"in 32..256")
        return False
    try:
        reason = self_check(make_kv_codec(kind, head_dim, hadamard=hadamard), dtype,
                            torch.device("cuda", device_index))
    except Exception as e:  # noqa: BLE001 - a compile or launch failure: the simulated cache serves instead
        reason = f"{type(e).__name__}: {e}"[:400]
    unusable_reason = reason
    return reason is None
