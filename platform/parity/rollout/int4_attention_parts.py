"""The pieces both forms of the rotated int4 decode attention share (parity.rollout.int4_attention and its
warp-split form, parity.rollout.int4_attention_warps): the codes' unpacking into tensor-core operands, the output
rotation and a program's end (its output, or its split's partial and the merge of a (row, KV head)'s splits)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs
    triton = None

if triton is not None:
    @triton.jit
    def _f16_byte(c, HALF: tl.constexpr, ASM: tl.constexpr):
        """fp16 1024 + byte HALF of the uint16 c (exact): the byte's two nibbles as 1024 + lo + 16 hi. One byte
        permute per two codes: [c.b, 0x64, c'.b, 0x64] is the fp16 pair of two neighbouring elements. (The byte
        alone, [c.b, 0, c'.b, 0], would be an fp16 subnormal: exact, no offset to take off and one instruction
        fewer a pair, but it lengthens a chain of dependent tensor-core products by 11-21% on an H100, and the
        attention came out slower: docs/PERFORMANCE.md, "The output rotation in butterflies".)"""
        if ASM:
            if HALF == 0:
                return tl.inline_asm_elementwise(
                    "{ .reg .b32 f; mov.b32 f, 0x64646464; prmt.b32 $0, $1, f, 0x4240; }", "=r,r", [c],
                    dtype=tl.float16, is_pure=True, pack=2)
            else:
                return tl.inline_asm_elementwise(
                    "{ .reg .b32 f; mov.b32 f, 0x64646464; prmt.b32 $0, $1, f, 0x4341; }", "=r,r", [c],
                    dtype=tl.float16, is_pure=True, pack=2)
        else:
            return (((c >> (8 * HALF)) & 0xFF) | 0x6400).to(tl.float16, bitcast=True)

    @triton.jit
    def _f16_quad(c, ASM: tl.constexpr):
        """(_f16_byte(c, 0), _f16_low(c, 0), _f16_byte(c, 1), _f16_low(c, 1)), the same values, in one asm block over
        four codes: the 0x64 bytes come from a register once, the other pairs take theirs from the first pair (ptxas
        otherwise puts the permute's selector in a register again before every permute: 58 fewer loop instructions
        an iteration in the slot-groups form, sm_90a)."""
        if ASM:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 f; mov.b32 f, 0x64646464; prmt.b32 $0, $8, f, 0x4240; prmt.b32 $1, $9, $0, 0x7250; "
                "prmt.b32 $4, $8, $0, 0x7351; prmt.b32 $5, $9, $0, 0x7351; and.b32 $2, $0, 0xff0fff0f; "
                "and.b32 $3, $1, 0xff0fff0f; and.b32 $6, $4, 0xff0fff0f; and.b32 $7, $5, 0xff0fff0f; }",
                "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [c], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
                is_pure=True, pack=4)
        else:
            return _f16_byte(c, 0, ASM), _f16_low(c, 0, ASM), _f16_byte(c, 1, ASM), _f16_low(c, 1, ASM)

    @triton.jit
    def _f16_low(c, HALF: tl.constexpr, ASM: tl.constexpr):
        """fp16 1024 + (low nibble of byte HALF of the uint16 c), exact."""
        if ASM:
            if HALF == 0:
                return tl.inline_asm_elementwise(
                    "{ .reg .b32 f, t; mov.b32 f, 0x64646464; prmt.b32 t, $1, f, 0x4240; and.b32 $0, t, 0xff0fff0f; }",
                    "=r,r", [c], dtype=tl.float16, is_pure=True, pack=2)
            else:
                return tl.inline_asm_elementwise(
                    "{ .reg .b32 f, t; mov.b32 f, 0x64646464; prmt.b32 t, $1, f, 0x4341; and.b32 $0, t, 0xff0fff0f; }",
                    "=r,r", [c], dtype=tl.float16, is_pure=True, pack=2)
        else:
            return (((c >> (8 * HALF)) & 0x0F) | 0x6400).to(tl.float16, bitcast=True)

    @triton.jit
    def _hi8(c, ASM: tl.constexpr):
        """int8 16 (hi - 8) for the high nibble hi of the uint8 c: (c ^ 0x80) & 0xF0 read as int8, one lop3."""
        if ASM:
            return tl.inline_asm_elementwise("lop3.b32 $0, $1, 0xF0F0F0F0, 0x80808080, 0x6A;", "=r,r", [c],
                                             dtype=tl.int8, is_pure=True, pack=4)
        else:
            return ((c ^ 0x80) & 0xF0).to(tl.int8, bitcast=True)

    @triton.jit
    def _cache_rows(kc_ptr, vc_ptr, ks_ptr, vs_ptr, ok_ptr, bh, b, S, ok_stride, DH: tl.constexpr):
        """Program (row b, (row, KV head) bh)'s cache: (K codes, V codes as byte pairs, K and V scale words, key
        mask)."""
        base = bh.to(tl.int64) * S
        return (kc_ptr + base * DH, (vc_ptr + base * DH).to(tl.pointer_type(tl.uint16)), ks_ptr + base,
                vs_ptr + base, ok_ptr + b.to(tl.int64) * ok_stride)

    @triton.jit
    def _part_weights(m):
        """Partial softmaxes' running maxima m [P, heads] -> (the heads' max [heads], each part's weight
        exp2(m - max) [P, heads], zero for a part that saw nothing)."""
        m_h = tl.max(m, 0)
        top = tl.where(m_h == float("-inf"), 0.0, m_h)
        return m_h, tl.where(m == float("-inf"), 0.0, tl.exp2(m - top[None, :]))

    @triton.jit
    def _online_softmax(s, seen, m_i, l_i, AXIS: tl.constexpr):
        """One tile of the online softmax along AXIS, base 2: the scores s kept where seen; (the new running max,
        the factor alpha the sums so far take, the tile's weights p, the new running sum)."""
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, AXIS))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no NaN
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - tl.expand_dims(m_use, AXIS))
        return m_new, alpha, p, l_i * alpha + tl.sum(p, AXIS)

    @triton.jit
    def _u_rows(ax0, ay0, ax1, ay1, w, z):
        """u = sum_j p_j s_j (n'_j - z_j) of R rows from the V products' sums ax0, ay0, ax1, ay1 [R, D/4] (per byte
        of a pair: 1024 + byte (x), 1024 + low nibble (y)), the weights' sums w and their weighted zero points z
        [R, 1]: (even elements, odd elements) [R, D/2], the 1024 offsets and the zero points taken off."""
        zo = 1024.0 * w + z
        y0 = ay0 - zo  # element 4i
        y1 = ay1 - zo  # element 4i + 2
        x0 = (ax0 - ay0) * 0.0625 - z  # element 4i + 1
        x1 = (ax1 - ay1) * 0.0625 - z  # element 4i + 3
        R: tl.constexpr = ax0.shape[0]
        DH: tl.constexpr = 2 * ax0.shape[1]
        return tl.reshape(tl.join(y0, y1), (R, DH)), tl.reshape(tl.join(x0, x1), (R, DH))

    @triton.jit
    def _fwht(x, N: tl.constexpr, LOGN: tl.constexpr):
        """H_N x along the last axis of x [M, N] (H_N the Sylvester-Hadamard matrix, N = 2^LOGN): LOGN stages of
        float32 butterflies, (x_i, x_i') -> (x_i + x_i', x_i - x_i') for the pairs i' = i + 2^k, bit k of i clear."""
        M: tl.constexpr = x.shape[0]
        for k in tl.static_range(LOGN):
            y = tl.permute(tl.reshape(x, (M, N >> (k + 1), 2, 1 << k)), (0, 1, 3, 2))
            a, b = tl.split(y)
            x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (M, N))
        return x

    @triton.jit
    def _finish(u_lo, u_hi, o_ptr, head, g_ok, hp_ptr, sg_ptr, HADAMARD: tl.constexpr, EXACT: tl.constexpr,
                D: tl.constexpr, FWHT: tl.constexpr = False, LOGD: tl.constexpr = 7):
        """Output rows of u [BLOCK_G, D] (normalized, rotated basis, even columns u_lo, odd u_hi): d (H u) / D with
        H_D = [[H', H'], [H', -H']] interleaved: (H u)[2r + s] = (H' u_lo)[r] + (-1)^s (H' u_hi)[r]. FWHT: H u in
        float32 butterflies on u's rows as they are (any number of rows), instead of products with H' over 16 rows
        or more."""
        j = tl.arange(0, D // 2)
        d = tl.arange(0, D)
        if HADAMARD and FWHT:
            u = tl.reshape(tl.join(u_lo, u_hi), (u_lo.shape[0], D))
            vals = _fwht(u, D, LOGD) * tl.load(sg_ptr + d)[None, :]
        else:
            if HADAMARD:
                r = tl.arange(0, D // 2)
                hp = tl.load(hp_ptr + r[:, None] * (D // 2) + j[None, :])  # +-1: float32 (EXACT), else bf16
                if EXACT:
                    a = tl.dot(u_lo, hp, input_precision="ieee")
                    bv = tl.dot(u_hi, hp, input_precision="ieee")
                else:  # each of u's rows as two bf16 terms (16 bits): H' is +-1, so the products are exact
                    hpb = hp.to(tl.bfloat16)
                    lo1 = u_lo.to(tl.bfloat16)
                    hi1 = u_hi.to(tl.bfloat16)
                    a = tl.dot(lo1, hpb) + tl.dot((u_lo - lo1.to(tl.float32)).to(tl.bfloat16), hpb)
                    bv = tl.dot(hi1, hpb) + tl.dot((u_hi - hi1.to(tl.float32)).to(tl.bfloat16), hpb)
                even = (a + bv) * tl.load(sg_ptr + 2 * j)[None, :]
                odd = (a - bv) * tl.load(sg_ptr + 2 * j + 1)[None, :]
            else:
                even = u_lo
                odd = u_hi
            vals = tl.reshape(tl.join(even, odd), (even.shape[0], D))
        tl.store(o_ptr + head[:, None] * D + d[None, :], vals.to(o_ptr.dtype.element_ty), mask=g_ok[:, None])

    @triton.jit
    def _epilogue(m_c, l_c, lo_c, hi_c, own, c_ok, cg, head, bh, sp, n_split, cap, o_ptr, pm_ptr, pl_ptr, pu_ptr,
                  cnt_ptr, hp_ptr, sg_ptr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                  HADAMARD: tl.constexpr, EXACT: tl.constexpr, ONE_SPLIT: tl.constexpr, FWHT: tl.constexpr = False,
                  LOGD: tl.constexpr = 7):
        """A program's end, rows [BLOCK_G] of head cg (valid where c_ok; `own`: the rows that write): with one split
        the output (`_finish`); else its partial (running max m_c, sum l_c, weighted sums lo_c / hi_c) and, in the
        last split of the (row, KV head) to finish, the merge of all partials and the output."""
        DH: tl.constexpr = D // 2
        j = tl.arange(0, DH)
        if ONE_SPLIT:
            inv = 1.0 / l_c
            _finish(lo_c * inv[:, None], hi_c * inv[:, None], o_ptr, head, own, hp_ptr, sg_ptr, HADAMARD, EXACT, D,
                    FWHT, LOGD)
        else:
            part = (bh.to(tl.int64) * cap + sp) * G + cg
            tl.store(pm_ptr + part, m_c, mask=own)
            tl.store(pl_ptr + part, l_c, mask=own)
            pu = pu_ptr + part[:, None] * D + 2 * j[None, :]
            tl.store(pu, lo_c, mask=own[:, None])
            tl.store(pu + 1, hi_c, mask=own[:, None])
            tl.debug_barrier()  # every thread's partial written before the count says so
            done = tl.atomic_add(cnt_ptr + bh, 1, sem="acq_rel", scope="gpu")
            if done == n_split - 1:  # the last split of this (row, KV head): merge
                first = (bh.to(tl.int64) * cap) * G + cg
                big = tl.full([BLOCK_G], float("-inf"), tl.float32)
                for i in range(0, n_split):
                    mi = tl.load(pm_ptr + first + i * G, mask=c_ok, other=float("-inf"), cache_modifier=".cg")
                    big = tl.maximum(big, mi)
                big = tl.where(big == float("-inf"), 0.0, big)
                tot = tl.zeros([BLOCK_G], tl.float32)
                m_lo = tl.zeros([BLOCK_G, DH], tl.float32)
                m_hi = tl.zeros([BLOCK_G, DH], tl.float32)
                for i in range(0, n_split):
                    at = first + i * G
                    mi = tl.load(pm_ptr + at, mask=c_ok, other=float("-inf"), cache_modifier=".cg")
                    li = tl.load(pl_ptr + at, mask=c_ok, other=0.0, cache_modifier=".cg")
                    wgt = tl.where(mi == float("-inf"), 0.0, tl.exp2(mi - big))
                    tot += li * wgt
                    ui = pu_ptr + at[:, None] * D + 2 * j[None, :]
                    m_lo += wgt[:, None] * tl.load(ui, mask=c_ok[:, None], other=0.0, cache_modifier=".cg")
                    m_hi += wgt[:, None] * tl.load(ui + 1, mask=c_ok[:, None], other=0.0, cache_modifier=".cg")
                inv = 1.0 / tot
                _finish(m_lo * inv[:, None], m_hi * inv[:, None], o_ptr, head, own, hp_ptr, sg_ptr, HADAMARD,
                        EXACT, D, FWHT, LOGD)
                tl.atomic_xchg(cnt_ptr + bh, 0, sem="relaxed", scope="gpu")  # ready for the next launch
