"""Loss aggregation over tokens (registry `algorithm.loss_agg_mode`), invariant to the micro-batch split.

The denominators are taken once from the response mask of the whole mini-batch (`loss_denominators`),
so each micro-batch's aggregate is its share of the mini-batch aggregate: summing the micro-batch
losses (calling backward on each) gives the mini-batch loss and gradient exactly, whatever the split.
Counts are Python ints (exact); they never pass through bf16 (exact only to 256) or fp16."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from parity.algorithms.registry import Registry


@dataclass(frozen=True)
class LossDenominators:
    num_tokens: int  # response tokens in the mini-batch
    num_seqs: int  # responses with at least one token
    max_response_len: int  # the constant of seq-mean-token-sum-norm (Dr. GRPO's generation budget)


def loss_denominators(response_mask: torch.Tensor, max_response_len: int | None = None) -> LossDenominators:
    """Denominators of the whole mini-batch. `max_response_len` defaults to the padded width R; pass
    the rollout's max_new_tokens to keep seq-mean-token-sum-norm's scale constant across steps."""
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be 2-D [B, R], got shape {tuple(response_mask.shape)}")
    if response_mask.dtype != torch.bool:
        raise TypeError(f"response_mask must be bool, got {response_mask.dtype}")
    lengths = response_mask.sum(dim=-1, dtype=torch.int64)
    width = int(response_mask.shape[-1])
    if max_response_len is None:
        max_response_len = width
    if max_response_len < 1:
        raise ValueError(f"max_response_len must be >= 1, got {max_response_len}")
    longest = int(lengths.max()) if lengths.numel() else 0
    if longest > max_response_len:
        raise ValueError(f"max_response_len={max_response_len} is shorter than the longest response ({longest})")
    return LossDenominators(num_tokens=int(lengths.sum()), num_seqs=int((lengths > 0).sum()),
                            max_response_len=int(max_response_len))


AggregateFn = Callable[[torch.Tensor, torch.Tensor, "LossDenominators"], torch.Tensor]
AGGREGATIONS: Registry[AggregateFn] = Registry("mode", "algorithm.loss_agg_mode")


@AGGREGATIONS.register("token-mean")
def token_mean(masked: torch.Tensor, mask: torch.Tensor, denom: LossDenominators) -> torch.Tensor:
    """Sum of token losses / tokens of the mini-batch."""
    return masked.sum() / max(denom.num_tokens, 1)


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(masked: torch.Tensor, mask: torch.Tensor, denom: LossDenominators) -> torch.Tensor:
    """Sum over sequences of (mean token loss of the sequence) / sequences of the mini-batch."""
    lengths = mask.sum(dim=-1, dtype=torch.int64).clamp_min(1).to(masked.dtype)
    return (masked.sum(dim=-1) / lengths).sum() / max(denom.num_seqs, 1)


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(masked: torch.Tensor, mask: torch.Tensor, denom: LossDenominators) -> torch.Tensor:
    """Sum of token losses / (sequences * max_response_len) (Dr. GRPO)."""
    return masked.sum() / (max(denom.num_seqs, 1) * denom.max_response_len)


AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")  # the built-in modes


def aggregate_loss(per_token: torch.Tensor, mask: torch.Tensor, mode: str | AggregateFn,
                   denom: LossDenominators) -> torch.Tensor:
    """Scalar loss of a micro-batch: its contribution to the mini-batch aggregate `mode` (a registered name, or
    the function AGGREGATIONS.get(name) returned)."""
    if per_token.shape != mask.shape:
        raise ValueError(f"per_token has shape {tuple(per_token.shape)}, mask has {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be bool, got {mask.dtype}")
    fn = AGGREGATIONS.get(mode) if isinstance(mode, str) else mode
    if per_token.dtype in (torch.bfloat16, torch.float16):
        per_token = per_token.float()
    # where(), not a product: padding may hold inf/nan and 0 * inf is nan
    masked = torch.where(mask, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    return fn(masked, mask, denom)
