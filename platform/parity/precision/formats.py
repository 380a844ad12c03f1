"""Number formats of the low-precision rollout: INT8, FP8 E4M3, INT4 and weight-only INT3, one scale per row.

A "row" is the last dimension: for a weight [out, in] one scale per output channel, for an
activation [..., in] one scale per token (computed on the fly, "dynamic"). Every function returns
(q, scale) with `scale` float32 shaped like the input with a last dimension of 1, so
`dequantize(q, scale) = q * scale` broadcasts.

Error bounds (x a row, a = max|x| over the row), all exact statements about these functions:
- INT8 symmetric, scale s = a / 127, q = round_half_even(x / s) in [-127, 127]:
      |x - q s| <= s / 2 = a / 254 for every element.
- INT4 / INT3 symmetric, the same with qmax 7 / 3: |x - q s| <= s / 2 = a / 14 (INT4), a / 6 (INT3).
  INT4 serves weights and activations (per-token dynamic scale a / 7), INT3 weights only.
- FP8 E4M3 (torch.float8_e4m3fn, 3 mantissa bits, max 448), s = a / 448, q = fp8(x / s)
  (round to nearest even):
      |x - q s| <= max(|x| * 2**-4, s * 2**-10)
  (half an ulp: relative 2**-4 in the normal range |x / s| >= 2**-6, absolute 2**-10 in units of s
  in the subnormal range).
The scale itself is computed in float32, so these bounds hold up to float32 rounding of x / s
(relative 2**-24), which the tests allow for.
"""

from __future__ import annotations

import torch

INT8_QMAX = 127
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448

INT4_QMAX = 7
INT3_QMAX = 3
# int4: weight-only RTN INT4 (symmetric, one scale per output channel, codes in [-7, 7] kept in an int8
# container); a harsher deployment format simulated by the torch engine only (not exported, not vLLM).
# int3: the same with codes in [-3, 3] (7 levels), harsher still (the corrections study's stress format)
WEIGHT_FORMATS = ("bf16", "int8", "fp8", "int4", "int3")
# int4 activations: per-token symmetric RTN INT4 with a dynamic scale max|token| / 7 (codes in [-7, 7]); fake-
# quantized by the torch engine only (no exported checkpoint, no vLLM), the harsh setting of the INT4-activation pilot (docs/study/pilot_a4.md)
ACTIVATION_FORMATS = ("bf16", "int8", "fp8", "int4")


def _row_scale(x: torch.Tensor, qmax: float) -> torch.Tensor:
    """max|x| / qmax over the last dim, float32, keepdim. An all-zero row gets scale 1 (its q is 0),
    so no division by zero and the bound still holds."""
    amax = x.detach().float().abs().amax(dim=-1, keepdim=True)
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax))


def quantize_int8_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 with one float32 scale per row (last dim): q in [-127, 127]."""
    scale = _row_scale(x, INT8_QMAX)
    q = torch.round(x.float() / scale).clamp_(-INT8_QMAX, INT8_QMAX).to(torch.int8)
    return q, scale


def _quantize_int_rowwise(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    scale = _row_scale(x, qmax)
    q = torch.round(x.float() / scale).clamp_(-qmax, qmax).to(torch.int8)
    return q, scale


def quantize_int4_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4 with one float32 scale per row (last dim): q in [-7, 7], stored as int8."""
    return _quantize_int_rowwise(x, INT4_QMAX)


def quantize_int3_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT3 with one float32 scale per row (last dim): q in [-3, 3], stored as int8."""
    return _quantize_int_rowwise(x, INT3_QMAX)


def quantize_fp8_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 with one float32 scale per row (last dim), the row's max maps to 448."""
    scale = _row_scale(x, FP8_MAX)
    # clamp before the cast: E4M3fn has no infinity, an overflowing cast would give NaN
    q = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q * scale in float32 (one rounding: a code of up to 8 significant bits times a 24-bit scale), then cast to
    `dtype`."""
    return (q.float() * scale.float()).to(dtype)


def quantize_rowwise(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch by format name: int8 | fp8 | int4 | int3."""
    if fmt == "int8":
        return quantize_int8_rowwise(x)
    if fmt == "fp8":
        return quantize_fp8_rowwise(x)
    if fmt == "int4":
        return quantize_int4_rowwise(x)
    if fmt == "int3":
        return quantize_int3_rowwise(x)
    raise ValueError(f"unknown quantized format {fmt!r}; known: int8, fp8, int4, int3")


def fake_quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Quantize then dequantize row-wise, same dtype as x; `bf16` rounds to bfloat16 only."""
    if fmt == "bf16":
        return x.to(torch.bfloat16).to(x.dtype)
    q, s = quantize_rowwise(x, fmt)
    return dequantize(q, s, x.dtype)
