"""`tis` / `seq_tis`: truncated importance sampling (Yao et al. 2025; verl rollout correction).

token level:    w_t = min(pi_train(y_t) / pi_inf(y_t), C)
sequence level: w_t = min(prod_s pi_train(y_s) / pi_inf(y_s), C) for every token t of the response."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from parity.algorithm_config import TISConfig
from parity.algorithms.corrections.base import (
    CORRECTIONS,
    Correction,
    CorrectionContext,
    read_section,
    require,
)
from parity.algorithms.mismatch import StepMetrics


@CORRECTIONS.register("tis", config=TISConfig)
class TIS(Correction):
    def __init__(self, cfg: Any = None, tolerance: float = 0.0) -> None:
        super().__init__(cfg, tolerance)
        C, level = self.cfg.C, self.cfg.level
        require(C > 0, self.key("C"), f"the truncation threshold must be > 0, got {C}")
        require(level in ("token", "sequence"), self.key("level"), f"must be token or sequence, got {level!r}")
        self.log_c = math.log(C)

    @property
    def level(self) -> str:
        return str(self.cfg.level)

    @property
    def provides_token_is_weight(self) -> bool:
        return self.level == "token"

    def token_level_setting(self) -> str:
        return f"set {self.key('level')}=token"

    def is_weight(self, log_ratio: torch.Tensor) -> torch.Tensor:
        return torch.exp(log_ratio.clamp(max=self.log_c))

    def _log_ratio(self, ctx: CorrectionContext) -> torch.Tensor:
        lr = ctx.log_ratio
        if self.level == "sequence":
            lr = lr.sum(dim=-1, keepdim=True).expand_as(lr)
        return lr

    def weights(self, ctx: CorrectionContext) -> torch.Tensor:
        return torch.where(ctx.mask, self.is_weight(self._log_ratio(ctx)), 0.0).detach()

    def record(self, ctx: CorrectionContext, metrics: StepMetrics) -> None:
        metrics.add_masked_mean("correction/clipped_frac", (self._log_ratio(ctx) > self.log_c).float(), ctx.mask)


@CORRECTIONS.register("seq_tis", config=TISConfig, config_key="tis")
class SeqTIS(TIS):
    """`tis` at sequence level whatever `tis.level` says (it reads the `tis` section)."""

    def __init__(self, cfg: Any = None, tolerance: float = 0.0) -> None:
        cfg = read_section(cfg, TISConfig, "tis")
        super().__init__(dataclasses.replace(cfg, level="sequence"), tolerance)

    def token_level_setting(self) -> str:
        return f"use tis with {self.key('level')}=token"
