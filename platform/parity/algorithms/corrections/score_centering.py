"""`score_centering` (arXiv 2609.20807; Agent Lightning v1.0.3): cancel the drift of the score's mean.

Under y ~ q = pi_inf the REINFORCE score psi_y = grad log p(y) has mean E_q[psi] != 0 when q != p;
that mean is a persistent bias (drift) that accumulates every step. Score centering subtracts it:
per token the loss adds

    A * sum_{v in H} sg(q_v w_v - alpha p_v) log p_v

where H is the rollout's top-K, q the rollout's and p the trainer's probabilities (full-vocabulary
normalised), w_v = w(p_v / q_v) the optional token-level IS rule (tis / icepop), and the unseen tail
of q is modelled as rho * p with rho = max(1 - Q_H, floor) / max(1 - P_H, floor) and
alpha = rho * w(1 / rho) (alpha = rho without IS). Since sum_v p_v grad log p_v = 0, the tail's
contribution collapses onto the head as -alpha p_v, which is why only K log-probs are needed. With
K = V the gradient is the exact centred score; on-policy (q = p) the term is exactly 0.
Used with the REINFORCE loss: -A (w_y log p_y - sum_H sg(c_v) log p_v), w_y the stack's IS weight.

H may be any set of ids whose q is exact (an engine that appends the sampled token as a K+1-th column
is fine); entries with a -inf log-prob are padding and ignored; an id listed twice would be counted
twice. q must be the distribution sampled from (top_p = 1)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from parity.algorithm_config import ScoreCenteringConfig
from parity.algorithms.corrections.base import (
    CORRECTIONS,
    Correction,
    CorrectionContext,
    require,
)
from parity.algorithms.mismatch import StepMetrics
from parity.types import RolloutBatch

IsWeight = Callable[[torch.Tensor], torch.Tensor]


def _ones(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(log_ratio)


@torch.no_grad()
def centering_coefficients(head_logprobs: torch.Tensor, head_rollout_logprobs: torch.Tensor, valid: torch.Tensor,
                           is_weight: IsWeight | None = None, tail_floor: float = 1e-6
                           ) -> dict[str, torch.Tensor]:
    """c_v = q_v w(p_v/q_v) - alpha p_v on the head [n, K] (0 where not valid), in float64.

    Returns coef [n, K], rho [n], p_mass [n] (P_H) and q_mass [n] (Q_H)."""
    w_fn = is_weight or _ones
    lp = head_logprobs.detach().to(torch.float64)
    lq = head_rollout_logprobs.detach().to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=lp.device)
    p = torch.where(valid, lp.exp(), zero)
    q = torch.where(valid, lq.exp(), zero)
    p_mass, q_mass = p.sum(-1), q.sum(-1)
    rho = (1.0 - q_mass).clamp_min(tail_floor) / (1.0 - p_mass).clamp_min(tail_floor)
    alpha = rho * w_fn(-rho.log())
    w_head = torch.where(valid, w_fn(torch.where(valid, lp - lq, zero)), zero)
    coef = torch.where(valid, q * w_head - alpha[:, None] * p, zero)
    return {"coef": coef, "rho": rho, "p_mass": p_mass, "q_mass": q_mass}


def centering_term(head_logprobs: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """sum_v sg(c_v) log p_v per token [n], with gradient through log p_v only."""
    return (coef.to(head_logprobs.dtype) * head_logprobs).sum(-1)


@CORRECTIONS.register("score_centering", config=ScoreCenteringConfig)
class ScoreCentering(Correction):
    needs_topk = True

    def __init__(self, cfg: Any = None, tolerance: float = 0.0) -> None:
        super().__init__(cfg, tolerance)
        cfg = self.cfg
        require(cfg.top_k >= 0, self.key("top_k"), f"must be >= 0 (0 = every column the rollout returns), got {cfg.top_k}")
        require(0 < cfg.tail_floor < 1, self.key("tail_floor"), f"must be in (0, 1), got {cfg.tail_floor}")
        self._last: dict[str, torch.Tensor] | None = None

    @property
    def top_k(self) -> int:
        return int(self.cfg.top_k)

    def check(self, others: list[Correction], policy_loss: str | None, topk_logprobs: int | None) -> None:
        require(policy_loss in (None, "reinforce"), "algorithm.policy_loss",
                f"score_centering is derived for the REINFORCE loss; set algorithm.policy_loss=reinforce (got {policy_loss!r})")
        if topk_logprobs is not None:
            require(topk_logprobs > 0, "rollout.topk_logprobs",
                    "score_centering needs the rollout's top-K log-probs; set rollout.topk_logprobs > 0 (e.g. 128)")
            require(self.top_k <= topk_logprobs, self.key("top_k"),
                    f"{self.top_k} exceeds the K the rollout returns (rollout.topk_logprobs={topk_logprobs})")
        for o in others:  # the tail term applies the partner's IS rule to unsampled tokens: it must be per token
            if o.weights_tokens and not o.provides_token_is_weight:
                fix = o.token_level_setting()
                raise ValueError(f"{o.section}: score_centering composes only with token-level IS weights, and "
                                 f"{o.name} weights whole responses" + (f"; {fix}" if fix else ""))

    def check_batch(self, batch: RolloutBatch) -> None:
        if batch.topk_ids is None or batch.topk_logprobs is None:
            raise ValueError("algorithm.correction.name includes score_centering but the batch has no top-K log-probs "
                             "(RolloutBatch.topk_ids / topk_logprobs are None); set rollout.topk_logprobs > 0")
        b, r = batch.responses.shape
        if batch.topk_ids.shape[:2] != (b, r) or batch.topk_logprobs.shape != batch.topk_ids.shape:
            raise ValueError(f"RolloutBatch.topk_ids {tuple(batch.topk_ids.shape)} / topk_logprobs "
                             f"{tuple(batch.topk_logprobs.shape)} must both be [B, R, K] with [B, R] = {(b, r)}")
        require(batch.topk_ids.shape[2] >= self.top_k, self.key("top_k"),
                f"{self.top_k} exceeds the batch's K ({batch.topk_ids.shape[2]})")

    def extra_loss(self, ctx: CorrectionContext, advantages: torch.Tensor, is_weight: IsWeight | None
                   ) -> torch.Tensor:
        assert ctx.head_logprobs is not None and ctx.head_rollout_logprobs is not None and ctx.head_valid is not None
        stats = centering_coefficients(ctx.head_logprobs, ctx.head_rollout_logprobs, ctx.head_valid, is_weight,
                                       self.cfg.tail_floor)
        term = centering_term(ctx.head_logprobs, stats["coef"])
        flat = ctx.gather(advantages) * term
        self._last = {**stats, "term": flat.detach()}
        return ctx.scatter(flat)

    def record(self, ctx: CorrectionContext, metrics: StepMetrics) -> None:
        if self._last is None:
            return
        s, n = self._last, ctx.mask.sum()
        metrics.add_mean("correction/sc_term_abs", s["term"].abs().sum(), n)
        metrics.add_mean("correction/sc_coef_l1", s["coef"].abs().sum(), n)
        metrics.add_mean("correction/sc_rho_mean", s["rho"].sum(), n)
        metrics.add_mean("correction/sc_head_mass_inf", s["q_mass"].sum(), n)
        metrics.add_mean("correction/sc_head_mass_train", s["p_mass"].sum(), n)
        self._last = None
