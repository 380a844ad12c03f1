"""`dual` (DC-GRPO, arXiv 2606.08779): a constrained objective whose dual variable lambda prices the
train/inference probability gap.

Per token: delta = |p_train(y) - p_inf(y)| of the sampled token and A' = A - lambda * delta.
Once per step: lambda <- clip(lambda + eta * (D - c), 0, lambda_max), where D is the step's discrepancy over
every response the step saw (all micro-batches): with `discrepancy=seq_mean` (the paper's constraint) the mean
over trajectories of each trajectory's own mean (1/|tau|) sum_t delta_t, with `token_mean` the mean over all
response tokens. c is `dual.c`, or when that is null `algorithm.correction.tolerance` (a number or auto: until
auto has measured it, lambda stays where it is). lambda is state and is checkpointed."""

from __future__ import annotations

import math
from typing import Any

import torch

from parity.algorithm_config import DualConfig
from parity.algorithms.corrections.base import (
    CORRECTIONS,
    Correction,
    CorrectionContext,
    require,
)
from parity.algorithms.mismatch import StepMetrics

DISCREPANCIES = ("seq_mean", "token_mean")


def prob_gap(ctx: CorrectionContext) -> torch.Tensor:
    """delta [b, R] = |p_train - p_inf| of the sampled token, 0 on padding."""
    d = (ctx.train_logprobs.detach().exp() - ctx.rollout_logprobs.exp()).abs()
    return torch.where(ctx.mask, d, 0.0)


def sequence_gaps(ctx: CorrectionContext) -> tuple[torch.Tensor, torch.Tensor]:
    """(g [b] float64: each response's mean |p_train - p_inf| over its tokens, has [b]: it has tokens)."""
    d = prob_gap(ctx).to(torch.float64)
    n = ctx.mask.sum(-1).to(torch.float64)
    has = n > 0
    return torch.where(has, d.sum(-1) / n.clamp_min(1.0), 0.0), has


def dual_update(lam: float, mean_delta: float, c: float, eta: float, lambda_max: float) -> float:
    return min(max(lam + eta * (mean_delta - c), 0.0), lambda_max)


class DualPrice(Correction):
    """What the duals share: a price lambda (state) on the step's mean gap D = delta_sum / count, whose sums over
    the step's micro-batches data-parallel ranks add (step_sums), and the step's bookkeeping. A subclass sets
    `lam`, `c` and `steps` and moves the price in `update_price`."""

    lam: float
    c: float | None
    steps: int

    def _reset_accumulators(self) -> None:
        self._delta_sum: torch.Tensor | float = 0.0
        self._count: torch.Tensor | float = 0.0

    def step_sums(self) -> dict[str, float]:
        return {"delta_sum": float(self._delta_sum), "count": float(self._count)}

    def set_step_sums(self, sums: dict[str, float]) -> None:
        self._delta_sum, self._count = float(sums["delta_sum"]), float(sums["count"])

    def update_price(self, mean_delta: float) -> None:
        """Move lambda (and whatever else the correction learns) on the step's mean gap."""
        raise NotImplementedError

    def end_step(self) -> dict[str, float]:
        count = float(self._count)
        out = {"correction/lambda": self.lam}
        if count > 0:
            mean_delta = float(self._delta_sum) / count
            self.update_price(mean_delta)
            out["correction/dual_delta_mean"] = mean_delta
        if self.c is not None:
            out["correction/dual_c"] = self.c
        out["correction/lambda_next"] = self.lam
        self.steps += 1
        self._reset_accumulators()
        return out


@CORRECTIONS.register("dual", config=DualConfig)
class Dual(DualPrice):
    def __init__(self, cfg: Any = None, tolerance: float | None = 0.0) -> None:
        super().__init__(cfg, tolerance)
        cfg = self.cfg
        require(cfg.c is None or cfg.c >= 0, self.key("c"), f"the tolerance must be >= 0, got {cfg.c}")
        require(cfg.discrepancy in DISCREPANCIES, self.key("discrepancy"),
                f"must be one of {', '.join(DISCREPANCIES)}, got {cfg.discrepancy!r}")
        self.c: float | None = float(cfg.c) if cfg.c is not None else (None if tolerance is None else float(tolerance))
        require(cfg.eta >= 0, self.key("eta"), f"must be >= 0, got {cfg.eta}")
        require(cfg.lambda_max >= 0, self.key("lambda_max"), f"must be >= 0, got {cfg.lambda_max}")
        require(0 <= cfg.lambda0 <= cfg.lambda_max, self.key("lambda0"),
                f"must be in [0, lambda_max={cfg.lambda_max}], got {cfg.lambda0}")
        self.lam = float(cfg.lambda0)
        self.steps = 0
        self._reset_accumulators()

    def advantage_shift(self, ctx: CorrectionContext) -> torch.Tensor:
        return self.lam * prob_gap(ctx)

    def set_tolerance(self, c: float) -> None:
        """The tolerance `algorithm.correction.tolerance=auto` measured (kept when dual.c is set)."""
        super().set_tolerance(c)
        if self.cfg.c is None:
            self.c = float(c)

    def record(self, ctx: CorrectionContext, metrics: StepMetrics) -> None:
        if self.cfg.discrepancy == "token_mean":
            self._delta_sum = self._delta_sum + prob_gap(ctx).to(torch.float64).sum()
            self._count = self._count + ctx.mask.sum().to(torch.float64)
        else:  # each trajectory's own mean gap, summed over trajectories (empty ones do not count)
            g, has = sequence_gaps(ctx)
            self._delta_sum = self._delta_sum + g.sum()
            self._count = self._count + has.sum().to(torch.float64)
        metrics.set_value("correction/lambda", self.lam)

    def update_price(self, mean_delta: float) -> None:
        # a non-finite step (skipped by the trainer) must not poison lambda; no c yet (auto): lambda waits
        if math.isfinite(mean_delta) and self.c is not None:
            self.lam = dual_update(self.lam, mean_delta, self.c, self.cfg.eta, self.cfg.lambda_max)

    def state_dict(self) -> dict[str, Any]:
        return {"lambda": self.lam, "steps": self.steps, "delta_sum": float(self._delta_sum),
                "count": float(self._count), "c": self.c}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"lambda", "steps", "delta_sum", "count", "c"} - set(state)
        if missing:
            raise ValueError(f"dual correction state lacks {sorted(missing)}")
        self.lam = float(state["lambda"])
        self.steps = int(state["steps"])
        self._delta_sum = float(state["delta_sum"])
        self._count = float(state["count"])
        if state["c"] is not None and self.cfg.c is None:  # a measured (auto) tolerance resumes as it was
            self.c = float(state["c"])
