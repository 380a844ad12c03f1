"""Triton kernels for the log-prob head's element-wise work on CUDA (used by parity.algorithms.logprobs).

Per chunk of rows, the head computes low-precision logits L = hidden @ W^T ([rows x V], bf16). Eager torch then
upcasts the block to fp32 and makes about ten passes over it (log-sum-exp in the forward; softmax times the
summed upstream gradient and the downcast in the backward), a large part of a trainer step at a 151,936-token
vocabulary (docs/PERFORMANCE.md, Trainer). These kernels read L once and write nothing of size [rows x V] in fp32:

    row_logsumexp(L, T)          -> lse [rows] fp32: log sum_v exp(L_v / T), online max and sum in fp32
    softmax_times(L, lse, c, T)  -> exp(L / T - lse) * c  [rows x V] in L's dtype (c: one fp32 factor per row)

The one-hot part of the gradient (a few ids per row) is added in torch afterwards. Same operations as the eager
path up to fp32 summation order (tests/test_algorithms_logprobs.py compares both on CPU through the reference
functions; the CUDA kernels against them on the device).

Importable without Triton: `available()` is False on CPU installs.
"""

from __future__ import annotations

import functools

import torch

try:  # Triton kernels resolve names from module globals (not closures): import here
    import triton
    import triton.language as tl
except ImportError:  # CPU installs
    triton = None

_BLOCK = 2048


if triton is not None:
    @triton.jit
    def _lse_kernel(x_ptr, out_ptr, V, stride, temperature, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = x_ptr + row.to(tl.int64) * stride
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for v0 in range(0, V, BLOCK):
            offs = v0 + tl.arange(0, BLOCK)
            z = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / temperature
            m_new = tl.maximum(m, z)
            empty = m_new == float("-inf")
            s = tl.where(empty, 0.0, s * tl.exp(m - m_new) + tl.exp(z - m_new))
            m = m_new
        top = tl.max(m, 0)
        total = tl.sum(tl.where(m == float("-inf"), 0.0, s * tl.exp(m - top)), 0)
        tl.store(out_ptr + row, tl.log(total) + top)

    @triton.jit
    def _softmax_times_kernel(x_ptr, lse_ptr, c_ptr, y_ptr, V, stride, temperature, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < V
        base = row.to(tl.int64) * stride
        z = tl.load(x_ptr + base + offs, mask=ok, other=0.0).to(tl.float32) / temperature
        lse = tl.load(lse_ptr + row)
        c = tl.load(c_ptr + row)
        y = tl.exp(z - lse) * c
        tl.store(y_ptr + base + offs, y.to(y_ptr.dtype.element_ty), mask=ok)


@functools.cache
def available() -> bool:
    return triton is not None and torch.cuda.is_available()


def row_logsumexp(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log sum exp(logits / T) per row, fp32 [rows]; logits [rows, V] contiguous rows (CUDA)."""
    rows, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        _lse_kernel[(rows,)](logits, out, V, logits.stride(0), float(temperature), BLOCK=_BLOCK, num_warps=8)
    return out


def softmax_times(logits: torch.Tensor, lse: torch.Tensor, factor: torch.Tensor, temperature: float) -> torch.Tensor:
    """exp(logits / T - lse) * factor per row, in logits' dtype [rows, V] (CUDA)."""
    rows, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty_like(logits)
    if rows:
        grid = (rows, triton.cdiv(V, _BLOCK))
        _softmax_times_kernel[grid](logits, lse.float().contiguous(), factor.reshape(-1).float().contiguous(), out,
                                    V, logits.stride(0), float(temperature), BLOCK=_BLOCK, num_warps=8)
    return out
