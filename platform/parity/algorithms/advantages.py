"""Advantage estimators (registry `algorithm.adv_estimator`).

Rewards arrive as fp32 (or wider); every statistic over them is computed in float64 and the result is
returned as fp32, so rewards 1.0 and 1.001 stay distinct and a group of thousands of responses does not
lose precision in its mean."""

from __future__ import annotations

from collections.abc import Callable

import torch

from parity.algorithms.registry import Registry

AdvantageFn = Callable[..., torch.Tensor]
ADV_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator", "algorithm.adv_estimator")


def _check_rewards(rewards: torch.Tensor, group_ids: torch.Tensor) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if rewards.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"rewards must be float32 or float64 (never bf16/fp16), got {rewards.dtype}")
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids has shape {tuple(group_ids.shape)}, rewards has {tuple(rewards.shape)}")
    if group_ids.dtype.is_floating_point:
        raise TypeError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    bad = (~torch.isfinite(rewards)).nonzero()
    if bad.numel():
        row = int(bad[0, 0])
        raise ValueError(f"rewards[{row}] is {float(rewards[row])}: every reward must be finite")


@ADV_ESTIMATORS.register("grpo")
def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps) over the responses of i's group (std unbiased, as torch.std).

    A group whose rewards are all equal (a singleton included) gets exactly 0: its centred rewards
    are rounding noise, and dividing noise by a noise-sized std would invent a signal."""
    _check_rewards(rewards, group_ids)
    r = rewards.to(torch.float64)
    _, inv, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n_groups = counts.numel()
    counts64 = counts.to(torch.float64)
    mean = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, inv, r) / counts64
    centred = r - mean[inv]
    lo = torch.full((n_groups,), float("inf"), dtype=torch.float64, device=r.device)
    hi = torch.full((n_groups,), float("-inf"), dtype=torch.float64, device=r.device)
    lo = lo.scatter_reduce(0, inv, r, reduce="amin")
    hi = hi.scatter_reduce(0, inv, r, reduce="amax")
    constant = (hi == lo)[inv]
    adv = centred
    if norm_by_std:
        sq = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, inv, centred * centred)
        std = (sq / (counts64 - 1).clamp_min(1)).sqrt()
        adv = centred / (std[inv] + eps)
    return torch.where(constant, torch.zeros_like(adv), adv).to(torch.float32)


@ADV_ESTIMATORS.register("raw")
def raw_reward_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True,
                          eps: float = 1e-6) -> torch.Tensor:
    """A_i = r_i: REINFORCE on the raw reward, no baseline and no normalisation (norm_by_std is ignored). Its
    per-token advantages never sum to zero over a group, so the sampler-drift term that group centring cancels
    for equal-length responses is left in full: the objective on which a rollout mismatch drifts the most."""
    _check_rewards(rewards, group_ids)
    return rewards.to(torch.float32).clone()


def compute_advantages(name: str, rewards: torch.Tensor, group_ids: torch.Tensor, norm_by_std: bool = True,
                       eps: float = 1e-6) -> torch.Tensor:
    """Per-response advantages [B] fp32 from the registered estimator `name`."""
    return ADV_ESTIMATORS.get(name)(rewards, group_ids, norm_by_std=norm_by_std, eps=eps)
