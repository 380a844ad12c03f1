"""KV-cache codecs: how a key or value vector is stored in the rollout engine's cache.

The torch engine calls `codec.roundtrip(x)` on every new K/V entry before writing it into its cache,
so attention reads exactly what a quantized cache would return. Each codec works on the last
dimension (one head of one token, D = head_dim): "per token-head" scales.

kinds (the numerics of vLLM 0.32's kernels of the same name, see vllm/v1/attention/ops/):
    bf16                 stored in bfloat16
    int8                 (= vLLM int8_per_token_head) symmetric, s = max(max|x| / 127, 1e-6),
                         q = round_half_away(x / s) in [-128, 127]
    fp8                  (= vLLM fp8 without calibration) E4M3 with one per-tensor scale (default 1.0),
                         saturating at +-448
    fp8_per_token_head   E4M3, s = max(max|x| / 448, 1e-6)
    int4_per_token_head  asymmetric over [min(x, 0), max(x, 0)]: s = max((max - min) / 15, 1e-6), zero point
                         z = clamp(round_half_away(-min / s), 0, 15), q = clamp(round_half_away(x / s + z),
                         0, 15), x_hat = (q - z) s, |x - x_hat| <= s / 2; two codes per byte (element 2i in the low nibble,
                         2i + 1 in the high one). vLLM hides z in the 4 low mantissa bits of the float32
                         scale, so dequantization uses s with those bits cleared: mirrored here. vLLM also
                         rotates K/V (and Q) by a randomized Hadamard transform before quantizing; with
                         `hadamard=True` (default) the codec quantizes H D x and returns the inverse
                         rotation of the result, which is what attention over the rotated cache computes.

Every operation is written so that a GPU kernel can reproduce its float32 bits (the packed cache of
parity.precision.kv_packed stores these codes and its kernels dequantize to exactly these values): divisions by
a constant are products with the float32 reciprocal (what torch does on CUDA for `tensor / scalar`, written out
so CPU and CUDA agree), other divisions are IEEE ones, and the Hadamard transform is butterflies in a fixed
order (`_fwht`) instead of a matrix product whose summation order is the BLAS library's. The inverse rotation
transforms the integers q - z (exact at any order) and multiplies by the scale once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from parity.precision.formats import FP8_DTYPE, FP8_MAX

KV_KINDS = ("bf16", "int8", "int4_per_token_head", "fp8", "fp8_per_token_head")
_ALIASES = {"int8_per_token_head": "int8", "fp8_e4m3": "fp8", "bfloat16": "bf16"}
_MIN_SCALE = 1e-6  # vLLM's floor for a per-token-head scale


def _f32_reciprocal(x: float) -> float:
    """float32(1) / float32(x), correctly rounded: the factor torch on CUDA multiplies by for `tensor / x`."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(x, dtype=torch.float32))


_INV_127, _INV_15, _INV_FP8_MAX = _f32_reciprocal(127.0), _f32_reciprocal(15.0), _f32_reciprocal(FP8_MAX)


@dataclass
class KVState:
    """A packed cache entry: codes plus per token-head scale / zero point (None where unused)."""

    codes: torch.Tensor
    scale: torch.Tensor | None
    zero: torch.Tensor | None
    dtype: torch.dtype  # dtype of the tensor that was packed (unpack returns it)
    head_dim: int


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    # vLLM's kernels add +-0.5 and truncate; torch.round would round half to even
    return torch.trunc(x + torch.where(x >= 0, 0.5, -0.5))


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 15], last dim D even -> uint8 [..., D / 2]: low nibble = even index."""
    q = q.to(torch.uint8)
    return (q[..., 0::2] & 0xF) | ((q[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0xF, (packed >> 4) & 0xF
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def _largest_pow2_divisor(n: int) -> int:
    return n & -n


@functools.cache
def _hadamard(block: int, device: torch.device) -> torch.Tensor:
    """Unnormalised Sylvester-Hadamard matrix H_b (H H^T = b I), float32, symmetric."""
    h = torch.ones(1, 1)
    while h.shape[0] < block:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.to(device)


@functools.cache
def _rht_signs(block: int, device: torch.device) -> torch.Tensor:
    """The deterministic +-1 diagonal vLLM uses for its randomized Hadamard transform."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(0x9E3779B9)
    return (2.0 * torch.bernoulli(torch.full((block,), 0.5), generator=gen) - 1.0).to(device)


def _fwht(x: torch.Tensor) -> torch.Tensor:
    """x @ H_b over the last dimension b (a power of two; H_b Sylvester's, as `_hadamard`), as butterflies in a
    fixed order: stage h = 1, 2, 4, ..., b / 2 maps each pair (x_i, x_{i+h}) with bit h of i clear to
    (x_i + x_{i+h}, x_i - x_{i+h}). A kernel that runs the same stages gets the same float32 bits."""
    *lead, b = x.shape
    h = 1
    while h < b:
        y = x.reshape(*lead, b // (2 * h), 2, h)
        a, c = y.select(-2, 0), y.select(-2, 1)
        x = torch.stack((a + c, a - c), dim=-2).reshape(*lead, b)
        h *= 2
    return x


def hadamard_rotate(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """y = H (d * x) per block of b = largest power-of-two divisor of D (float32). The inverse returns
    d * (H y) / b, so hadamard_rotate(hadamard_rotate(x), inverse=True) == x up to rounding."""
    d = x.shape[-1]
    b = _largest_pow2_divisor(d)
    signs = _rht_signs(b, x.device)
    xb = x.float().reshape(*x.shape[:-1], d // b, b)
    y = _fwht(xb) * signs / b if inverse else _fwht(xb * signs)
    return y.reshape(x.shape)


class KVCodec:
    """Base codec. Subclasses define `_encode` / `_decode`; `roundtrip` is unpack(pack(x))."""

    kind = "bf16"
    bits = 16

    def __init__(self, head_dim: int) -> None:
        if head_dim < 1:
            raise ValueError(f"KV codec {self.kind}: head_dim must be >= 1, got {head_dim}")
        self.head_dim = head_dim

    def _check(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"KV codec {self.kind}: last dim {x.shape[-1]} != head_dim {self.head_dim}")

    def pack(self, x: torch.Tensor) -> KVState:
        self._check(x)
        return self._encode(x)

    def unpack(self, state: KVState) -> torch.Tensor:
        return self._decode(state)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """What the cache returns for x: same shape and dtype as x."""
        return self.unpack(self.pack(x))

    def bytes_per_token_head(self) -> float:
        """Cache bytes of one head of one token, codes plus scale/zero (as vLLM lays them out)."""
        return self.head_dim * self.bits / 8

    def describe(self) -> dict:
        return {"kind": self.kind, "head_dim": self.head_dim, "bytes_per_token_head": self.bytes_per_token_head()}

    def _encode(self, x: torch.Tensor) -> KVState:
        return KVState(x.to(torch.bfloat16), None, None, x.dtype, self.head_dim)

    def _decode(self, s: KVState) -> torch.Tensor:
        return s.codes.to(s.dtype)


class Int8KVCodec(KVCodec):
    kind, bits = "int8", 8

    def _encode(self, x: torch.Tensor) -> KVState:
        xf = x.float()
        scale = (xf.abs().amax(-1, keepdim=True) * _INV_127).clamp_min(_MIN_SCALE)
        q = _round_half_away(xf * (1.0 / scale)).clamp_(-128, 127).to(torch.int8)
        return KVState(q, scale, None, x.dtype, self.head_dim)

    def _decode(self, s: KVState) -> torch.Tensor:
        return (s.codes.float() * s.scale).to(s.dtype)

    def bytes_per_token_head(self) -> float:
        return self.head_dim + 4.0


class Fp8KVCodec(KVCodec):
    """Per-tensor scale (vLLM's `fp8` cache with the uncalibrated default k_scale = v_scale = 1.0)."""

    kind, bits = "fp8", 8

    def __init__(self, head_dim: int, scale: float = 1.0) -> None:
        super().__init__(head_dim)
        if not scale > 0:
            raise ValueError(f"KV codec fp8: scale must be > 0, got {scale}")
        self.scale = float(scale)
        self.inv_scale = _f32_reciprocal(self.scale)

    def _encode(self, x: torch.Tensor) -> KVState:
        q = (x.float() * self.inv_scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return KVState(q, None, None, x.dtype, self.head_dim)

    def _decode(self, s: KVState) -> torch.Tensor:
        return (s.codes.float() * self.scale).to(s.dtype)


class Fp8PerTokenHeadKVCodec(KVCodec):
    kind, bits = "fp8_per_token_head", 8

    def _encode(self, x: torch.Tensor) -> KVState:
        xf = x.float()
        scale = (xf.abs().amax(-1, keepdim=True) * _INV_FP8_MAX).clamp_min(_MIN_SCALE)
        q = (xf * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return KVState(q, scale, None, x.dtype, self.head_dim)

    def _decode(self, s: KVState) -> torch.Tensor:
        return (s.codes.float() * s.scale).to(s.dtype)

    def bytes_per_token_head(self) -> float:
        return self.head_dim + 4.0


class Int4PerTokenHeadKVCodec(KVCodec):
    kind, bits = "int4_per_token_head", 4

    def __init__(self, head_dim: int, hadamard: bool = True) -> None:
        if head_dim % 2:
            raise ValueError(f"KV cache int4_per_token_head needs an even head_dim (two 4-bit values per "
                             f"byte), got head_dim={head_dim}")
        super().__init__(head_dim)
        self.hadamard = hadamard

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codes q (float, integral in [0, 15]), the dequantization scale and zero point per row."""
        xf = hadamard_rotate(x).to(x.dtype).float() if self.hadamard else x.float()
        # the grid must contain 0 (the zero point is a code in [0, 15]); vLLM takes min/max as they are,
        # which is the same whenever the row straddles 0 (nearly always after the rotation) and clamps
        # half the row otherwise
        lo = xf.amin(-1, keepdim=True).clamp_max(0.0)
        hi = xf.amax(-1, keepdim=True).clamp_min(0.0)
        scale = ((hi - lo) * _INV_15).clamp_min(_MIN_SCALE)
        zero = _round_half_away(-lo / scale).clamp_(0, 15)
        q = _round_half_away(xf * (1.0 / scale) + zero).clamp_(0, 15)
        # the zero point lives in the scale's 4 low mantissa bits in vLLM's cache: clear them
        scale_deq = (scale.view(torch.int32) & -16).view(torch.float32)
        return q, scale_deq, zero

    def _dequantize(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
        n = q.float() - zero.float()  # integers in [-15, 15]
        if not self.hadamard:
            return (n * scale).to(dtype)
        # the inverse rotation d * (H ((q - z) s)) / b as d * ((H (q - z)) s) / b: the transform of integers is
        # exact in float32, so the only roundings are the product with s and the cast
        d = n.shape[-1]
        b = _largest_pow2_divisor(d)
        t = _fwht(n.reshape(*n.shape[:-1], d // b, b))
        x = (t * scale.unsqueeze(-1)) * (_rht_signs(b, n.device) / b)
        return x.reshape(n.shape).to(dtype)

    def _encode(self, x: torch.Tensor) -> KVState:
        q, scale, zero = self._quantize(x)
        return KVState(pack_nibbles(q.to(torch.uint8)), scale, zero.to(torch.uint8), x.dtype, self.head_dim)

    def _decode(self, s: KVState) -> torch.Tensor:
        return self._dequantize(unpack_nibbles(s.codes), s.scale, s.zero, s.dtype)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        q, scale, zero = self._quantize(x)  # skip the nibble packing: same numbers, less work
        return self._dequantize(q, scale, zero, x.dtype)

    def bytes_per_token_head(self) -> float:
        return self.head_dim / 2 + 4.0  # codes + one float32 holding scale and zero point

    def describe(self) -> dict:
        return {**super().describe(), "hadamard": self.hadamard}


def canonical_kv_kind(kind: str) -> str:
    k = _ALIASES.get(kind, kind)
    if k not in KV_KINDS:
        raise ValueError(f"unknown KV cache kind {kind!r}; known: {', '.join(KV_KINDS)}")
    return k


def make_kv_codec(kind: str, head_dim: int, *, hadamard: bool = True, fp8_scale: float = 1.0) -> KVCodec:
    """The codec of a KV cache kind (see module docstring). int4 with an odd head_dim raises."""
    k = canonical_kv_kind(kind)
    if k == "bf16":
        return KVCodec(head_dim)
    if k == "int8":
        return Int8KVCodec(head_dim)
    if k == "fp8":
        return Fp8KVCodec(head_dim, fp8_scale)
    if k == "fp8_per_token_head":
        return Fp8PerTokenHeadKVCodec(head_dim)
    return Int4PerTokenHeadKVCodec(head_dim, hadamard=hadamard)
