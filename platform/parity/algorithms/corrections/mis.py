"""`mis`: drop whole responses whose mismatch statistic is out of bounds (verl rollout rejection).

With lr_t = log pi_train(y_t) - log pi_inf(y_t) over the response's tokens:
  k1:       s = mean_t(-lr_t);                masked when |s| > threshold
  k3:       s = mean_t(exp(lr_t) - 1 - lr_t); masked when s > threshold
  geo_mean: s = exp(mean_t(lr_t));            masked when s < lo or s > hi"""

from __future__ import annotations

from typing import Any

import torch

from parity.algorithm_config import MISConfig
from parity.algorithms.corrections.base import (
    CORRECTIONS,
    Correction,
    CorrectionContext,
    require,
)
from parity.algorithms.mismatch import StepMetrics

STATISTICS = ("k1", "k3", "geo_mean")


def sequence_statistic(log_ratio: torch.Tensor, mask: torch.Tensor, statistic: str) -> torch.Tensor:
    """Per-response statistic [b] (float64) of the masked token log-ratios [b, R]."""
    lr = torch.where(mask, log_ratio.detach().to(torch.float64), 0.0)
    n = mask.sum(dim=-1).clamp_min(1).to(torch.float64)
    if statistic == "k1":
        return (-lr).sum(-1) / n
    if statistic == "k3":
        k3 = torch.where(mask, torch.expm1(lr) - lr, 0.0)
        return k3.sum(-1) / n
    if statistic == "geo_mean":
        return torch.exp(lr.sum(-1) / n)
    raise ValueError(f"algorithm.correction.mis.statistic: unknown {statistic!r}; known: {', '.join(STATISTICS)}")


@CORRECTIONS.register("mis", config=MISConfig)
class MIS(Correction):
    def __init__(self, cfg: Any = None, tolerance: float = 0.0) -> None:
        super().__init__(cfg, tolerance)
        cfg = self.cfg
        require(cfg.statistic in STATISTICS, self.key("statistic"),
                f"unknown statistic {cfg.statistic!r}; known: {', '.join(STATISTICS)}")
        require(cfg.threshold >= 0, self.key("threshold"), f"must be >= 0, got {cfg.threshold}")
        require(cfg.lo >= 0, self.key("lo"), f"must be >= 0, got {cfg.lo}")
        require(cfg.hi > cfg.lo, self.key("hi"), f"must be > lo ({cfg.lo}), got {cfg.hi}")

    def sequence_keep(self, ctx: CorrectionContext) -> torch.Tensor:
        s = sequence_statistic(ctx.log_ratio, ctx.mask, self.cfg.statistic)
        if self.cfg.statistic == "k1":
            return s.abs() <= self.cfg.threshold
        if self.cfg.statistic == "k3":
            return s <= self.cfg.threshold
        return (s >= self.cfg.lo) & (s <= self.cfg.hi)

    def keep_mask(self, ctx: CorrectionContext) -> torch.Tensor:
        return self.sequence_keep(ctx)[:, None] & ctx.mask

    def record(self, ctx: CorrectionContext, metrics: StepMetrics) -> None:
        has = ctx.mask.any(dim=-1)
        dropped = ~self.sequence_keep(ctx) & has
        metrics.add_mean("correction/mis_seq_masked_frac", dropped.sum(), has.sum())
