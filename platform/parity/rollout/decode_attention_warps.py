"""The dequantizing decode attention (parity.rollout.decode_attention) in a warp-split form, for the caches whose
tiles dequantize element by element: the raw bf16 / fp16 cache (the plain caches' kernel route), INT8, FP8 and FP8
per token-head. Off by default (decode_attention.ATTN_CONFIG's "warp_slots": 0).

The other form's program spreads each tile's slots over its warps, so every iteration's row maximum and sum of the
scores cross warps (shared memory and barriers). Here each of the W warps takes its own consecutive slots of every
iteration (warp w: start + w * SLOTS + [0, SLOTS)) and keeps its own running softmax, as batched products
[warps, heads, slots]; the warps' partial softmaxes are merged once, after the loop. The tiles are dequantized as
kv_packed's loader does (the same values bit for bit), the query heads of a KV head are the products' rows (padded
to 16, as in the other form), and a program's end is the other form's (its output, or its split's partial for
decode_attention's reduce kernel). The same arithmetic as the other form up to the summation order of the softmax.
The rotated int4 attention has its own warp-split form (parity.rollout.int4_attention_warps); the dequantizing int4
tile (a Hadamard product per tile) stays with the other form.

Tests: tests/test_kv_packed_interpret.py (Triton's interpreter, against the torch reference) and
tests/test_kv_packed_cuda.py.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs
    triton = None

if triton is not None:
    @triton.jit
    def _tile(c_ptr, s_ptr, sl, ok, fp8_scale, KIND: tl.constexpr, D: tl.constexpr, OUT: tl.constexpr):
        """Slots sl [W, N] of one (row, KV head) of the cache dequantized to OUT: head columns [0, D/2) and
        [D/2, D), [W, N, D/2] each; kv_packed's `_kv_tile` for the kinds it serves here."""
        rows = sl.to(tl.int64)
        j = tl.arange(0, D // 2)
        base = c_ptr + rows[:, :, None] * D + j[None, None, :]
        c0 = tl.load(base, mask=ok[:, :, None], other=0.0)  # (an int `other` cannot be cast to fp8)
        c1 = tl.load(base + D // 2, mask=ok[:, :, None], other=0.0)
        if KIND == 1 or KIND == 3:
            s = tl.load(s_ptr + rows, mask=ok, other=0.0)[:, :, None]
            return (c0.to(tl.float32) * s).to(OUT), (c1.to(tl.float32) * s).to(OUT)
        elif KIND == 2:
            return (c0.to(tl.float32) * fp8_scale).to(OUT), (c1.to(tl.float32) * fp8_scale).to(OUT)
        else:
            return c0.to(OUT), c1.to(OUT)

    @triton.jit
    def _attn_warps_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, ok_ptr, slot_ptr, o_ptr, m_ptr, l_ptr, acc_ptr,
                           fp8_scale, qk_scale, L, S, n_kv, H, split_slots, n_split, ok_stride,
                           G: tl.constexpr, BLOCK_G: tl.constexpr, W: tl.constexpr, SLOTS: tl.constexpr,
                           D: tl.constexpr, KIND: tl.constexpr, ONE_SPLIT: tl.constexpr):
        """Program (row, KV head) x split, as decode_attention's kernel; rows of the products: the KV head's query
        heads (g < G real); first dimension: the warp."""
        DH: tl.constexpr = D // 2
        bh = tl.program_id(0)
        sp = tl.program_id(1)
        b = bh // n_kv
        kvh = bh % n_kv
        g = tl.arange(0, BLOCK_G)
        g_ok = g < G
        head = (b * H + kvh * G + g).to(tl.int64)  # [BLOCK_G] rows of q / out, as b * H + h
        j = tl.arange(0, DH)
        OUT = q_ptr.dtype.element_ty
        q0 = tl.load(q_ptr + head[:, None] * D + j[None, :], mask=g_ok[:, None], other=0.0)
        q1 = tl.load(q_ptr + head[:, None] * D + DH + j[None, :], mask=g_ok[:, None], other=0.0)
        q0 = tl.broadcast_to(q0[None, :, :], (W, BLOCK_G, DH))
        q1 = tl.broadcast_to(q1[None, :, :], (W, BLOCK_G, DH))
        kc = kc_ptr + bh.to(tl.int64) * S * D
        vc = vc_ptr + bh.to(tl.int64) * S * D
        ks = ks_ptr + bh.to(tl.int64) * S
        vs = vs_ptr + bh.to(tl.int64) * S
        okp = ok_ptr + b.to(tl.int64) * ok_stride
        slot = tl.load(slot_ptr)
        w = tl.arange(0, W)
        n = tl.arange(0, SLOTS)
        m_i = tl.full([W, BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([W, BLOCK_G], tl.float32)
        acc0 = tl.zeros([W, BLOCK_G, DH], tl.float32)
        acc1 = tl.zeros([W, BLOCK_G, DH], tl.float32)
        lo = sp * split_slots
        hi = tl.minimum(lo + split_slots, L)
        for start in range(lo, hi, W * SLOTS):
            sl = start + w[:, None] * SLOTS + n[None, :]  # [W, SLOTS]
            in_l = sl < hi
            seen = (tl.load(okp + sl, mask=in_l, other=0) != 0) & in_l & (sl <= slot)
            k0, k1 = _tile(kc, ks, sl, in_l, fp8_scale, KIND, D, OUT)
            s = tl.dot(q0, tl.permute(k0, (0, 2, 1)))
            s = tl.dot(q1, tl.permute(k1, (0, 2, 1)), s)
            s = tl.where(seen[:, None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 2))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet: no NaN
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, :, None])
            l_i = l_i * alpha + tl.sum(p, 2)
            v0, v1 = _tile(vc, vs, sl, in_l, fp8_scale, KIND, D, OUT)
            pv = p.to(OUT)
            acc0 = tl.dot(pv, v0, acc0 * alpha[:, :, None])
            acc1 = tl.dot(pv, v1, acc1 * alpha[:, :, None])
            m_i = m_new
        # merge the warps' partial softmaxes
        m_h = tl.max(m_i, 0)
        top = tl.where(m_h == float("-inf"), 0.0, m_h)
        wr = tl.where(m_i == float("-inf"), 0.0, tl.exp2(m_i - top[None, :]))
        l_h = tl.sum(l_i * wr, 0)
        a0 = tl.sum(acc0 * wr[:, :, None], 0)
        a1 = tl.sum(acc1 * wr[:, :, None], 0)
        if ONE_SPLIT:
            inv = 1.0 / tl.where(g_ok, l_h, 1.0)  # rows past the heads: not written
            out = o_ptr + head[:, None] * D
            tl.store(out + j[None, :], (a0 * inv[:, None]).to(OUT), mask=g_ok[:, None])
            tl.store(out + DH + j[None, :], (a1 * inv[:, None]).to(OUT), mask=g_ok[:, None])
        else:
            part = head * n_split + sp
            tl.store(m_ptr + part, m_h, mask=g_ok)
            tl.store(l_ptr + part, l_h, mask=g_ok)
            pa = acc_ptr + part[:, None] * D
            tl.store(pa + j[None, :], a0, mask=g_ok[:, None])
            tl.store(pa + DH + j[None, :], a1, mask=g_ok[:, None])
