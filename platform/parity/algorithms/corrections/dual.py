"""`dual` (DC-GRPO, arXiv 2606.08779): a constrained objective whose dual variable lambda prices the
train/inference probability gap.

Per token: delta = |p_train(y) - p_inf(y)| of the sampled token and A' = A - lambda * delta.
Once per step: lambda <- clip(lambda + eta * (mean delta - c), 0, lambda_max), where the mean runs over
every response token the step saw (all micro-batches). lambda is state and is checkpointed."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from parity.algorithms.corrections.base import (
    CORRECTIONS,
    Correction,
    CorrectionContext,
    require,
)
from parity.algorithms.mismatch import StepMetrics


@dataclass
class DualConfig:
    c: float = 0.0037  # tolerance on the mean |p_train - p_inf|
    lambda0: float = 0.1
    eta: float = 1.0
    lambda_max: float = 10.0


def prob_gap(ctx: CorrectionContext) -> torch.Tensor:
    """delta [b, R] = |p_train - p_inf| of the sampled token, 0 on padding."""
    d = (ctx.train_logprobs.detach().exp() - ctx.rollout_logprobs.exp()).abs()
    return torch.where(ctx.mask, d, 0.0)


def dual_update(lam: float, mean_delta: float, c: float, eta: float, lambda_max: float) -> float:
    return min(max(lam + eta * (mean_delta - c), 0.0), lambda_max)


@CORRECTIONS.register("dual", config=DualConfig)
class Dual(Correction):
    def __init__(self, cfg: Any = None, tolerance: float = 0.0) -> None:
        super().__init__(cfg, tolerance)
        cfg = self.cfg
        require(cfg.c >= 0, self.key("c"), f"the tolerance must be >= 0, got {cfg.c}")
        require(cfg.eta >= 0, self.key("eta"), f"must be >= 0, got {cfg.eta}")
        require(cfg.lambda_max >= 0, self.key("lambda_max"), f"must be >= 0, got {cfg.lambda_max}")
        require(0 <= cfg.lambda0 <= cfg.lambda_max, self.key("lambda0"),
                f"must be in [0, lambda_max={cfg.lambda_max}], got {cfg.lambda0}")
        self.lam = float(cfg.lambda0)
        self.steps = 0
        self._reset_accumulators()

    def _reset_accumulators(self) -> None:
        self._delta_sum: torch.Tensor | float = 0.0
        self._count: torch.Tensor | float = 0.0

    def advantage_shift(self, ctx: CorrectionContext) -> torch.Tensor:
        return self.lam * prob_gap(ctx)

    def record(self, ctx: CorrectionContext, metrics: StepMetrics) -> None:
        d = prob_gap(ctx).to(torch.float64)
        self._delta_sum = self._delta_sum + d.sum()
        self._count = self._count + ctx.mask.sum().to(torch.float64)
        metrics.set_value("correction/lambda", self.lam)

    def step_sums(self) -> dict[str, float]:
        return {"delta_sum": float(self._delta_sum), "count": float(self._count)}

    def set_step_sums(self, sums: dict[str, float]) -> None:
        self._delta_sum, self._count = float(sums["delta_sum"]), float(sums["count"])

    def end_step(self) -> dict[str, float]:
        count = float(self._count)
        used = self.lam
        out = {"correction/lambda": used}
        if count > 0:
            mean_delta = float(self._delta_sum) / count
            if math.isfinite(mean_delta):  # a non-finite step (skipped by the trainer) must not poison lambda
                self.lam = dual_update(self.lam, mean_delta, self.cfg.c, self.cfg.eta, self.cfg.lambda_max)
            out["correction/dual_delta_mean"] = mean_delta
        out["correction/lambda_next"] = self.lam
        self.steps += 1
        self._reset_accumulators()
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"lambda": self.lam, "steps": self.steps, "delta_sum": float(self._delta_sum),
                "count": float(self._count)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"lambda", "steps"} - set(state)
        if missing:
            raise ValueError(f"dual correction state lacks {sorted(missing)}")
        self.lam = float(state["lambda"])
        self.steps = int(state["steps"])
        self._delta_sum = float(state.get("delta_sum", 0.0))
        self._count = float(state.get("count", 0.0))
