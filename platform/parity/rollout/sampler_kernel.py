"""The decode step's draw at top_p = 1 as two Triton launches over the float32 logits (PARITY_FUSED_SAMPLER=auto, the
default: wherever Triton is installed; on: required; off: never): the token of the two-level inverse-CDF draw (parity.rollout.sampling.sample_inverse_cdf) and its
log-prob, without the [B, V] log-softmax, its exp and the block sums as separate passes.

    launch 1, grid (B, V / BLOCK):  m_j = max x,  s_j = sum exp(x - m_j)      over block j of x = logits * (1 / T)
    launch 2, grid (B,):            M = max m_j,  w_j = s_j exp(m_j - M),  Z = sum w_j (as a cumulative sum)
                                    block b = first with cum w >= u Z; inside it the first token with
                                    cum w[:b] + cum exp(x - M) >= u Z;  log-prob = x_tok - M - log Z

The same distribution and the same uniforms as the unfused draw: P(token i) = exp(x_i) / sum exp(x), scanned in
vocabulary order with the uniform u scaled by the total. The unfused draw normalizes first (exp of the
log-softmax) and groups its sums otherwise, so a target within float rounding of a boundary may map to the
neighbouring token, and the log-prob differs from log_softmax's in the last float32 bits. The logits are read
twice in all (once for the block statistics, one block again for the token), instead of five times.

`1 / T` is the float32 reciprocal, as torch computes `logits / T` on CUDA. Tests:
tests/test_sampler_kernel_interpret.py (Triton's interpreter against the unfused draw and a float64 reference).
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs
    triton = None

BLOCK = 1024
ENV = "PARITY_FUSED_SAMPLER"


def fused_sampler() -> bool:
    """Whether the CUDA decode step draws through `fused_draw` instead of the log-softmax and sample_inverse_cdf:
    PARITY_FUSED_SAMPLER=auto (the default) where Triton is installed, on (Triton required), off never. The default
    since the H100 and H200 runs of tests/bench/gpu_sampler.py (docs/PERFORMANCE.md, "The draw in two launches")."""
    v = os.environ.get(ENV, "auto")
    if v not in ("auto", "off", "on"):
        raise ValueError(f"{ENV}={v!r}: expected 'auto' (the default), 'on' or 'off'")
    if v == "on" and triton is None:
        raise RuntimeError(f"{ENV}=on needs Triton, which this install lacks")
    return v == "on" or (v == "auto" and triton is not None)


def fused_applies(spec, forced: bool, device: torch.device) -> bool:
    """Whether a decode call with SamplingSpec `spec` draws through `fused_draw`: `fused_sampler()`, on CUDA,
    sampling (temperature > 0) at top_p = 1 without top-K log-probs or forced tokens; the other draws keep their
    rules."""
    return (not spec.topk_logprobs and not forced and spec.temperature > 0.0 and spec.top_p >= 1.0
            and device.type == "cuda" and fused_sampler())


@functools.cache
def inverse_temperature(temperature: float) -> float:
    """float32(1) / float32(T): the factor torch multiplies by for `logits / T` on CUDA."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(temperature, dtype=torch.float32))


def fused_draw(logits: torch.Tensor, temperature: float, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token int64 [B], its log-prob float32 [B]) for logits float32 [B, V] at `temperature` and the rows'
    uniforms u [B] (any float dtype, read as float32 like the unfused draw's target)."""
    if logits.dtype != torch.float32 or logits.dim() != 2:
        raise ValueError(f"fused_draw: logits must be float32 [B, V], got {tuple(logits.shape)} {logits.dtype}")
    B, V = logits.shape
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    nblk = triton.cdiv(V, BLOCK)
    m = torch.empty(B, nblk, dtype=torch.float32, device=x.device)
    s = torch.empty_like(m)
    tok = torch.empty(B, dtype=torch.int64, device=x.device)
    lp = torch.empty(B, dtype=torch.float32, device=x.device)
    inv = inverse_temperature(temperature)
    _block_stats[(B, nblk)](x, m, s, x.stride(0), V, nblk, inv, BLOCK=BLOCK, num_warps=4)
    _draw[(B,)](x, m, s, u.contiguous(), tok, lp, x.stride(0), V, nblk, inv, BLOCK=BLOCK,
                NB=triton.next_power_of_2(nblk), num_warps=4)
    return tok, lp


if triton is not None:
    @triton.jit
    def _block_stats(x_ptr, m_ptr, s_ptr, stride, V, nblk, inv_t, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1)
        offs = j * BLOCK + tl.arange(0, BLOCK)
        ok = offs < V
        x = tl.load(x_ptr + row * stride + offs, mask=ok, other=float("-inf")) * inv_t
        m = tl.max(x, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)  # a block of -inf logits: mass 0, no NaN
        s = tl.sum(tl.where(ok, tl.exp(x - m_safe), 0.0), 0)
        tl.store(m_ptr + row * nblk + j, m)
        tl.store(s_ptr + row * nblk + j, s)

    @triton.jit
    def _draw(x_ptr, m_ptr, s_ptr, u_ptr, tok_ptr, lp_ptr, stride, V, nblk, inv_t, BLOCK: tl.constexpr,
              NB: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        jb = tl.arange(0, NB)
        okb = jb < nblk
        mj = tl.load(m_ptr + row * nblk + jb, mask=okb, other=float("-inf"))
        sj = tl.load(s_ptr + row * nblk + jb, mask=okb, other=0.0)
        M = tl.max(mj, 0)
        w = tl.where(sj > 0.0, sj * tl.exp(mj - M), 0.0)  # masked blocks: sj = 0
        cdf = tl.cumsum(w, 0)
        Z = tl.max(cdf, 0)  # the last element: w >= 0
        target = tl.load(u_ptr + row).to(tl.float32) * Z
        # a target rounded up to the total (u within 2^-25 of 1) or past a sum rounded down stops at the last block
        # and token with mass, not at a zero-probability one after it
        last_b = tl.max(tl.where(w > 0.0, jb, 0), 0)
        bi = tl.minimum(tl.sum(tl.where(cdf < target, 1, 0), 0), last_b)
        before = tl.sum(tl.where(jb == bi - 1, cdf, 0.0), 0)
        i = tl.arange(0, BLOCK)
        offs = bi * BLOCK + i
        ok = offs < V
        x = tl.load(x_ptr + row * stride + offs, mask=ok, other=float("-inf")) * inv_t
        p = tl.where(ok, tl.exp(x - M), 0.0)
        inner = tl.cumsum(p, 0) + before
        jj = tl.minimum(tl.sum(tl.where(ok & (inner < target), 1, 0), 0), tl.max(tl.where(p > 0.0, i, 0), 0))
        x_tok = tl.sum(tl.where(i == jj, x, 0.0), 0)
        tl.store(tok_ptr + row, (bi * BLOCK + jj).to(tl.int64))
        tl.store(lp_ptr + row, x_tok - M - tl.log(Z))
