"""Policy losses (registry `algorithm.policy_loss`).

Every loss has the signature
    fn(logprobs, old_logprobs, advantages, weights, cfg) -> (per_token_loss, metrics)
with [b, R] tensors: `logprobs` the trainer's current log-probs (with grad), `old_logprobs` the
anchor of the ratio (detached), `advantages` per token, `weights` detached IS weights (1 where
none) and `cfg` the `algorithm` config (parity.algorithm_config.AlgorithmConfig, the schema's). `metrics` maps a metric name to a
detached per-token tensor [b, R]; the caller reduces it over the response mask (so the value does not depend on the
split)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from parity.algorithm_config import AlgorithmConfig
from parity.algorithms.registry import Registry

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", "algorithm.policy_loss")

# exp() of a log-ratio beyond this is inf in fp32; such tokens are clipped anyway
_MAX_LOG_RATIO = 20.0


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  weights: torch.Tensor, cfg: AlgorithmConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high)) * w, r = exp(logprobs - old_logprobs)."""
    log_ratio = (logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - float(cfg.clip_ratio_low), 1.0 + float(cfg.clip_ratio_high))
    loss = torch.maximum(unclipped, clipped) * weights
    metrics = {
        "actor/pg_clipfrac": (clipped > unclipped).detach().float(),
        "actor/ppo_kl": (-log_ratio).detach(),
    }
    return loss, metrics


@POLICY_LOSSES.register("reinforce")
def reinforce_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                   weights: torch.Tensor, cfg: AlgorithmConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """-A * w * log pi(y): the plain score-function estimator; off-policyness is left to the IS weights
    (the ratio to old_logprobs is not used)."""
    del old_logprobs, cfg
    return -advantages * weights * logprobs, {}


def get_policy_loss(name: str) -> PolicyLossFn:
    return POLICY_LOSSES.get(name)
