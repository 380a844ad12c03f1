"""`icepop`: masked importance sampling (Ring-1T; verl): w = r if lo <= r <= hi else 0,
r = pi_train(y) / pi_inf(y) of the sampled token."""

from __future__ import annotations

import math
from typing import Any

import torch

from parity.algorithm_config import IcePopConfig
from parity.algorithms.corrections.base import (
    CORRECTIONS,
    Correction,
    CorrectionContext,
    require,
)
from parity.algorithms.mismatch import StepMetrics


@CORRECTIONS.register("icepop", config=IcePopConfig)
class IcePop(Correction):
    @property
    def provides_token_is_weight(self) -> bool:
        return True

    def __init__(self, cfg: Any = None, tolerance: float = 0.0) -> None:
        super().__init__(cfg, tolerance)
        cfg = self.cfg
        require(cfg.lo >= 0, self.key("lo"), f"must be >= 0, got {cfg.lo}")
        require(cfg.hi > cfg.lo, self.key("hi"), f"must be > lo ({cfg.lo}), got {cfg.hi}")
        self.log_lo = math.log(cfg.lo) if cfg.lo > 0 else float("-inf")
        self.log_hi = math.log(cfg.hi)

    def _inside(self, log_ratio: torch.Tensor) -> torch.Tensor:
        return (log_ratio >= self.log_lo) & (log_ratio <= self.log_hi)

    def is_weight(self, log_ratio: torch.Tensor) -> torch.Tensor:
        inside = self._inside(log_ratio)
        return torch.where(inside, torch.exp(log_ratio.clamp(max=self.log_hi)), 0.0)

    def weights(self, ctx: CorrectionContext) -> torch.Tensor:
        return torch.where(ctx.mask, self.is_weight(ctx.log_ratio), 0.0).detach()

    def record(self, ctx: CorrectionContext, metrics: StepMetrics) -> None:
        metrics.add_masked_mean("correction/icepop_masked_frac", (~self._inside(ctx.log_ratio)).float(), ctx.mask)
