"""The rotated int4 decode attention in its warp-split form: the same arithmetic as parity.rollout.int4_attention's
tensor-core route (the same query codes, the same exact integer K product, the same fp16 V weights and byte
unpacking, the same split merge), with the work laid out so that no warp needs another's results inside the slot
loop. Its output rotation is the other form's products with H_{D/2} over 16 rows, or with FWHT (CONFIG's "fwht")
float32 butterflies (int4_attention_parts._fwht) on the heads' rows only, picked out of the score rows once
(`_head_rows`) before the warps' merge.

Each program takes one (row, KV head) and a split of the slots, as the other form does. Its W warps each take their
own consecutive slots of every iteration (warp w: start + w * SLOTS + [0, SLOTS)) and keep their own running
softmax (max, sum, weighted sums) for the query heads of the KV head, as batched products [W, heads, slots]: the K
product is the query rows (heads, padded to 16) against the warp's codes, the V product the warp's weights against
its codes, both inside the warp. The V weights are rounded to fp16 relative to the warp's largest scale instead of
the tile's. The W partial softmaxes are merged once, after the loop, and that program's result goes on as the other
form's: the output, or a partial for the split merge.

The other form packs (slot sub-range, head) pairs into the 16 rows of its products so that no row is padding when a
KV head has 2 query heads, at the price of moving scores and weights between warps every iteration (9 barriers an
iteration in the sm_90a SASS); here the score rows past the heads are padding, computed and dropped (6 of 8 at
G = 2 with the query's parts merged, 14 of 16 without), and the loop needs no exchange between warps (3 barriers an
iteration, the software pipeline's). tests/bench/kv_kernels_sm90.py counts both loops' instructions and
tests/bench/gpu_int4_decode_variants.py times them ("warp_slots" in int4_attention.CONFIG: 0 for the other form;
docs/PERFORMANCE.md, "The INT4 attention's warp-split form").
Tests: tests/test_int4_attention_interpret.py (Triton's interpreter, against float64) and
tests/test_kv_packed_cuda.py.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs
    triton = None

if triton is not None:
    from parity.rollout.int4_attention_parts import (
        _cache_rows,
        _epilogue,
        _f16_byte,
        _f16_low,
        _hi8,
        _online_softmax,
        _part_weights,
        _u_rows,
    )

    @triton.jit
    def _int4_attn_warps_kernel(qi_ptr, qc_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, ok_ptr, slot_ptr, o_ptr, pm_ptr,
                                pl_ptr, pu_ptr, cnt_ptr, hp_ptr, sg_ptr, qk_scale, L, S, n_kv, H, split_slots,
                                n_split, ok_stride, cap, G: tl.constexpr, BLOCK_G: tl.constexpr, W: tl.constexpr,
                                SLOTS: tl.constexpr, D: tl.constexpr, HADAMARD: tl.constexpr, ASM: tl.constexpr,
                                ONE_SPLIT: tl.constexpr, MERGE: tl.constexpr = False,
                                PREFETCH_OK: tl.constexpr = False, FWHT: tl.constexpr = False, GP: tl.constexpr = 16,
                                LOGD: tl.constexpr = 7):
        """Rows of the scores: query head g of the KV head (g < G real); first dimension: the warp, whose slots are
        start + w * SLOTS + [0, SLOTS) of the iteration starting at `start`. The products have BLOCK_G >= 16 rows:
        the heads, or with MERGE (G <= BLOCK_G / 2) the query's part a of head g in row g and its part b in row
        BLOCK_G / 2 + g (in a tensor core's accumulator one thread holds rows r and r + 8: their sum 128 a + b is
        the thread's own), so that two int8 products make the scores instead of four and the softmax works on half
        the rows; the weights go back to BLOCK_G rows, the lower half zero, for the V products. PREFETCH_OK: the
        next iteration's key mask is loaded at the top of this one (a loop-carried value) instead of at the top of
        its own: the mask's bytes (2 a thread) are too few for an asynchronous copy, so its load is otherwise a full
        memory round trip every iteration that nothing hides (Nsight Compute, docs/PERFORMANCE.md)."""
        DH: tl.constexpr = D // 2
        DQ: tl.constexpr = D // 4
        NR: tl.constexpr = BLOCK_G // 2 if MERGE else BLOCK_G  # rows of the scores
        bh = tl.program_id(0)
        sp = tl.program_id(1)
        b = bh // n_kv
        kvh = bh % n_kv
        j = tl.arange(0, DH)
        i4 = tl.arange(0, DQ)
        r = tl.arange(0, NR)
        r_ok = r < G
        hrow = (b * H + kvh * G + r).to(tl.int64)
        # the query's int8 parts (see int4_attention.Queries), the same for every warp
        gq = tl.arange(0, BLOCK_G)
        if MERGE:  # row gq: part gq // NR (a, b) of head gq % NR
            qb = (qi_ptr + (b * H + kvh * G + gq % NR).to(tl.int64)[:, None] * (4 * DH) + j[None, :]
                  + (gq // NR * 2 * DH)[:, None])
            qok = (gq % NR < G)[:, None]
        else:
            qb = qi_ptr + (b * H + kvh * G + gq).to(tl.int64)[:, None] * (4 * DH) + j[None, :]
            qok = (gq < G)[:, None]
        bea = tl.broadcast_to(tl.load(qb, mask=qok, other=0)[None, :, :], (W, BLOCK_G, DH))
        boa = tl.broadcast_to(tl.load(qb + DH, mask=qok, other=0)[None, :, :], (W, BLOCK_G, DH))
        if not MERGE:
            beb = tl.broadcast_to(tl.load(qb + 2 * DH, mask=qok, other=0)[None, :, :], (W, BLOCK_G, DH))
            bob = tl.broadcast_to(tl.load(qb + 3 * DH, mask=qok, other=0)[None, :, :], (W, BLOCK_G, DH))
        c_a = tl.load(qc_ptr + hrow * 4, mask=r_ok, other=0.0)[None, :, None]
        c_b = tl.load(qc_ptr + hrow * 4 + 1, mask=r_ok, other=0.0)[None, :, None]
        c_c = tl.load(qc_ptr + hrow * 4 + 2, mask=r_ok, other=0.0)[None, :, None]
        kc, vc16, ks, vs, okp = _cache_rows(kc_ptr, vc_ptr, ks_ptr, vs_ptr, ok_ptr, bh, b, S, ok_stride, DH)
        slot = tl.load(slot_ptr)
        w = tl.arange(0, W)
        n = tl.arange(0, SLOTS)
        m_i = tl.full([W, NR], float("-inf"), tl.float32)
        l_i = tl.zeros([W, NR], tl.float32)
        z_i = tl.zeros([W, NR], tl.float32)  # sum of weights x zero points (units of the warp's scale)
        w_i = tl.zeros([W, NR], tl.float32)  # sum of weights (same units)
        acc_x0 = tl.zeros([W, BLOCK_G, DQ], tl.float32)  # per byte of a pair: 1024 + byte (x), 1024 + low nibble (y)
        acc_y0 = tl.zeros([W, BLOCK_G, DQ], tl.float32)
        acc_x1 = tl.zeros([W, BLOCK_G, DQ], tl.float32)
        acc_y1 = tl.zeros([W, BLOCK_G, DQ], tl.float32)
        s_prev = tl.full([W], 1.0, tl.float32)
        lo = sp * split_slots
        hi = tl.minimum(lo + split_slots, L)
        # slots seen: below hi and at most the step's slot (one 32-bit comparison a slot: slots are below 2^31)
        lim = tl.minimum(hi, slot.to(tl.int32) + 1)
        if PREFETCH_OK:
            sl0 = lo + w[:, None] * SLOTS + n[None, :]
            ok_next = tl.load(okp + sl0, mask=sl0 < hi, other=0)
        for start in range(lo, hi, W * SLOTS):
            sl = start + w[:, None] * SLOTS + n[None, :]  # [W, SLOTS]
            s_in = sl < hi
            if PREFETCH_OK:
                ok_here = ok_next
                sl_next = sl + W * SLOTS
                ok_next = tl.load(okp + sl_next, mask=sl_next < hi, other=0)
            else:
                ok_here = tl.load(okp + sl, mask=s_in, other=0)
            wk = tl.load(ks + sl, mask=s_in, other=0)
            wv = tl.load(vs + sl, mask=s_in, other=0)
            seen = (ok_here != 0) & (sl < lim)
            ck = tl.load(kc + sl[:, :, None] * DH + j[None, None, :], mask=s_in[:, :, None], other=0)  # [W, SLOTS, D/2]
            # byte pairs: element 4i + {0, 1} in byte 2i, 4i + {2, 3} in byte 2i + 1
            cv = tl.load(vc16 + sl[:, :, None] * DQ + i4[None, None, :], mask=s_in[:, :, None], other=0)
            f = ((wk & -16).to(tl.float32, bitcast=True) * qk_scale)[:, None, :]
            zk = (wk & 15).to(tl.float32)[:, None, :]
            sv = (wv & -16).to(tl.float32, bitcast=True)
            zv = (wv & 15).to(tl.float32)[:, None, :]
            lo8 = tl.permute((ck & 15).to(tl.int8, bitcast=True), (0, 2, 1))  # n' of the even elements
            hi8 = tl.permute(_hi8(ck, ASM), (0, 2, 1))  # 16 (n' - 8) of the odd ones
            ta = tl.dot(bea, lo8, out_dtype=tl.int32) * 16
            ta = tl.dot(boa, hi8, ta, out_dtype=tl.int32)
            if MERGE:  # 128 x row g + row NR + g
                wab = tl.where(tl.arange(0, 2) == 0, 128, 1)
                tt = tl.sum(tl.reshape(ta, (W, 2, NR, SLOTS)) * wab[None, :, None, None], 1)
            else:
                tb = tl.dot(beb, lo8, out_dtype=tl.int32) * 16
                tb = tl.dot(bob, hi8, tb, out_dtype=tl.int32)
                tt = ta * 128 + tb
            t = tt.to(tl.float32)  # 16 (Q . n' - 8 sum(Q odd)), exact: [W, NR, SLOTS]
            s = (t * c_a + c_b) * f - (zk * f) * c_c
            m_new, alpha, p, l_i = _online_softmax(s, seen[:, None, :], m_i, l_i, 2)
            s_max = tl.maximum(tl.max(sv, 1), 1e-30)  # the warp's largest scale: weights in [0, 1], fp16 keeps 11 bits
            inv_s = 1.0 / s_max
            pw = (p * (sv * inv_s[:, None])[:, None, :]).to(tl.float16).to(tl.float32)
            beta = alpha * (s_prev / s_max)[:, None]
            s_prev = s_max
            z_i = z_i * beta + tl.sum(pw * zv, 2)
            w_i = w_i * beta + tl.sum(pw, 2)
            pt = _rows(pw.to(tl.float16), MERGE, True)
            bt = _rows(beta, MERGE, False)[:, :, None]
            acc_x0 = tl.dot(pt, _f16_byte(cv, 0, ASM), acc_x0 * bt)
            acc_y0 = tl.dot(pt, _f16_low(cv, 0, ASM), acc_y0 * bt)
            acc_x1 = tl.dot(pt, _f16_byte(cv, 1, ASM), acc_x1 * bt)
            acc_y1 = tl.dot(pt, _f16_low(cv, 1, ASM), acc_y1 * bt)
            m_i = m_new
        # merge the warps' partial softmaxes over the NR score rows (with MERGE the products' rows NR.. hold zero
        # weights): weights exp2(m_w - max) for the sums, times the warp's scale for the weighted sums (u below is
        # linear in them)
        if FWHT:  # the GP rows of the heads only, from here to the output (each warp its own, then the merge)
            m_i = _head_rows(m_i, GP)
            l_i = _head_rows(l_i, GP)
            z_i = _head_rows(z_i, GP)
            w_i = _head_rows(w_i, GP)
            a_x0 = _head_rows(_first_rows(acc_x0, MERGE), GP)
            a_y0 = _head_rows(_first_rows(acc_y0, MERGE), GP)
            a_x1 = _head_rows(_first_rows(acc_x1, MERGE), GP)
            a_y1 = _head_rows(_first_rows(acc_y1, MERGE), GP)
        else:
            a_x0 = _first_rows(acc_x0, MERGE)
            a_y0 = _first_rows(acc_y0, MERGE)
            a_x1 = _first_rows(acc_x1, MERGE)
            a_y1 = _first_rows(acc_y1, MERGE)
        m_h, wr = _part_weights(m_i)
        ws = wr * s_prev[:, None]
        l_h = tl.sum(l_i * wr, 0)
        z_h = tl.sum(z_i * ws, 0)
        w_h = tl.sum(w_i * ws, 0)
        ax0 = tl.sum(a_x0 * ws[:, :, None], 0)
        ay0 = tl.sum(a_y0 * ws[:, :, None], 0)
        ax1 = tl.sum(a_x1 * ws[:, :, None], 0)
        ay1 = tl.sum(a_y1 * ws[:, :, None], 0)
        lo_h, hi_h = _u_rows(ax0, ay0, ax1, ay1, w_h[:, None], z_h[:, None])
        if FWHT:
            RH: tl.constexpr = GP
        else:  # back to BLOCK_G rows for the output rotation's products (rows NR..: zero, not written)
            RH: tl.constexpr = BLOCK_G
            lo_h = _rows(tl.reshape(lo_h, (1, NR, DH)), MERGE, True).reshape(BLOCK_G, DH)
            hi_h = _rows(tl.reshape(hi_h, (1, NR, DH)), MERGE, True).reshape(BLOCK_G, DH)
            m_h = _rows(m_h[None, :], MERGE, False).reshape(BLOCK_G)
            l_h = _rows(l_h[None, :], MERGE, False).reshape(BLOCK_G)
        g = tl.arange(0, RH)
        g_ok = g < G
        l_h = tl.where(g_ok, l_h, 1.0)  # past the heads: not written
        head = (b * H + kvh * G + g).to(tl.int64)
        _epilogue(m_h, l_h, lo_h, hi_h, g_ok, g_ok, g, head, bh, sp, n_split, cap, o_ptr, pm_ptr, pl_ptr, pu_ptr,
                  cnt_ptr, hp_ptr, sg_ptr, G, RH, D, HADAMARD, False, ONE_SPLIT, FWHT, LOGD)

    @triton.jit
    def _head_rows(x, GP: tl.constexpr):
        """Rows [0, GP) of each warp's x [W, NR] or [W, NR, n] (NR a multiple of GP): [W, GP] or [W, GP, n]."""
        NB: tl.constexpr = x.shape[1] // GP
        if len(x.shape) == 3:
            y = tl.reshape(x, (x.shape[0], NB, GP, x.shape[2]))
            keep = (tl.arange(0, NB) == 0)[None, :, None, None]
        else:
            y = tl.reshape(x, (x.shape[0], NB, GP))
            keep = (tl.arange(0, NB) == 0)[None, :, None]
        return tl.sum(tl.where(keep, y, 0.0), 1)

    @triton.jit
    def _first_rows(x, MERGE: tl.constexpr):
        """[W, 2 NR, ...] -> its rows [0, NR) with MERGE (rows NR.. are zero: the sum of each pair is exact), else x."""
        if MERGE:
            return tl.sum(tl.reshape(x, (x.shape[0], 2, x.shape[1] // 2, x.shape[2])), 1)
        else:
            return x

    @triton.jit
    def _rows(x, MERGE: tl.constexpr, ZERO: tl.constexpr):
        """[W, NR, ...] -> [W, 2 NR, ...] with MERGE (rows NR + g: zero, or row g again), else x."""
        if MERGE:
            if ZERO:
                y = tl.join(x, tl.zeros_like(x))
            else:
                y = tl.join(x, x)
            if len(x.shape) == 3:
                return tl.reshape(tl.permute(y, (0, 3, 1, 2)), (x.shape[0], 2 * x.shape[1], x.shape[2]))
            else:
                return tl.reshape(tl.permute(y, (0, 2, 1)), (x.shape[0], 2 * x.shape[1]))
        else:
            return x
