"""The CUDA decode path's draw with top_p = 1: inverse CDF over the vocabulary in index order (no [B, V] sort),
the same distribution and the same per-row uniforms as the torch engine's sorted draw (TorchEngine.sample)."""

from __future__ import annotations

import torch


def _cdf_block(V: int) -> int:
    """Block length of the two-level draw: the largest power of two <= 1024 dividing V (128 for Qwen's
    151,936), so the probabilities reshape to [B, V / block, block] without a padding copy; 0 = one level."""
    b = 1024
    while b >= 64:
        if V % b == 0 and V // b >= 2:
            return b
        b //= 2
    return 0


def sample_inverse_cdf(logp: torch.Tensor, u: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Token index i with cdf[i-1] < u * total <= cdf[i] over probs = exp(logp) in vocabulary order.
    P(i) = p_i / sum(p) exactly as the sorted inverse-CDF draw; only which uniform maps to which token differs.

    Two levels when the vocabulary splits into blocks: the block whose cumulative mass first reaches the target
    (a scan over V / block block sums), then the token inside that block (a scan over `block` values). A full
    scan over a [64, 151,936] row block was a sizeable share of a decode step (docs/PERFORMANCE.md, "Two-level
    inverse-CDF draw"); the two-level one reads the probabilities once. Sums are grouped differently, so a target
    within float rounding of a boundary may map to the neighbouring token; the distribution is the same."""
    p = logp.exp()
    B, V = p.shape
    block = _cdf_block(V) if block is None else block
    target = u.to(p.dtype)
    if not block or V % block or V // block < 2:
        cdf = p.cumsum(-1)
        target = (target * cdf[:, -1]).unsqueeze(-1)
        return torch.searchsorted(cdf, target).clamp_max(V - 1).squeeze(-1)
    blocks = p.view(B, V // block, block)
    bcdf = blocks.sum(-1).cumsum(-1)  # [B, nb]
    target = (target * bcdf[:, -1]).unsqueeze(-1)  # [B, 1]
    bi = torch.searchsorted(bcdf, target).clamp_max(bcdf.shape[1] - 1)  # [B, 1]
    before = torch.where(bi > 0, bcdf.gather(1, (bi - 1).clamp_min(0)), torch.zeros_like(target))
    inner = blocks.gather(1, bi.unsqueeze(-1).expand(B, 1, block)).squeeze(1).cumsum(-1) + before  # [B, block]
    j = torch.searchsorted(inner, target).clamp_max(block - 1)
    return (bi * block + j).squeeze(-1)
