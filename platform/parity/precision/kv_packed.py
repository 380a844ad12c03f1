"""A packed KV cache: the codes and scales of parity.precision.kv's codecs in device memory, for the CUDA decode
path (parity.rollout.cuda_decode), read by the decode-attention kernel (parity.rollout.decode_attention).

Layout of one layer (B rows, n_kv heads, S slots, D = head_dim), K and V alike:

    int4_per_token_head  codes uint8 [B, n_kv, S, D / 2] (element 2i in the low nibble), words int32 [B, n_kv, S]:
                         the float32 scale with its 4 low mantissa bits cleared, the zero point in those bits
                         (vLLM's layout); with the Hadamard rotation the codes are those of the rotated vector
    int8                 codes int8 [B, n_kv, S, D], scales float32 [B, n_kv, S]
    fp8_per_token_head   codes float8_e4m3fn [B, n_kv, S, D], scales float32 [B, n_kv, S]
    fp8                  codes float8_e4m3fn [B, n_kv, S, D] (one per-tensor scale, a kernel argument)

so a token-head costs the codec's `bytes_per_token_head()` (D / 2 + 4 bytes for int4 against 2 D for bf16).

Exactness: the write kernel computes the codec's codes and scales bit for bit (the same float32 operations in the
same order: kv.py is written for that), and the tile loader `_kv_tile`, which the attention kernel and the
dequantization kernel share, returns the codec's dequantized values bit for bit. For the rotated int4 cache that
includes the inverse rotation of every key and value: d * (H (q - z)) s / b, with H (q - z) an integer product
(one butterfly level over the halves of the head, then int8 tensor-core products with the rows of H_{D/2}
de-interleaved to match the nibble order), so the attention reads exactly the bf16 values the simulated cache
holds. tests/test_kv_packed_cuda.py checks all of this on the device, tests/test_kv_packed_interpret.py with
Triton's interpreter on CPU.

Backends: "triton" on CUDA (and on CPU under TRITON_INTERPRET=1), "torch" otherwise (the codec's own pack and
unpack, for CPU runs of the decode path). Importable without Triton.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from parity.precision.kv import (
    _INV_15,
    _INV_127,
    _INV_FP8_MAX,
    _MIN_SCALE,
    KVCodec,
    KVState,
    _hadamard,
    _rht_signs,
)

try:  # Triton kernels resolve names from module globals: import here
    import triton
    import triton.language as tl
except ImportError:  # CPU installs
    triton = None

PACKED_KINDS = ("int8", "fp8", "fp8_per_token_head", "int4_per_token_head")
# kernel kind ids (constexpr): 0 = raw values (a bf16 / fp32 cache read by the same kernels)
KIND_RAW, KIND_INT8, KIND_FP8, KIND_FP8_PTH, KIND_INT4 = 0, 1, 2, 3, 4
_KIND_ID = {"bf16": KIND_RAW, "int8": KIND_INT8, "fp8": KIND_FP8, "fp8_per_token_head": KIND_FP8_PTH,
            "int4_per_token_head": KIND_INT4}
_CODE_DTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_per_token_head": torch.float8_e4m3fn,
               "int4_per_token_head": torch.uint8}
_WRITE_ROWS = 16  # token-heads per program of the write kernel
_TILE_N = 64  # slots per tile of the dequantization kernel


def triton_backend(device: torch.device) -> bool:
    """Whether the Triton kernels can run on tensors of `device`: CUDA with Triton, or CPU under the interpreter."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def kernel_shape_ok(head_dim: int) -> bool:
    """The kernels take a power-of-two head_dim of 32 to 256 (tile widths are powers of two, products >= 16 wide)."""
    return 32 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def transform_mode(head_dim: int) -> int:
    """How the int4 tile loader computes H_{D/2} products of D/4-wide integer tiles: 2 = int8 tensor-core dot
    (D/4 >= 32, what int8 MMA takes), 1 = fp16 dot (16 <= D/4), 0 = broadcast sum (small heads). All exact."""
    q = head_dim // 4
    return 2 if q >= 32 else (1 if q >= 16 else 0)


@functools.cache
def _constants(head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(signs float32 [D], signs / D float32 [D], H_{D/2}'s even rows int8 [D/4, D/2], its odd rows int8): the
    rotation's diagonal and the inverse transform's matrices for the tile loader (D a power of two)."""
    signs = _rht_signs(head_dim, torch.device("cpu")).float()
    h = _hadamard(head_dim // 2, torch.device("cpu")).to(torch.int8)
    return (signs.to(device), (signs / head_dim).to(device), h[0::2].contiguous().to(device),
            h[1::2].contiguous().to(device))


@dataclass
class PackedLayer:
    """One layer's packed K and V: codes [B, n_kv, S, DC] and scales [B, n_kv, S] (None for per-tensor fp8)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None


class PackedKVCache:
    """The packed cache of every layer for B rows of S slots, and the write / read operations on it."""

    def __init__(self, codec: KVCodec, n_layers: int, batch: int, n_kv: int, slots: int, dtype: torch.dtype,
                 device: torch.device, backend: str | None = None) -> None:
        if codec.kind not in PACKED_KINDS:
            raise ValueError(f"packed KV cache: kind {codec.kind!r} is not packed; packed kinds: "
                             f"{', '.join(PACKED_KINDS)}")
        self.codec, self.kind, self.kind_id = codec, codec.kind, _KIND_ID[codec.kind]
        self.hadamard = bool(getattr(codec, "hadamard", False))
        self.head_dim, self.dtype, self.device = codec.head_dim, dtype, device
        self.batch, self.n_kv, self.slots = batch, n_kv, slots
        self.fp8_scale = float(getattr(codec, "scale", 1.0))
        self.fp8_inv_scale = float(getattr(codec, "inv_scale", 1.0))
        if backend is None:
            backend = "triton" if triton_backend(device) and kernel_shape_ok(self.head_dim) else "torch"
        if backend == "triton" and not (triton_backend(device) and kernel_shape_ok(self.head_dim)):
            raise ValueError(f"packed KV cache: the triton backend needs Triton on CUDA (or TRITON_INTERPRET=1) "
                             f"and a power-of-two head_dim in 32..256, got device {device}, head_dim "
                             f"{self.head_dim}")
        self.backend = backend
        D = self.head_dim
        dc = D // 2 if self.kind_id == KIND_INT4 else D
        code_dtype = _CODE_DTYPE[self.kind]
        scale_dtype = {KIND_INT4: torch.int32, KIND_FP8: None}.get(self.kind_id, torch.float32)

        def codes() -> torch.Tensor:
            return torch.zeros(batch, n_kv, slots, dc, dtype=torch.uint8, device=device).view(code_dtype)

        def scales() -> torch.Tensor | None:
            return None if scale_dtype is None else torch.zeros(batch, n_kv, slots, dtype=scale_dtype, device=device)

        self.layers = [PackedLayer(codes(), codes(), scales(), scales()) for _ in range(n_layers)]
        if self.backend == "triton":
            self.signs, self.signs_over_d, self.h_even, self.h_odd = _constants(D, device)

    def nbytes(self) -> int:
        """Device bytes of the whole cache (codes and scales of K and V, every layer)."""
        return sum(t.numel() * t.element_size() for layer in self.layers
                   for t in (layer.k, layer.v, layer.k_scale, layer.v_scale) if t is not None)

    # ---- write: the codec's codes of new K/V entries at slots slot .. slot + T - 1 ----

    def write(self, layer: PackedLayer, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor) -> None:
        """k, v [B, n_kv, T, D] (or [B, n_kv, D]: T = 1) into slots slot[0] + t; slot a long tensor [1] on the
        device (read by the kernel, so a captured graph writes where the step counter points)."""
        if k.dim() == 3:
            k, v = k.unsqueeze(2), v.unsqueeze(2)
        if self.backend == "torch":
            idx = slot + torch.arange(k.shape[2], device=slot.device)
            for x, codes, scale in ((k, layer.k, layer.k_scale), (v, layer.v, layer.v_scale)):
                st = self.codec.pack(x)  # one-byte codes copied as bytes (no index_copy_ for fp8 on CPU)
                codes.view(torch.uint8).index_copy_(2, idx, st.codes.to(codes.dtype).view(torch.uint8))
                if scale is not None:
                    scale.index_copy_(2, idx, self._scale_word(st))
            return
        k = k if k.stride(-1) == 1 else k.contiguous()
        v = v if v.stride(-1) == 1 else v.contiguous()
        B, n_kv, T, D = k.shape
        rows = B * n_kv * T
        ks = layer.k if layer.k_scale is None else layer.k_scale
        vs = layer.v if layer.v_scale is None else layer.v_scale
        grid = (triton.cdiv(rows, _WRITE_ROWS), 2)
        _kv_write_kernel[grid](
            k, v, layer.k, layer.v, ks, vs, slot, self.signs,
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            rows, n_kv, T, self.slots, self.fp8_inv_scale, _MIN_SCALE, _INV_127, _INV_15, _INV_FP8_MAX,
            KIND=self.kind_id, HADAMARD=self.hadamard, D=D, ROWS=_WRITE_ROWS, LOG2D=D.bit_length() - 1,
            enable_fp_fusion=False, num_warps=4)

    def _scale_word(self, st: KVState) -> torch.Tensor:
        if self.kind_id == KIND_INT4:
            return (st.scale.view(torch.int32) | st.zero.to(torch.int32)).squeeze(-1)
        return st.scale.squeeze(-1)

    # ---- read: the codec's dequantized values ----

    def state(self, layer: PackedLayer, which: str, lo: int, hi: int) -> KVState:
        """The codec's KVState of slots [lo, hi) of K (`which` = "k") or V, for codec.unpack."""
        codes = (layer.k if which == "k" else layer.v)[:, :, lo:hi]
        scale = (layer.k_scale if which == "k" else layer.v_scale)
        zero = None
        if scale is not None:
            scale = scale[:, :, lo:hi].unsqueeze(-1)
            if self.kind_id == KIND_INT4:
                zero = (scale & 15).to(torch.uint8)
                scale = (scale & -16).view(torch.float32)
        return KVState(codes, scale, zero, self.dtype, self.head_dim)

    def values(self, layer: PackedLayer, hi: int, lo: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of slots [lo, hi) as the codec returns them: [B, n_kv, hi - lo, D] in the cache's dtype."""
        if self.backend == "torch":
            return (self.codec.unpack(self.state(layer, "k", lo, hi)),
                    self.codec.unpack(self.state(layer, "v", lo, hi)))
        return self._dequant(layer.k, layer.k_scale, lo, hi), self._dequant(layer.v, layer.v_scale, lo, hi)

    def _dequant(self, codes: torch.Tensor, scale: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor:
        B, n_kv, S, _ = codes.shape
        T, D = hi - lo, self.head_dim
        out = torch.empty(B, n_kv, T, D, dtype=self.dtype, device=codes.device)
        if T <= 0:
            return out
        grid = (B * n_kv, triton.cdiv(T, _TILE_N))
        _kv_dequant_kernel[grid](codes, codes if scale is None else scale, out, self.h_even, self.h_odd,
                                 self.signs_over_d, self.fp8_scale, lo, T, S, KIND=self.kind_id,
                                 HADAMARD=self.hadamard, D=D, DC=codes.shape[-1], BLOCK_N=_TILE_N,
                                 TMODE=transform_mode(D),
                                 num_warps=4)
        return out


def cache_bytes_per_row(codec: KVCodec | None, n_layers: int, n_kv: int, slots: int, elem_size: int = 2,
                        packed: bool = True) -> float:
    """KV-cache bytes one batch row takes over `slots` slots: packed codes and scales (the codec's
    bytes_per_token_head) or, unpacked, `elem_size`-byte values (the bf16 cache, and the simulated formats)."""
    per_head = (codec.bytes_per_token_head() if packed and codec is not None and codec.kind in PACKED_KINDS
                else codec.head_dim * elem_size if codec is not None else None)
    if per_head is None:
        raise ValueError("cache_bytes_per_row: pass the codec (its head_dim sizes the bf16 cache too)")
    return 2.0 * n_layers * n_kv * slots * per_head


if triton is not None:
    @triton.jit
    def _round_half_away(y):
        y = y + tl.where(y >= 0, 0.5, -0.5)
        return tl.where(y >= 0, tl.floor(y), tl.ceil(y))

    @triton.jit
    def _quant_store(x_ptr, sb, sh, st, c_ptr, s_ptr, sgn_ptr, slot0, pid, NR, n_kv, T, S, fp8_inv, min_scale,
                     inv127, inv15, inv448, KIND: tl.constexpr, HADAMARD: tl.constexpr, D: tl.constexpr,
                     ROWS: tl.constexpr, LOG2D: tl.constexpr):
        """ROWS token-heads (flat index over b, head, t) of x [B, n_kv, T, D] -> codes and scales at cache row
        (b, head, slot0 + t): kv.py's codec operations one for one (float32, IEEE divisions, no FMA: the
        kernel is compiled with enable_fp_fusion=False)."""
        rows = pid * ROWS + tl.arange(0, ROWS)
        ok = rows < NR
        t = rows % T
        bh = rows // T
        src = (bh // n_kv).to(tl.int64) * sb + (bh % n_kv).to(tl.int64) * sh + t.to(tl.int64) * st
        cols = tl.arange(0, D)
        raw = tl.load(x_ptr + src[:, None] + cols[None, :], mask=ok[:, None], other=0.0)
        dst = bh.to(tl.int64) * S + slot0 + t
        _encode_store(raw, ok, dst, c_ptr, s_ptr, sgn_ptr, fp8_inv, min_scale, inv127, inv15, inv448, KIND,
                      HADAMARD, D, ROWS, LOG2D)

    @triton.jit
    def _encode_store(raw, ok, dst, c_ptr, s_ptr, sgn_ptr, fp8_inv, min_scale, inv127, inv15, inv448,
                      KIND: tl.constexpr, HADAMARD: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                      LOG2D: tl.constexpr):
        """ROWS token-heads raw [ROWS, D] (valid where ok) -> codes and scales at cache rows dst: the codec's
        operations (see _quant_store). Shared with the fused pre-attention kernel (parity.rollout.pre_attention)."""
        cols = tl.arange(0, D)
        x = raw.to(tl.float32)
        one = tl.full([ROWS], 1.0, tl.float32)
        if KIND == 4:
            if HADAMARD:  # kv.hadamard_rotate: the sign diagonal, then kv._fwht's butterflies, stage h = 1, 2, 4..
                x = x * tl.load(sgn_ptr + cols)[None, :]
                for i in tl.static_range(LOG2D):
                    partner = tl.gather(x, tl.broadcast_to((cols ^ (1 << i))[None, :], (ROWS, D)), 1)
                    x = tl.where((cols & (1 << i))[None, :] != 0, partner - x, x + partner)
                x = x.to(raw.dtype).to(tl.float32)
            lo = tl.minimum(tl.min(x, 1), 0.0)
            hi = tl.maximum(tl.max(x, 1), 0.0)
            scale = tl.maximum((hi - lo) * inv15, min_scale)
            zero = tl.minimum(tl.maximum(_round_half_away(tl.math.div_rn(-lo, scale)), 0.0), 15.0)
            y = x * tl.math.div_rn(one, scale)[:, None]
            y = y + zero[:, None]
            q = tl.minimum(tl.maximum(_round_half_away(y), 0.0), 15.0).to(tl.uint8)
            even, odd = tl.split(tl.reshape(q, (ROWS, D // 2, 2)))
            j = tl.arange(0, D // 2)
            tl.store(c_ptr + dst[:, None] * (D // 2) + j[None, :], even | (odd << 4), mask=ok[:, None])
            word = (scale.to(tl.int32, bitcast=True) & -16) | zero.to(tl.int32)
            tl.store(s_ptr + dst, word, mask=ok)
        elif KIND == 1:
            scale = tl.maximum(tl.max(tl.abs(x), 1) * inv127, min_scale)
            y = _round_half_away(x * tl.math.div_rn(one, scale)[:, None])
            q = tl.minimum(tl.maximum(y, -128.0), 127.0).to(tl.int8)
            tl.store(c_ptr + dst[:, None] * D + cols[None, :], q, mask=ok[:, None])
            tl.store(s_ptr + dst, scale, mask=ok)
        elif KIND == 3:
            scale = tl.maximum(tl.max(tl.abs(x), 1) * inv448, min_scale)
            y = x * tl.math.div_rn(one, scale)[:, None]
            q = tl.minimum(tl.maximum(y, -448.0), 448.0).to(tl.float8e4nv)
            tl.store(c_ptr + dst[:, None] * D + cols[None, :], q, mask=ok[:, None])
            tl.store(s_ptr + dst, scale, mask=ok)
        elif KIND == 2:
            q = tl.minimum(tl.maximum(x * fp8_inv, -448.0), 448.0).to(tl.float8e4nv)
            tl.store(c_ptr + dst[:, None] * D + cols[None, :], q, mask=ok[:, None])
        else:
            tl.store(c_ptr + dst[:, None] * D + cols[None, :], raw.to(c_ptr.dtype.element_ty), mask=ok[:, None])

    @triton.jit
    def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr, sgn_ptr, ksb, ksh, kst, vsb, vsh,
                         vst, NR, n_kv, T, S, fp8_inv, min_scale, inv127, inv15, inv448, KIND: tl.constexpr,
                         HADAMARD: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, LOG2D: tl.constexpr):
        """Grid (row blocks, 2): axis 1 picks K or V, so one launch writes both."""
        pid = tl.program_id(0)
        slot0 = tl.load(slot_ptr)
        if tl.program_id(1) == 0:
            _quant_store(k_ptr, ksb, ksh, kst, kc_ptr, ks_ptr, sgn_ptr, slot0, pid, NR, n_kv, T, S, fp8_inv,
                         min_scale, inv127, inv15, inv448, KIND, HADAMARD, D, ROWS, LOG2D)
        else:
            _quant_store(v_ptr, vsb, vsh, vst, vc_ptr, vs_ptr, sgn_ptr, slot0, pid, NR, n_kv, T, S, fp8_inv,
                         min_scale, inv127, inv15, inv448, KIND, HADAMARD, D, ROWS, LOG2D)

    @triton.jit
    def _kv_consts(he_ptr, ho_ptr, sg_ptr, KIND: tl.constexpr, HADAMARD: tl.constexpr, D: tl.constexpr):
        """What the tile loader needs once per program: H_{D/2}'s even and odd rows and signs / D by halves."""
        if KIND == 4 and HADAMARD:
            r = tl.arange(0, D // 4)
            c = tl.arange(0, D // 2)
            he = tl.load(he_ptr + r[:, None] * (D // 2) + c[None, :])
            ho = tl.load(ho_ptr + r[:, None] * (D // 2) + c[None, :])
            return he, ho, tl.load(sg_ptr + c), tl.load(sg_ptr + D // 2 + c)
        else:
            return 0, 0, 0, 0

    @triton.jit
    def _kv_cols(KIND: tl.constexpr, HADAMARD: tl.constexpr, D: tl.constexpr):
        """The head columns of the tile loader's two halves: even / odd for unrotated int4 (the nibble order),
        [0, D/2) / [D/2, D) otherwise."""
        j = tl.arange(0, D // 2)
        if KIND == 4 and not HADAMARD:
            return 2 * j, 2 * j + 1
        else:
            return j, j + D // 2

    @triton.jit
    def _hdot(u_lo, u_hi, he, ho, TMODE: tl.constexpr):
        """u @ H_{D/2} for a tile u [N, D/2] of integers in [-30, 30] given by its even (u_lo) and odd (u_hi)
        columns [N, D/4]: float32, exact (integers below 2**24 whatever the summation order)."""
        if TMODE == 2:
            acc = tl.dot(u_lo.to(tl.int8), he, out_dtype=tl.int32)
            acc = tl.dot(u_hi.to(tl.int8), ho, acc, out_dtype=tl.int32)
            return acc.to(tl.float32)
        elif TMODE == 1:
            acc = tl.dot(u_lo.to(tl.float16), he.to(tl.float16), out_dtype=tl.float32)
            return tl.dot(u_hi.to(tl.float16), ho.to(tl.float16), acc, out_dtype=tl.float32)
        else:
            lo = tl.sum(u_lo[:, :, None] * he.to(tl.int32)[None, :, :], 1)
            hi = tl.sum(u_hi[:, :, None] * ho.to(tl.int32)[None, :, :], 1)
            return (lo + hi).to(tl.float32)

    @triton.jit
    def _kv_tile(c_ptr, s_ptr, offs, ok, he, ho, sg0, sg1, fp8_scale, KIND: tl.constexpr, HADAMARD: tl.constexpr,
                 D: tl.constexpr, OUT: tl.constexpr, TMODE: tl.constexpr):
        """Slots `offs` [N] of one (row, head) of the cache (c_ptr / s_ptr at its slot 0) dequantized: two tiles
        [N, D/2] in dtype OUT holding the head columns _kv_cols gives, equal bit for bit to the codec's unpack."""
        rows = offs.to(tl.int64)
        if KIND == 4:
            w = tl.load(s_ptr + rows, mask=ok, other=0)
            z = w & 15
            s = (w & -16).to(tl.float32, bitcast=True)
            if HADAMARD:
                # element i of the head is nibble i % 2 of byte i // 2: bytes [0, D/4) hold the first half.
                # H_D = [[H', H'], [H', -H']] (H' = H_{D/2}): t = [(a + b) H', (a - b) H'] for halves a, b
                Q4: tl.constexpr = D // 4
                j = tl.arange(0, Q4)
                base = c_ptr + rows[:, None] * (D // 2) + j[None, :]
                a = tl.load(base, mask=ok[:, None], other=0)
                b = tl.load(base + Q4, mask=ok[:, None], other=0)
                zc = z[:, None]
                a_lo, a_hi = (a & 15).to(tl.int32) - zc, (a >> 4).to(tl.int32) - zc
                b_lo, b_hi = (b & 15).to(tl.int32) - zc, (b >> 4).to(tl.int32) - zc
                t0 = _hdot(a_lo + b_lo, a_hi + b_hi, he, ho, TMODE)
                t1 = _hdot(a_lo - b_lo, a_hi - b_hi, he, ho, TMODE)
                x0 = ((t0 * s[:, None]) * sg0[None, :]).to(OUT)
                x1 = ((t1 * s[:, None]) * sg1[None, :]).to(OUT)
            else:
                j = tl.arange(0, D // 2)
                c = tl.load(c_ptr + rows[:, None] * (D // 2) + j[None, :], mask=ok[:, None], other=0)
                zf = z.to(tl.float32)[:, None]
                x0 = (((c & 15).to(tl.float32) - zf) * s[:, None]).to(OUT)
                x1 = (((c >> 4).to(tl.float32) - zf) * s[:, None]).to(OUT)
        else:
            j = tl.arange(0, D // 2)
            base = c_ptr + rows[:, None] * D + j[None, :]
            c0 = tl.load(base, mask=ok[:, None], other=0.0)  # (an int `other` cannot be cast to fp8)
            c1 = tl.load(base + D // 2, mask=ok[:, None], other=0.0)
            if KIND == 1 or KIND == 3:
                s = tl.load(s_ptr + rows, mask=ok, other=0.0)[:, None]
                x0 = (c0.to(tl.float32) * s).to(OUT)
                x1 = (c1.to(tl.float32) * s).to(OUT)
            elif KIND == 2:
                x0 = (c0.to(tl.float32) * fp8_scale).to(OUT)
                x1 = (c1.to(tl.float32) * fp8_scale).to(OUT)
            else:
                x0 = c0.to(OUT)
                x1 = c1.to(OUT)
        return x0, x1

    @triton.jit
    def _kv_dequant_kernel(c_ptr, s_ptr, o_ptr, he_ptr, ho_ptr, sg_ptr, fp8_scale, lo, T, S, KIND: tl.constexpr,
                           HADAMARD: tl.constexpr, D: tl.constexpr, DC: tl.constexpr, BLOCK_N: tl.constexpr,
                           TMODE: tl.constexpr):
        """Slots [lo, lo + T) of every (row, head) -> o [B, n_kv, T, D]: the attention kernel's own tile loader."""
        bh = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = offs < T
        he, ho, sg0, sg1 = _kv_consts(he_ptr, ho_ptr, sg_ptr, KIND, HADAMARD, D)
        x0, x1 = _kv_tile(c_ptr + bh * S * DC, s_ptr + bh * S, lo + offs, ok, he, ho, sg0, sg1, fp8_scale, KIND,
                          HADAMARD, D, o_ptr.dtype.element_ty, TMODE)
        col0, col1 = _kv_cols(KIND, HADAMARD, D)
        out = o_ptr + (bh * T + offs)[:, None] * D
        tl.store(out + col0[None, :], x0, mask=ok[:, None])
        tl.store(out + col1[None, :], x1, mask=ok[:, None])
