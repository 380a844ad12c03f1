"""QuantLinear: a rollout-only Linear whose weight is stored INT8 or FP8 with per-output-channel scales.

The forward computes what an inference kernel computes, so the torch engine's numerics are the
quantized policy's (pi_inf), not BF16's:

    W8A8 INT8   x -> int8 with a dynamic per-token scale sx; acc = xq @ wq^T in int32 (exact);
                y = acc * sx * sw in float32, then cast to x's dtype (+ bias)
    W8A8 FP8    same with E4M3 codes; the product of two E4M3 codes is exact in float32
    weight-only w_hat = wq * sw in x's dtype; y = x @ w_hat^T
    integer codes on both sides of other widths (W4A4: per-token RTN INT4 activations, codes in [-7, 7], times
                per-channel INT4 weights; W8A4, W4A8): the same as W8A8 INT8 on the codes: an exact int32
                accumulator, then acc * sx * sw in float32 and one cast (what an integer kernel computes)
    others      (e.g. int8 weights with fp8 activations, fp8 weights with int4 activations) quantize/dequantize
                both, float32 matmul

Which kernel runs is reported by `QuantLinear.path`:
    int8_triton      CUDA with Triton (parity.precision.int8_triton): the int8 product with the rescale fused in,
                     one Triton kernel, and in eager code the per-token quantization as one more (inside a graph
                     compiled by Inductor the quantization stays torch ops, which Inductor fuses into the op that
                     produced x). Bit-identical to int8_mm_cuda, checked on the device before it is chosen;
                     PARITY_INT8_TRITON=0 turns it off
    int8_mm_cuda     torch._int_mm on CUDA (cuBLASLt int8 GEMM), then the rescale
    int8_simulated   integer codes multiplied by float32 GEMMs over K-chunks small enough to be exact (the
                     same int32 accumulator; the CPU default)
    int8_mm_cpu      torch._int_mm on CPU (exact too; selectable, slower on AVX2 CPUs)
    fp8_scaled_mm    torch._scaled_mm with row-wise scales (CUDA sm_89+, or CPU)
    fp8_simulated    codes in float32 (same up to summation order)
    int_codes_triton, int_codes_mm_cuda, int_codes
                     integer codes of other widths on both sides, through int8_triton's kernel, cuBLASLt's int8
                     GEMM or the exact float32 GEMMs (CPU): the same integer sum and epilogue, so the same bits on
                     every path of a device for the same codes. PARITY_INT_CODES=0 selects the float32 product of the dequantized codes instead
                     (w<W>a<A>_simulated, the form before: each product and sum rounded to float32, then the cast)
    int8_weight_only, fp8_weight_only, w<W>a<A>_simulated, bf16
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from parity.precision.formats import (
    ACTIVATION_FORMATS,
    FP8_DTYPE,
    INT3_QMAX,
    INT4_QMAX,
    INT8_QMAX,
    WEIGHT_FORMATS,
    dequantize,
    fake_quantize,
    quantize_rowwise,
)
from parity.precision.int8_gemm import int8_gemm

_int8_gemm = int8_gemm  # the name the tests and benchmarks know

_STORAGE_DTYPE = {"int8": torch.int8, "fp8": FP8_DTYPE, "int4": torch.int8, "int3": torch.int8}
# formats whose codes are integers in int8 storage: any two multiply exactly in an int32 accumulator
INT_CODE_FORMATS = ("int8", "int4", "int3")
INT_CODE_PATHS = ("int_codes_triton", "int_codes_mm_cuda", "int_codes")
_QMAX = {"int8": INT8_QMAX, "int4": INT4_QMAX, "int3": INT3_QMAX}  # the largest code of each integer format


def check_formats(weights: str, activations: str) -> None:
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"precision.weights: unknown format {weights!r}; known: {', '.join(WEIGHT_FORMATS)}")
    if activations not in ACTIVATION_FORMATS:
        raise ValueError(f"precision.activations: unknown format {activations!r}; "
                         f"known: {', '.join(ACTIVATION_FORMATS)}")


@functools.cache
def _scaled_mm_works(device_type: str, device_index: int | None) -> bool:
    """Probe torch._scaled_mm once per device with the call quant_linear_forward makes: row-wise float32 scales
    ([M, 1] per token, [1, N] per channel) that differ from row to row, M != N, and each output dtype the
    path writes on that device. Support depends on build and chip: some CPU builds take per-tensor scales only
    and either refuse row-wise ones or apply one scale to every row, which uniform scales would not reveal.
    Anything but the exact simulation's result means no (the layer then takes the `fp8_simulated` path)."""
    if not hasattr(torch, "_scaled_mm"):
        return False
    dev = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (8, 9):
        return False
    m, k, n = 16, 32, 48
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-1, 1, m).unsqueeze(1)).to(dev)
    w = (torch.randn(n, k, generator=g) * torch.logspace(1, -1, n).unsqueeze(1)).to(dev)
    xq, xs = quantize_rowwise(x, "fp8")
    wq, ws = quantize_rowwise(w, "fp8")
    want = (xq.float() @ wq.float().t()) * xs * ws.t()
    for out_dtype in ((torch.bfloat16,) if dev.type == "cuda" else (torch.float32, torch.bfloat16)):
        try:
            got = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t().contiguous(), out_dtype=out_dtype)
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            return False
        # float32: summation order only; bf16: one rounding to 8 significant bits. A scale applied to the wrong
        # rows is off by up to the 100x spread of the scales.
        tol = 1e-4 if out_dtype == torch.float32 else 2.0 ** -7
        if got.shape != want.shape or not torch.allclose(got.float(), want, rtol=tol, atol=tol * 1e-3):
            return False
    return True


def select_path(weights: str, activations: str, device: torch.device, in_features: int,
                out_features: int) -> str:
    """The kernel a layer of this shape on this device uses (see the module docstring)."""
    check_formats(weights, activations)
    if weights == "bf16" and activations == "bf16":
        return "bf16"
    if activations == "bf16":
        return f"{weights}_weight_only"
    if weights != activations or weights not in ("int8", "fp8"):
        if weights in INT_CODE_FORMATS and activations in INT_CODE_FORMATS \
                and os.environ.get("PARITY_INT_CODES", "1") != "0":
            return _int_codes_path(device, in_features, out_features)
        # other mixed formats: fake-quantize both sides
        return f"w{weights}a{activations}_simulated"
    if weights == "int8":
        if device.type == "cuda":
            # cuBLASLt int8 GEMM needs K and N multiples of 8 (M is padded at call time)
            aligned = in_features % 8 == 0 and out_features % 8 == 0
            if not aligned:
                return "int8_simulated"
            from parity.precision import int8_triton
            return "int8_triton" if int8_triton.usable(device.index or 0) else "int8_mm_cuda"
        # On CPU torch._int_mm is exact but slower than even an emulated bf16 GEMM on AVX2 machines
        # (docs/CPU_PERFORMANCE.md); exact float32 GEMMs over K-chunks give the same integers faster.
        return "int8_simulated"
    aligned = device.type != "cuda" or (in_features % 16 == 0 and out_features % 16 == 0)
    if aligned and _scaled_mm_works(device.type, device.index if device.type == "cuda" else None):
        return "fp8_scaled_mm"
    return "fp8_simulated"


def _int_codes_path(device: torch.device, in_features: int, out_features: int) -> str:
    """The int8 products' choice (int8_triton, cuBLASLt, exact float32 GEMMs) for integer codes of other widths."""
    if device.type != "cuda" or in_features % 8 or out_features % 8:
        return "int_codes"
    from parity.precision import int8_triton
    return "int_codes_triton" if int8_triton.usable(device.index or 0) else "int_codes_mm_cuda"


# quant_linear_forward's path for a simulated (w<W>a<A>_simulated) product whose weight is given already dequantized
PREPARED = "simulated_prepared"


def is_simulated(path: str, weights: str, activations: str) -> bool:
    """Whether `path` is the fake-quantized product of mixed formats (W4A4 among them), whose float32 weight
    simulated_weight computes."""
    return path == f"w{weights}a{activations}_simulated"


def simulated_weight(wq: torch.Tensor, w_scale: torch.Tensor, weights: str) -> torch.Tensor:
    """The float32 w_hat a simulated product multiplies by: the codes times their scales (bf16 weights: as they
    are). It changes only when the weights do, so a caller that runs many products between weight updates (the
    CUDA decode path) computes it once per update and passes it with path PREPARED: the same numbers, one
    dequantization a weight sync instead of one a product."""
    return wq.float() if weights == "bf16" else dequantize(wq, w_scale)


def quant_linear_forward(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                         weights: str, activations: str, path: str) -> torch.Tensor:
    """y = x W^T (+ b) with W given as codes `wq` [N, K] and scales `w_scale` [N, 1]; see module doc."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if path == "bf16":
        y = F.linear(x2, wq.to(x.dtype))
    elif path.endswith("_weight_only"):
        y = F.linear(x2, dequantize(wq, w_scale, x.dtype))
    elif path == "int8_triton":
        if torch.compiler.is_compiling():
            xq, xs = quantize_rowwise(x2, "int8")
        else:  # eager (the prefill): one pass instead of torch's seven over a [tokens x K] float32 copy
            xq, xs = torch.ops.parity.int8_quant_rows(x2.contiguous())
        y = torch.ops.parity.w8a8_mm(xq, wq, xs, w_scale, x.dtype)
    elif path in ("int8_mm_cuda", "int8_mm_cpu", "int8_simulated"):
        xq, xs = quantize_rowwise(x2, "int8")
        acc = int8_gemm(xq, wq, path)
        y = (acc.float() * xs * w_scale.t()).to(x.dtype)
    elif path in INT_CODE_PATHS:  # the codes of x in the activations' format (from float32, as the simulated path)
        xq, xs = quantize_rowwise(x2.float(), activations)
        if path == "int_codes_triton":
            y = torch.ops.parity.w8a8_mm(xq, wq, xs, w_scale, x.dtype)
        elif path == "int_codes" and k * _QMAX[activations] * _QMAX[weights] < 2 ** 24:
            # every partial sum of code products is an integer below 2^24: one float32 GEMM is exact, and its
            # result is the int32 accumulator's value (no round trip through int32)
            y = (xq.float() @ wq.float().t()).mul_(xs).mul_(w_scale.t()).to(x.dtype)
        else:
            acc = int8_gemm(xq, wq, "int8_mm_cuda" if path == "int_codes_mm_cuda" else "int8_simulated")
            y = (acc.float() * xs * w_scale.t()).to(x.dtype)
    elif path == "fp8_scaled_mm":
        xq, xs = quantize_rowwise(x2, "fp8")
        # row-wise scaled FP8 GEMM on CUDA (sm_90) writes bfloat16 only; the CPU kernel also writes float32
        out_dtype = torch.bfloat16 if xq.is_cuda or x.dtype == torch.bfloat16 else torch.float32
        y = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=w_scale.t().contiguous(),
                             out_dtype=out_dtype).to(x.dtype)
    elif path == "fp8_simulated":
        xq, xs = quantize_rowwise(x2, "fp8")
        y = ((xq.float() @ wq.float().t()) * xs * w_scale.t()).to(x.dtype)
    elif path == PREPARED:  # `wq` is already simulated_weight's float32 w_hat (the decode path's cached copy)
        y = F.linear(fake_quantize(x2.float(), activations), wq).to(x.dtype)
    else:  # mixed formats: fake-quantize both sides
        y = F.linear(fake_quantize(x2.float(), activations), simulated_weight(wq, w_scale, weights)).to(x.dtype)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*lead, y.shape[-1])


class QuantLinear(nn.Module):
    """Drop-in for nn.Linear at inference. State (what a compressed-tensors checkpoint stores):
    `weight` codes [out, in] (int8, float8_e4m3fn, or bfloat16 when weights=bf16),
    `weight_scale` float32 [out, 1], optional `bias`. No gradients: rollout only."""

    def __init__(self, in_features: int, out_features: int, weights: str, activations: str,
                 bias: bool = False, device: torch.device | str | None = None,
                 bias_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        check_formats(weights, activations)
        self.in_features, self.out_features = in_features, out_features
        self.weights, self.activations = weights, activations
        store = _STORAGE_DTYPE.get(weights, torch.bfloat16)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=store, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, 1, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype, device=device) if bias else None)
        self.path = select_path(weights, activations, self.weight.device, in_features, out_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, weights: str, activations: str) -> QuantLinear:
        w = linear.weight
        q = cls(linear.in_features, linear.out_features, weights, activations, bias=linear.bias is not None,
                device=w.device, bias_dtype=linear.bias.dtype if linear.bias is not None else torch.bfloat16)
        q.set_weight(w.detach())
        if linear.bias is not None:
            q.set_bias(linear.bias.detach())
        return q

    @torch.no_grad()
    def set_weight(self, w: torch.Tensor) -> None:
        """Re-quantize from a new full-precision weight, in place (same storage: weight sync)."""
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise ValueError(f"QuantLinear.set_weight: shape {tuple(w.shape)} != "
                             f"{(self.out_features, self.in_features)}")
        w = w.to(self.weight.device)
        if self.weights == "bf16":
            self.weight.copy_(w.to(torch.bfloat16))
            return
        q, s = quantize_rowwise(w, self.weights)
        self.weight.copy_(q)
        self.weight_scale.copy_(s)

    @torch.no_grad()
    def set_rows(self, start: int, w_rows: torch.Tensor) -> None:
        """Re-quantize rows [start, start + len) only; per-channel scales make rows independent."""
        stop = start + w_rows.shape[0]
        if w_rows.shape[1] != self.in_features or stop > self.out_features:
            raise ValueError(f"QuantLinear.set_rows: rows {start}:{stop} x {w_rows.shape[1]} do not fit "
                             f"{(self.out_features, self.in_features)}")
        w_rows = w_rows.to(self.weight.device)
        if self.weights == "bf16":
            self.weight[start:stop].copy_(w_rows.to(torch.bfloat16))
            return
        q, s = quantize_rowwise(w_rows, self.weights)
        self.weight[start:stop].copy_(q)
        self.weight_scale[start:stop].copy_(s)

    @torch.no_grad()
    def set_bias(self, b: torch.Tensor) -> None:
        if self.bias is None:
            raise ValueError("QuantLinear.set_bias: this layer was built without a bias")
        self.bias.copy_(b)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype) if self.weights == "bf16" else dequantize(self.weight, self.weight_scale, dtype)

    def _apply(self, fn, recurse=True):  # noqa: ANN001 - nn.Module signature
        # `model.to(torch.bfloat16)` must not cast the codes (float8 counts as floating point) or the
        # float32 scales: take only the device from `fn`; the bias follows the model's dtype.
        device = fn(torch.zeros(0, device=self.weight.device)).device
        for name in ("weight", "weight_scale"):
            self._buffers[name] = self._buffers[name].to(device)
        if self._buffers.get("bias") is not None:
            self._buffers["bias"] = fn(self._buffers["bias"])
        # a move to another device can change which kernel is available
        self.path = select_path(self.weights, self.activations, device, self.in_features, self.out_features)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear_forward(x, self.weight, self.weight_scale, self.bias, self.weights,
                                    self.activations, self.path)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, weights={self.weights}, "
                f"activations={self.activations}, path={self.path}")
