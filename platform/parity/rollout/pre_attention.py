"""The decode step's work between the q/k/v projection and the attention, as one Triton kernel for a packed cache.

Per row of the batch, from the raw projections q, k, v [B, heads * D]:
- q and k: the per-head RMS norm (HF Qwen3RMSNorm's arithmetic: float32 normalisation, cast to the model dtype,
  times the weight in that dtype), then the rotary embedding at the row's position (computed in float32 from the
  rounded normed values, rounded once, as Inductor's fused kernel does; with `eager_rounding`, as the eager
  functions do: x cos, rotate_half(x) sin and their sum each rounded to the model dtype, for a step whose layer
  functions are not compiled, so that K reaches the codec as it does beside a simulated cache);
- k and v: the codec's quantization and the write into the packed cache at the step's slot (kv_packed's
  `_encode_store`: the same operations as the write kernel, so the codes are the codec's of these k, v);
- q: for the rotated int4 attention, its Queries (the rotation H (d q), the 15-bit integer parts and the factors,
  int4_attention's `_store_query`); otherwise q itself, for the attention kernel of the other formats.

One launch replaces the compiled norm/rotary kernel(s), the write kernel and the query launch of the unfused
step (grid: rows x {q, k, v}). parity.rollout.cuda_decode uses it when the cache is packed (`_FUSED_PRE`).
Numerics: tests/test_pre_attention_interpret.py (CPU, Triton's interpreter) against the step's torch functions.
"""

from __future__ import annotations

import torch

from parity.precision.kv import _INV_15, _INV_127, _INV_FP8_MAX, _MIN_SCALE
from parity.precision.kv_packed import PackedKVCache, PackedLayer

try:
    import triton
    import triton.language as tl

    from parity.precision.kv_packed import _encode_store
    from parity.rollout.int4_attention import _store_query
except ImportError:  # CPU installs
    triton = None


def fused_pre_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor,
                        k_norm: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                        cache: PackedKVCache, layer: PackedLayer, slot: torch.Tensor, rotated_queries: bool,
                        eager_rounding: bool = False):
    """q [B, H * D], k, v [B, n_kv * D] (row stride free, unit column stride) -> writes k, v into `layer` at
    `slot` and returns the attention's query side: int4_attention.Queries when `rotated_queries` (the int4 route),
    else the normed, rotated q [B, H, D] in q's dtype. cos / sin [max_pos, D] tables, pos long [B] positions.
    `eager_rounding`: the rotary rounded as the eager functions round it (three roundings), else once."""
    B = q.shape[0]
    D, n_kv = cache.head_dim, cache.n_kv
    H = q.shape[1] // D
    dev = q.device
    pdl = False
    if rotated_queries:
        from parity.rollout.int4_attention import CONFIG, Queries, constants, hadamard_matrix
        pdl = bool(CONFIG.get("pdl")) and dev.type == "cuda"
        out = Queries(torch.empty(B, H, D, dtype=torch.float32, device=dev),
                      torch.empty(B, H, 4, D // 2, dtype=torch.int8, device=dev),
                      torch.empty(B, H, 4, dtype=torch.float32, device=dev))
        qsg, _, _ = constants(D, dev)
        hm = hadamard_matrix(D, torch.float32 if q.dtype == torch.float32 else torch.bfloat16, dev)
        qf, qi, qc, qo = out.rotated, out.codes, out.factors, out.rotated
    else:
        out = torch.empty(B, H, D, dtype=q.dtype, device=dev)
        qf = qi = qc = qsg = hm = None
        qo = out
    dummy = out if not rotated_queries else out.rotated
    ks = layer.k if layer.k_scale is None else layer.k_scale
    vs = layer.v if layer.v_scale is None else layer.v_scale
    _pre_attention_kernel[(B, 3)](
        q, k, v, q.stride(0), k.stride(0), v.stride(0), q_norm, k_norm, float(eps), cos, sin, pos,
        layer.k, layer.v, ks, vs, slot, cache.signs, qf if qf is not None else dummy,
        qi if qi is not None else dummy, qc if qc is not None else dummy,
        qsg if qsg is not None else cache.signs, hm if hm is not None else dummy, qo,
        cache.slots, n_kv, H, cache.fp8_inv_scale, _MIN_SCALE, _INV_127, _INV_15, _INV_FP8_MAX,
        D=D, HB=max(16, triton.next_power_of_2(H)), KB=max(2, triton.next_power_of_2(n_kv)), KIND=cache.kind_id,
        HADAMARD=cache.hadamard, QMODE=1 if rotated_queries else 0, LOG2D=D.bit_length() - 1, EAGER=eager_rounding,
        PDL=pdl, enable_fp_fusion=False, num_warps=4)
    return out


def fused_norm_rope(q: torch.Tensor, k: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, eps: float,
                    cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, n_kv: int, D: int,
                    eager_rounding: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The same kernel's q/k norms and rotary without a packed cache: (q [B, H, D], k [B, n_kv, D]) in q's dtype,
    for a simulated cache's step on the fused route (the codec's round trip and the write follow in torch), so that
    its K reaches the codec as the packed route's does (cuda_decode._FUSED_PRE; parity.rollout.fused_step)."""
    B, H = q.shape[0], q.shape[1] // D
    qo = torch.empty(B, H, D, dtype=q.dtype, device=q.device)
    ko = torch.empty(B, n_kv, D, dtype=k.dtype, device=k.device)
    _norm_rope_kernel[(B, 2)](q, k, q.stride(0), k.stride(0), q_norm, k_norm, float(eps), cos, sin, pos, qo, ko, H,
                              n_kv, D=D, HB=max(16, triton.next_power_of_2(H)),
                              KB=max(2, triton.next_power_of_2(n_kv)), EAGER=eager_rounding,
                              enable_fp_fusion=False, num_warps=4)
    return qo, ko


def usable(cache: PackedKVCache) -> bool:
    """The fused kernel serves Triton-backed packed caches (the int4 route or not)."""
    return triton is not None and cache.backend == "triton"


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents

    @triton.jit
    def _norm_rope(x, w_ptr, eps, cos_ptr, sin_ptr, pos, D: tl.constexpr, EAGER: tl.constexpr):
        """x [M, D] -> RMS-normed (HF arithmetic), then rotary at position pos, rounded once to x's dtype (EAGER: each
        product and the sum rounded to x's dtype, as decode_layers._rope computes it eagerly)."""
        d = tl.arange(0, D)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, 1) * (1.0 / D)
        xn = (xf * tl.math.rsqrt(var + eps)[:, None]).to(x.dtype)
        # weight x normed, rounded to the model dtype as HF's product in that dtype (exact in float32 first)
        y = (tl.load(w_ptr + d).to(tl.float32)[None, :] * xn.to(tl.float32)).to(x.dtype).to(tl.float32)
        c = tl.load(cos_ptr + pos * D + d).to(tl.float32)
        s = tl.load(sin_ptr + pos * D + d).to(tl.float32)
        # rotate_half: [-y2, y1] for halves y1, y2
        partner = tl.gather(y, tl.broadcast_to((d ^ (D // 2))[None, :], y.shape), 1)
        rot = tl.where((d < D // 2)[None, :], -partner, partner)
        if EAGER:
            a = (y * c[None, :]).to(x.dtype).to(tl.float32)
            r = (rot * s[None, :]).to(x.dtype).to(tl.float32)
            return (a + r).to(x.dtype)
        else:
            return (y * c[None, :] + rot * s[None, :]).to(x.dtype)

    @triton.jit
    def _pre_attention_kernel(q_ptr, k_ptr, v_ptr, q_rs, k_rs, v_rs, qn_ptr, kn_ptr, eps, cos_ptr, sin_ptr,
                              pos_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr, sgn_ptr, qf_ptr, qi_ptr, qc_ptr,
                              qsg_ptr, hm_ptr, qo_ptr, S, n_kv, H, fp8_inv, min_scale, inv127, inv15, inv448,
                              D: tl.constexpr, HB: tl.constexpr, KB: tl.constexpr, KIND: tl.constexpr,
                              HADAMARD: tl.constexpr, QMODE: tl.constexpr, LOG2D: tl.constexpr,
                              EAGER: tl.constexpr, PDL: tl.constexpr = False):
        """Grid (B, 3): program (b, 0) the query heads of row b, (b, 1) its keys, (b, 2) its values. PDL: the next
        kernel, if launched as a programmatic dependent (the INT4 attention, its "pdl"), may launch as this starts."""
        if PDL:
            gdc_launch_dependents()
        b = tl.program_id(0)
        part = tl.program_id(1)
        pos = tl.load(pos_ptr + b)
        if part == 0:
            _pre_query(q_ptr, q_rs, qn_ptr, eps, cos_ptr, sin_ptr, pos, b, qf_ptr, qi_ptr, qc_ptr, qsg_ptr, hm_ptr,
                       qo_ptr, H, D, HB, HADAMARD, QMODE, EAGER)
        else:
            _pre_kv(k_ptr, v_ptr, k_rs, v_rs, kn_ptr, eps, cos_ptr, sin_ptr, pos, b, part, kc_ptr, vc_ptr, ks_ptr,
                    vs_ptr, slot_ptr, sgn_ptr, S, n_kv, fp8_inv, min_scale, inv127, inv15, inv448, D, KB, KIND,
                    HADAMARD, LOG2D, EAGER)

    @triton.jit
    def _norm_rope_kernel(q_ptr, k_ptr, q_rs, k_rs, qn_ptr, kn_ptr, eps, cos_ptr, sin_ptr, pos_ptr, qo_ptr, ko_ptr, H,
                          n_kv, D: tl.constexpr, HB: tl.constexpr, KB: tl.constexpr, EAGER: tl.constexpr):
        """Grid (B, 2): program (b, 0) the query heads of row b, (b, 1) its key heads, normed and rotated."""
        b = tl.program_id(0)
        pos = tl.load(pos_ptr + b)
        d = tl.arange(0, D)
        if tl.program_id(1) == 0:  # (each branch its own names: Triton types a name alike in both)
            hq = tl.arange(0, HB)
            xq = tl.load(q_ptr + b.to(tl.int64) * q_rs + hq[:, None] * D + d[None, :], mask=(hq < H)[:, None],
                         other=0.0)
            yq = _norm_rope(xq, qn_ptr, eps, cos_ptr, sin_ptr, pos, D, EAGER)
            tl.store(qo_ptr + (b * H + hq).to(tl.int64)[:, None] * D + d[None, :], yq, mask=(hq < H)[:, None])
        else:
            hk = tl.arange(0, KB)
            xk = tl.load(k_ptr + b.to(tl.int64) * k_rs + hk[:, None] * D + d[None, :], mask=(hk < n_kv)[:, None],
                         other=0.0)
            yk = _norm_rope(xk, kn_ptr, eps, cos_ptr, sin_ptr, pos, D, EAGER)
            tl.store(ko_ptr + (b * n_kv + hk).to(tl.int64)[:, None] * D + d[None, :], yk, mask=(hk < n_kv)[:, None])

    @triton.jit
    def _pre_query(q_ptr, q_rs, qn_ptr, eps, cos_ptr, sin_ptr, pos, b, qf_ptr, qi_ptr, qc_ptr, qsg_ptr, hm_ptr,
                   qo_ptr, H, D: tl.constexpr, HB: tl.constexpr, HADAMARD: tl.constexpr, QMODE: tl.constexpr,
                   EAGER: tl.constexpr):
        d = tl.arange(0, D)
        h = tl.arange(0, HB)
        ok = h < H
        x = tl.load(q_ptr + b.to(tl.int64) * q_rs + h[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        y = _norm_rope(x, qn_ptr, eps, cos_ptr, sin_ptr, pos, D, EAGER)
        r = b * H + h
        if QMODE == 1:
            _store_query(y, r, ok, qf_ptr, qi_ptr, qc_ptr, qsg_ptr, hm_ptr, D, HADAMARD)
        else:
            tl.store(qo_ptr + r.to(tl.int64)[:, None] * D + d[None, :], y, mask=ok[:, None])

    @triton.jit
    def _pre_kv(k_ptr, v_ptr, k_rs, v_rs, kn_ptr, eps, cos_ptr, sin_ptr, pos, b, part, kc_ptr, vc_ptr, ks_ptr,
                vs_ptr, slot_ptr, sgn_ptr, S, n_kv, fp8_inv, min_scale, inv127, inv15, inv448, D: tl.constexpr,
                KB: tl.constexpr, KIND: tl.constexpr, HADAMARD: tl.constexpr, LOG2D: tl.constexpr,
                EAGER: tl.constexpr):
        d = tl.arange(0, D)
        h = tl.arange(0, KB)
        ok = h < n_kv
        slot = tl.load(slot_ptr)
        dst = (b * n_kv + h).to(tl.int64) * S + slot
        if part == 1:
            x = tl.load(k_ptr + b.to(tl.int64) * k_rs + h[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
            y = _norm_rope(x, kn_ptr, eps, cos_ptr, sin_ptr, pos, D, EAGER)
            _encode_store(y, ok, dst, kc_ptr, ks_ptr, sgn_ptr, fp8_inv, min_scale, inv127, inv15, inv448, KIND,
                          HADAMARD, D, KB, LOG2D)
        else:
            x = tl.load(v_ptr + b.to(tl.int64) * v_rs + h[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
            _encode_store(x, ok, dst, vc_ptr, vs_ptr, sgn_ptr, fp8_inv, min_scale, inv127, inv15, inv448, KIND,
                          HADAMARD, D, KB, LOG2D)

