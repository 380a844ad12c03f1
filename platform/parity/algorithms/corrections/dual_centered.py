"""`dual_centered`: the DC-GRPO dual (a Lagrangian price lambda on the train/inference gap, a tolerance c) with the
price charged the way GRPO charges the reward: relative to the response's group.

The published `dual` lowers the advantage of every sampled token by lambda x delta, delta = |p_train - p_inf| >= 0.
That is REINFORCE on the cost with no baseline: on average it pushes every sampled token down, so probability mass
moves to tokens that were not sampled and entropy rises; and when c lies below the gap a format cannot go under,
lambda grows every step and that push with it (docs/study/collapse_study.md measures both). Here:

  g_i   = (1/|tau_i|) sum_t delta_t                      the response's own mean gap (the paper's trajectory term)
  z_i   = (g_i - mean_group(g)) / (std_group(g) + eps)   standardised within the response's group, as GRPO
                                                         standardises the reward
  A'_i,t = A_i,t - lambda * z_i                          sums to zero over a group's responses (as GRPO's
                                                         advantages do): it moves probability between the
                                                         responses of a prompt, toward those the two engines
                                                         agree on, instead of pushing every sampled token down
  lambda <- clip(lambda + eta * (D - c) / c, 0, lambda_max) once per step, D = mean_i g_i over the step

lambda is in units of the advantage (lambda = 1: one standard deviation of the gap weighs as much as one of the
reward) and eta is relative to the tolerance, so neither depends on the format's mismatch level. c is `c` when
set, else the `quantile` of the per-response gaps of the first `calibration_steps` steps: the constraint keeps
the gap where most trajectories start, and the price rises only when the gap grows beyond it (lambda waits at
lambda0 until c is known). The quantile is read from a histogram of log10(g) (bins of 0.02 decades, 5% apart),
whose counts are sums that data-parallel ranks add like the dual's, so every rank finds the same c. Groups are
taken within a micro-batch (trainer.micro_batch_size a multiple of rollout.n keeps every group whole; a split
group is centred over each part). lambda, c and the calibration's histogram are state and are checkpointed."""

from __future__ import annotations

import math
from typing import Any

import torch

from parity.algorithm_config import DualCenteredConfig
from parity.algorithms.corrections.base import CORRECTIONS, CorrectionContext, require
from parity.algorithms.corrections.dual import DualPrice, sequence_gaps
from parity.algorithms.mismatch import StepMetrics

EPS = 1e-6
LOG_LO, LOG_HI, BINS = -8.0, 0.0, 400  # histogram of log10(g) for the quantile: 0.02 decades a bin


def centred_gaps(g: torch.Tensor, has: torch.Tensor, group_ids: torch.Tensor | None) -> torch.Tensor:
    """z [b]: g standardised within each group (population std, as the GRPO advantages of parity.algorithms);
    0 for a response without tokens or alone in its group."""
    groups = torch.zeros_like(g, dtype=torch.long) if group_ids is None else group_ids.to(g.device).long()
    z = torch.zeros_like(g)
    for gid in torch.unique(groups[has]):
        rows = (groups == gid) & has
        if int(rows.sum()) < 2:
            continue
        x = g[rows]
        z[rows] = (x - x.mean()) / (x.std(unbiased=False) + EPS)
    return z


@CORRECTIONS.register("dual_centered", config=DualCenteredConfig)
class DualCentered(DualPrice):
    def __init__(self, cfg: Any = None, tolerance: float | None = 0.0) -> None:
        super().__init__(cfg, tolerance)
        cfg = self.cfg
        require(cfg.c is None or cfg.c > 0, self.key("c"), f"the tolerance must be > 0, got {cfg.c}")
        require(0.0 < cfg.quantile < 1.0, self.key("quantile"), f"must be in (0, 1), got {cfg.quantile}")
        require(cfg.calibration_steps >= 1, self.key("calibration_steps"), f"must be >= 1, got {cfg.calibration_steps}")
        require(cfg.eta >= 0, self.key("eta"), f"must be >= 0, got {cfg.eta}")
        require(cfg.lambda_max >= 0, self.key("lambda_max"), f"must be >= 0, got {cfg.lambda_max}")
        require(0 <= cfg.lambda0 <= cfg.lambda_max, self.key("lambda0"),
                f"must be in [0, lambda_max={cfg.lambda_max}], got {cfg.lambda0}")
        self.c: float | None = None if cfg.c is None else float(cfg.c)
        self.lam = float(cfg.lambda0)
        self.steps = 0
        self.calibration = torch.zeros(BINS, dtype=torch.float64)  # histogram of the calibration steps' gaps
        self._reset_accumulators()

    def _reset_accumulators(self) -> None:
        super()._reset_accumulators()
        self._hist = torch.zeros(BINS, dtype=torch.float64)

    def advantage_shift(self, ctx: CorrectionContext) -> torch.Tensor:
        g, has = sequence_gaps(ctx)
        z = centred_gaps(g, has, ctx.group_ids)
        return (self.lam * z).to(torch.float32)[:, None].expand_as(ctx.mask)

    def record(self, ctx: CorrectionContext, metrics: StepMetrics) -> None:
        g, has = sequence_gaps(ctx)
        self._delta_sum = self._delta_sum + float(g[has].sum())
        self._count = self._count + float(has.sum())
        if self.c is None:
            self._hist += log_histogram(g[has].detach().cpu())
        metrics.set_value("correction/lambda", self.lam)

    def step_sums(self) -> dict[str, float]:
        out = super().step_sums()
        if self.c is None:
            out.update({f"hist{k}": float(v) for k, v in enumerate(self._hist.tolist()) if v})
        return out

    def set_step_sums(self, sums: dict[str, float]) -> None:
        super().set_step_sums(sums)
        self._hist = torch.zeros(BINS, dtype=torch.float64)
        for k, v in sums.items():
            if k.startswith("hist"):
                self._hist[int(k[4:])] = float(v)

    def update_price(self, mean_gap: float) -> None:
        if self.c is None:
            self.calibration += self._hist
            if self.steps + 1 >= self.cfg.calibration_steps:
                self.c = histogram_quantile(self.calibration, self.cfg.quantile)
        elif math.isfinite(mean_gap):  # a non-finite step (skipped by the trainer) leaves lambda
            self.lam = min(max(self.lam + self.cfg.eta * (mean_gap - self.c) / self.c, 0.0), self.cfg.lambda_max)

    def state_dict(self) -> dict[str, Any]:
        return {"lambda": self.lam, "steps": self.steps, "c": self.c, "calibration": self.calibration.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"lambda", "steps", "c"} - set(state)
        if missing:
            raise ValueError(f"dual_centered correction state lacks {sorted(missing)}")
        self.lam, self.steps = float(state["lambda"]), int(state["steps"])
        self.c = None if state["c"] is None else float(state["c"])
        self.calibration = torch.tensor(state.get("calibration", [0.0] * BINS), dtype=torch.float64)


def log_histogram(g: torch.Tensor) -> torch.Tensor:
    """Counts [BINS] of log10(g) in [LOG_LO, LOG_HI) (below: the first bin, above: the last)."""
    x = torch.log10(g.to(torch.float64).clamp_min(10.0 ** LOG_LO))
    k = ((x - LOG_LO) / (LOG_HI - LOG_LO) * BINS).floor().long().clamp(0, BINS - 1)
    return torch.bincount(k, minlength=BINS).to(torch.float64)


def histogram_quantile(hist: torch.Tensor, q: float) -> float:
    """The q-quantile of the values a log_histogram counted, interpolated in log10 within its bin."""
    total = float(hist.sum())
    if total <= 0:
        raise ValueError("quantile of an empty histogram")
    cum = torch.cumsum(hist, 0)
    k = int(torch.searchsorted(cum, torch.tensor(q * total, dtype=torch.float64)))
    k = min(k, BINS - 1)
    before = float(cum[k - 1]) if k > 0 else 0.0
    frac = (q * total - before) / float(hist[k]) if float(hist[k]) > 0 else 0.0
    width = (LOG_HI - LOG_LO) / BINS
    return 10.0 ** (LOG_LO + (k + frac) * width)
