"""The int32 accumulator of an int8 x int8 product, the same integers on every path.

QuantLinear's INT8 paths (parity.precision.linear) compute it, and the fused Triton kernel
(parity.precision.int8_triton) is held to it bit for bit; both import it from here, so neither imports the other
for it."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# K * 127 * 127 below 2**24 keeps every int32 accumulator exact in float32
FP32_EXACT_K = (1 << 24) // (127 * 127)


@functools.cache
def cpu_int_mm_exact() -> bool:
    """Whether torch._int_mm on this CPU returns the exact int32 products. oneDNN's int8 kernel for an ISA without
    VNNI multiplies pairs of codes into saturating 16-bit sums (vpmaddubsw), so codes near +-127 can come out wrong:
    seen with ONEDNN_MAX_CPU_ISA=AVX2 or AVX512_CORE on a VNNI CPU (torch still routes the product to oneDNN). The
    probe uses the codes that saturate such a sum, and random ones."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-127, 128, (20, 256), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (24, 256), generator=g, dtype=torch.int8)
    x[0], w[0], w[1] = 127, 127, -127
    try:
        got = torch._int_mm(x, w.t())
    except (RuntimeError, NotImplementedError):
        return False
    return torch.equal(got.long(), x.long() @ w.long().t())


def int8_gemm(xq: torch.Tensor, wq: torch.Tensor, path: str) -> torch.Tensor:
    """int32 accumulator xq @ wq^T for int8 xq [M, K], wq [N, K] by `path` (int8_mm_cuda: cuBLASLt,
    int8_mm_cpu: torch._int_mm, else float32 GEMMs over K-chunks small enough to be exact)."""
    if path == "int8_mm_cuda":
        m = xq.shape[0]
        if m <= 16 or m % 8:  # cuBLASLt's int8 GEMM wants M > 16 and M % 8 == 0: pad with zero rows
            pad = max(24, (m + 7) // 8 * 8) - m
            xq = F.pad(xq, (0, 0, 0, pad))
        return torch._int_mm(xq, wq.t())[:m]
    if path == "int8_mm_cpu":
        if not cpu_int_mm_exact():
            raise RuntimeError("int8 path int8_mm_cpu: torch._int_mm is not exact on this CPU (its oneDNN kernel "
                               "saturates without VNNI); use int8_simulated, the CPU default")
        return torch._int_mm(xq, wq.t())
    # every partial sum over <= FP32_EXACT_K products of int8 codes is an integer below 2**24: exact in fp32
    xf, wf = xq.float(), wq.float()
    acc = None
    for s in range(0, xq.shape[1], FP32_EXACT_K):
        part = (xf[:, s:s + FP32_EXACT_K] @ wf[:, s:s + FP32_EXACT_K].t()).to(torch.int32)
        acc = part if acc is None else acc.add_(part)
    return acc
