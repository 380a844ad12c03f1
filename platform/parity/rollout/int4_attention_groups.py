"""The rotated int4 decode attention with slot groups in the products' rows: the arithmetic of
parity.rollout.int4_attention_warps (the same query codes, the same exact integer K product, the same fp16 V weights
and byte unpacking, the output rotation in butterflies, the same split merge) in one warp, with the 16 rows of the
tensor-core products filled by real (slot group, head) pairs instead of padding.

The warp-split form's products have a row for each head and query part (2 x 2 real of 16 at 2 query heads a KV
head), so its softmax works on 8 score rows of which 2 are heads. Here an iteration's T slots are NQ groups of SG
consecutive slots, and row p * NR + q * GP + g of the K product (NR = NQ GP = 8) holds part p of head g's query in
column block q of a block-diagonal operand [16, NQ D/2], against the codes laid out [NQ D/2, SG] (row q D/2 + d,
column n: byte d of slot start + q SG + n, loaded so from memory). Its score rows (q, g) are all real: group q's
slots for head g, each row with its own running softmax. The V weights go back block-diagonal ([NR, T], row (q, g)
nonzero in group q's columns) against the codes of all T slots, and after the loop the NQ groups of each head are
merged as the warp-split form merges its warps. NQ = 8 / GP groups (GP: the heads rounded up to a power of two, at
most 8), SG >= 16 slots each (the products' smallest width). VSPLIT (CONFIG's "group_v"): the V product as NQ
products, group q's weights (the other groups' rows zero) against group q's codes, instead of the block-diagonal
weights the compiler builds through shared memory: the same products summed in the same order. PF_L2 (CONFIG's
"l2_slots"): the first slots' codes and scale words prefetched into L2 as the program starts. QUAD (CONFIG's
"quad_unpack"): the V products' four fp16 operands unpacked by one asm block (the same values). PDL (CONFIG's "pdl"):
launched as a programmatic dependent, it waits for the kernel before it (griddepcontrol.wait) after the L2 prefetch
and before its first load: what that kernel writes (the query, the step's slot) is read after the wait.
Tests: tests/test_int4_attention_interpret.py (Triton's interpreter, against float64), tests/test_kv_packed_cuda.py.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs
    triton = None

if triton is not None:
    from triton.language.extra.cuda import gdc_wait

    from parity.rollout.int4_attention_parts import (
        _cache_rows,
        _epilogue,
        _f16_byte,
        _f16_low,
        _f16_quad,
        _hi8,
        _online_softmax,
        _part_weights,
        _u_rows,
    )

    @triton.jit
    def _int4_attn_groups_kernel(qi_ptr, qc_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, ok_ptr, slot_ptr, o_ptr, pm_ptr,
                                 pl_ptr, pu_ptr, cnt_ptr, hp_ptr, sg_ptr, qk_scale, L, S, n_kv, H, split_slots,
                                 n_split, ok_stride, cap, G: tl.constexpr, GP: tl.constexpr, NQ: tl.constexpr,
                                 SG: tl.constexpr, D: tl.constexpr, HADAMARD: tl.constexpr, ASM: tl.constexpr,
                                 ONE_SPLIT: tl.constexpr, PREFETCH_OK: tl.constexpr, LOGD: tl.constexpr,
                                 VSPLIT: tl.constexpr = False, PF_L2: tl.constexpr = 0,
                                 QUAD: tl.constexpr = False, PDL: tl.constexpr = False):
        DH: tl.constexpr = D // 2
        DQ: tl.constexpr = D // 4
        NR: tl.constexpr = NQ * GP  # score rows (q, g); the products' rows are part a (< NR) and part b
        T: tl.constexpr = NQ * SG  # slots an iteration
        bh = tl.program_id(0)
        sp = tl.program_id(1)
        b = bh // n_kv
        kvh = bh % n_kv
        i4 = tl.arange(0, DQ)
        qq = tl.arange(0, NQ)
        n = tl.arange(0, SG)
        if PF_L2 > 0:  # the first PF_L2 slots' codes and scale words on their way to L2 before the query's loads
            _prefetch_slots(kc_ptr, vc_ptr, ks_ptr, vs_ptr, bh, S, sp * split_slots,
                            tl.minimum(sp * split_slots + split_slots, L), DH, PF_L2)
        if PDL:  # the kernel before it (the pre-attention: the query, the step's slot) done and its writes seen
            gdc_wait()
        # the block-diagonal query: row p * NR + q * GP + g holds part p (a, b) of head g in columns q D/2 + [0, D/2)
        rp = tl.arange(0, 2 * NR)
        g_p = rp % GP
        q_p = (rp % NR) // GP
        kk = tl.arange(0, NQ * DH)
        q_k = kk // DH
        d_k = kk % DH
        qb = (qi_ptr + (b * H + kvh * G + g_p).to(tl.int64)[:, None] * (4 * DH) + (rp // NR * 2 * DH)[:, None]
              + d_k[None, :])
        qok = (g_p < G)[:, None] & (q_p[:, None] == q_k[None, :])
        bea = tl.load(qb, mask=qok, other=0)  # even elements' parts
        boa = tl.load(qb + DH, mask=qok, other=0)  # odd elements' parts
        wab = tl.where(tl.arange(0, 2) == 0, 128, 1)  # 128 part a + part b
        # score row r = q * GP + g: head g's factors
        r = tl.arange(0, NR)
        g_r = r % GP
        q_r = r // GP
        hrow = (b * H + kvh * G + g_r).to(tl.int64)
        r_ok = g_r < G
        c_a = tl.load(qc_ptr + hrow * 4, mask=r_ok, other=0.0)[:, None]
        c_b = tl.load(qc_ptr + hrow * 4 + 1, mask=r_ok, other=0.0)[:, None]
        c_c = tl.load(qc_ptr + hrow * 4 + 2, mask=r_ok, other=0.0)[:, None]
        kc, vc16, ks, vs, okp = _cache_rows(kc_ptr, vc_ptr, ks_ptr, vs_ptr, ok_ptr, bh, b, S, ok_stride, DH)
        slot = tl.load(slot_ptr)
        m_i = tl.full([NR], float("-inf"), tl.float32)
        l_i = tl.zeros([NR], tl.float32)
        z_i = tl.zeros([NR], tl.float32)  # sum of weights x zero points (units of the tile's scale)
        w_i = tl.zeros([NR], tl.float32)  # sum of weights (same units)
        acc_x0 = tl.zeros([2 * NR, DQ], tl.float32)  # per byte of a pair: 1024 + byte (x), 1024 + low nibble (y)
        acc_y0 = tl.zeros([2 * NR, DQ], tl.float32)
        acc_x1 = tl.zeros([2 * NR, DQ], tl.float32)
        acc_y1 = tl.zeros([2 * NR, DQ], tl.float32)
        s_prev = 1.0
        lo = sp * split_slots
        hi = tl.minimum(lo + split_slots, L)
        lim = tl.minimum(hi, slot.to(tl.int32) + 1)  # slots seen: below it (one 32-bit comparison a slot)
        if PREFETCH_OK:
            sl0 = lo + qq[:, None] * SG + n[None, :]
            ok_next = tl.load(okp + sl0, mask=sl0 < hi, other=0)
        for start in range(lo, hi, T):
            sl = start + qq[:, None] * SG + n[None, :]  # [NQ, SG]: slot of group q, column n
            s_in = sl < hi
            if PREFETCH_OK:
                ok_here = ok_next
                sl_next = sl + T
                ok_next = tl.load(okp + sl_next, mask=sl_next < hi, other=0)
            else:
                ok_here = tl.load(okp + sl, mask=s_in, other=0)
            wk = tl.load(ks + sl, mask=s_in, other=0)
            wv = tl.load(vs + sl, mask=s_in, other=0)
            cv = 0
            if not VSPLIT:
                vslot = start + tl.arange(0, T)  # byte pairs: element 4i + {0, 1} in byte 2i, 4i + {2, 3} in 2i + 1
                cv = tl.load(vc16 + vslot[:, None] * DQ + i4[None, :], mask=(vslot < hi)[:, None], other=0)
            s, seen = _tile_scores(kc, wk, start, sl, hi, lim, ok_here, bea, boa, wab, c_a, c_b, c_c, qk_scale, q_k,
                                   d_k, n, NR, SG, GP, DH, ASM)
            m_i, l_i, z_i, w_i, acc_x0, acc_y0, acc_x1, acc_y1, s_prev = _tile_values(
                s, seen, wv, cv, start, hi, m_i, l_i, z_i, w_i, acc_x0, acc_y0, acc_x1, acc_y1, s_prev, vc16, q_r,
                qq, n, i4, NR, NQ, SG, GP, DQ, T, VSPLIT, ASM, QUAD)
        # merge each head's NQ groups (rows q * GP + g), weights exp2(m_q - max) as the warp-split form's warps
        m_q = tl.reshape(m_i, (NQ, GP))
        m_h, wr = _part_weights(m_q)
        l_h = tl.sum(tl.reshape(l_i, (NQ, GP)) * wr, 0)
        ws = wr * s_prev
        z_h = tl.sum(tl.reshape(z_i, (NQ, GP)) * ws, 0)[:, None]
        w_h = tl.sum(tl.reshape(w_i, (NQ, GP)) * ws, 0)[:, None]
        lo_h, hi_h = _u_rows(_group_sum(acc_x0, ws, NQ, GP), _group_sum(acc_y0, ws, NQ, GP),
                             _group_sum(acc_x1, ws, NQ, GP), _group_sum(acc_y1, ws, NQ, GP), w_h, z_h)
        g = tl.arange(0, GP)
        g_ok = g < G
        l_h = tl.where(g_ok, l_h, 1.0)  # past the heads: not written
        head = (b * H + kvh * G + g).to(tl.int64)
        _epilogue(m_h, l_h, lo_h, hi_h, g_ok, g_ok, g, head, bh, sp, n_split, cap, o_ptr, pm_ptr, pl_ptr, pu_ptr,
                  cnt_ptr, hp_ptr, sg_ptr, G, GP, D, HADAMARD, False, ONE_SPLIT, True, LOGD)

    @triton.jit
    def _tile_values(s, seen, wv, cv, start, hi, m_i, l_i, z_i, w_i, acc_x0, acc_y0, acc_x1, acc_y1, s_prev, vc16, q_r,
                     qq, n, i4, NR: tl.constexpr, NQ: tl.constexpr, SG: tl.constexpr, GP: tl.constexpr,
                     DQ: tl.constexpr, T: tl.constexpr, VSPLIT: tl.constexpr, ASM: tl.constexpr, QUAD: tl.constexpr):
        """The running softmax (m_i, l_i), the weights' sums (z_i, w_i), the V accumulators and the scale reference
        (this tile's largest V scale) after the tile at slot `start`: its scores s [NR, SG] (seen: which count), V scale words wv
        [NQ, SG] and, unless VSPLIT, its V codes cv [T, D/4] (with VSPLIT each group's are loaded here)."""
        sv = (wv & -16).to(tl.float32, bitcast=True)
        zv = _to_rows((wv & 15).to(tl.float32), GP)
        m_new, alpha, p, l_i = _online_softmax(s, seen, m_i, l_i, 1)
        s_max = tl.maximum(tl.max(tl.max(sv, 1), 0), 1e-30)  # the tile's largest scale: weights in [0, 1]
        pw = (p * _to_rows(sv * (1.0 / s_max), GP)).to(tl.float16).to(tl.float32)
        beta = alpha * (s_prev / s_max)
        z_i = z_i * beta + tl.sum(pw * zv, 1)
        w_i = w_i * beta + tl.sum(pw, 1)
        acc_x0, acc_y0, acc_x1, acc_y1 = _rescaled(beta, acc_x0, acc_y0, acc_x1, acc_y1)
        if VSPLIT:  # each group's slots a product of their own: the weights stay in the scores' layout
            for q in tl.static_range(NQ):
                pq = tl.where(q_r[:, None] == q, pw, 0.0)
                pt = tl.reshape(tl.permute(tl.join(pq, tl.zeros_like(pq)), (2, 0, 1)), (2 * NR, SG)).to(tl.float16)
                vq = start + q * SG + n
                cq = tl.load(vc16 + vq[:, None] * DQ + i4[None, :], mask=(vq < hi)[:, None], other=0)
                acc_x0, acc_y0, acc_x1, acc_y1 = _v_products(pt, cq, acc_x0, acc_y0, acc_x1, acc_y1, ASM, QUAD)
        else:  # the weights back at their slots, block-diagonal: row (q, g) in columns q SG + [0, SG)
            pb = tl.reshape(tl.where(q_r[:, None, None] == qq[None, :, None], pw[:, None, :], 0.0), (NR, T))
            pt = tl.reshape(tl.permute(tl.join(pb, tl.zeros_like(pb)), (2, 0, 1)), (2 * NR, T)).to(tl.float16)
            acc_x0, acc_y0, acc_x1, acc_y1 = _v_products(pt, cv, acc_x0, acc_y0, acc_x1, acc_y1, ASM, QUAD)
        return m_new, l_i, z_i, w_i, acc_x0, acc_y0, acc_x1, acc_y1, s_max

    @triton.jit
    def _tile_scores(kc, wk, start, sl, hi, lim, ok_here, bea, boa, wab, c_a, c_b, c_c, qk_scale, q_k, d_k, n,
                     NR: tl.constexpr, SG: tl.constexpr, GP: tl.constexpr, DH: tl.constexpr, ASM: tl.constexpr):
        """The scores [NR, SG] of the tile at slot `start` (its slots sl [NQ, SG]; row q * GP + g: group q's slots for
        head g; base 2) from its K scale words wk and codes, and which of them are seen (in the key mask ok_here and
        below lim); slots from hi on load nothing."""
        sk = start + q_k[:, None] * SG + n[None, :]  # [NQ D/2, SG]: the K codes as the product's operand
        ck = tl.load(kc + sk * DH + d_k[:, None], mask=sk < hi, other=0)
        ta = tl.dot(bea, (ck & 15).to(tl.int8, bitcast=True), out_dtype=tl.int32) * 16
        ta = tl.dot(boa, _hi8(ck, ASM), ta, out_dtype=tl.int32)
        t = tl.sum(tl.reshape(ta, (2, NR, SG)) * wab[:, None, None], 0).to(tl.float32)  # exact: [NR, SG]
        f = _to_rows((wk & -16).to(tl.float32, bitcast=True) * qk_scale, GP)
        zk = _to_rows((wk & 15).to(tl.float32), GP)
        seen = _to_rows((ok_here != 0) & (sl < lim), GP)
        return (t * c_a + c_b) * f - (zk * f) * c_c, seen

    @triton.jit
    def _prefetch_l2(p):
        """A prefetch into L2 of the 128-byte lines holding the addresses p (one instruction a pointer)."""
        return tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [p], dtype=tl.int32,
                                         is_pure=False, pack=1)

    @triton.jit
    def _prefetch_slots(kc_ptr, vc_ptr, ks_ptr, vs_ptr, bh, S, lo, hi, DH: tl.constexpr, NS: tl.constexpr):
        """L2 prefetches of slots [lo, min(lo + NS, hi)) of (row, KV head) bh's cache: the K and V codes (DH bytes a
        slot) and the scale words (4 bytes), a line a pointer, addresses held inside the slots."""
        base = bh.to(tl.int64) * S + lo
        nb = tl.maximum(tl.minimum(hi - lo, NS), 1)
        LC: tl.constexpr = max(1, NS * DH // 128)
        LW: tl.constexpr = max(1, NS * 4 // 128)
        lc = tl.minimum(tl.arange(0, LC) * 128, nb * DH - 1)
        lw = tl.minimum(tl.arange(0, LW) * 32, nb - 1)
        _prefetch_l2(kc_ptr + base * DH + lc)
        _prefetch_l2(vc_ptr + base * DH + lc)
        _prefetch_l2(ks_ptr + base + lw)
        _prefetch_l2(vs_ptr + base + lw)

    @triton.jit
    def _v_products(pt, c, a0, a1, a2, a3, ASM: tl.constexpr, QUAD: tl.constexpr):
        """The four V accumulators after the products of the fp16 weights pt with the codes c (byte pairs): 1024 +
        each byte and 1024 + its low nibble, of either byte; QUAD: the four operands from one asm block."""
        if QUAD:
            x0, y0, x1, y1 = _f16_quad(c, ASM)
            return tl.dot(pt, x0, a0), tl.dot(pt, y0, a1), tl.dot(pt, x1, a2), tl.dot(pt, y1, a3)
        else:
            a0 = tl.dot(pt, _f16_byte(c, 0, ASM), a0)
            a1 = tl.dot(pt, _f16_low(c, 0, ASM), a1)
            a2 = tl.dot(pt, _f16_byte(c, 1, ASM), a2)
            return a0, a1, a2, tl.dot(pt, _f16_low(c, 1, ASM), a3)

    @triton.jit
    def _rescaled(beta, a0, a1, a2, a3):
        """The four V accumulators [2 NR, D/4] with both parts' rows of score row r multiplied by beta[r]."""
        bt = tl.reshape(tl.permute(tl.join(beta, beta), (1, 0)), (2 * beta.shape[0],))[:, None]
        return a0 * bt, a1 * bt, a2 * bt, a3 * bt

    @triton.jit
    def _to_rows(x, GP: tl.constexpr):
        """[NQ, SG] per slot -> [NQ GP, SG], row q * GP + g: group q's values for each head g."""
        return tl.reshape(tl.broadcast_to(x[:, None, :], (x.shape[0], GP, x.shape[1])), (x.shape[0] * GP, x.shape[1]))

    @triton.jit
    def _group_sum(acc, ws, NQ: tl.constexpr, GP: tl.constexpr):
        """Rows [0, NQ GP) of acc [2 NQ GP, n] (the rest zero), each group's rows weighted by ws [NQ, GP], summed over
        the groups: [GP, n]."""
        a = tl.sum(tl.reshape(acc, (2, NQ, GP, acc.shape[1])), 0)
        return tl.sum(a * ws[:, :, None], 0)
