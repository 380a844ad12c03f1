"""GRPO advantages against hand computations and a float64 reference; exact token counts at scale."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from parity.algorithms import compute_advantages, loss_denominators


def _reference(rewards: list[float], groups: list[int], norm: bool, eps: float) -> list[float]:
    out = []
    for r, g in zip(rewards, groups):
        members = [x for x, h in zip(rewards, groups) if h == g]
        if len(set(members)) == 1:
            out.append(0.0)
            continue
        mean = math.fsum(members) / len(members)
        a = r - mean
        out.append(a / (statistics.stdev(members) + eps) if norm else a)
    return out


def test_hand_computed_group() -> None:
    adv = compute_advantages("grpo", torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([7, 7, 7, 7]))
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert adv.dtype == torch.float32
    # statistics in float64, one rounding to float32: rel <= u = 6e-8 (1e-6 leaves 16x)
    assert adv.tolist() == pytest.approx([expected, -expected, -expected, expected], rel=1e-6)


def test_interleaved_groups_match_float64_reference() -> None:
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(40, generator=g)
    groups = torch.randint(0, 5, (40,), generator=g) * 11  # non-contiguous ids, unsorted rows
    for norm in (True, False):
        adv = compute_advantages("grpo", rewards, groups, norm_by_std=norm)
        ref = _reference([float(x) for x in rewards], groups.tolist(), norm, 1e-6)
        # float64 statistics of 40 rewards (~1e-15 relative), one rounding to float32: rel <= u = 6e-8
        assert adv.tolist() == pytest.approx(ref, rel=1e-6, abs=1e-7)


def test_zero_variance_group_is_exactly_zero() -> None:
    # 0.1 is not exact in binary: a naive mean leaves a rounding residue that std-normalisation blows up
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.7, 1.0, 0.0, 0.3], dtype=torch.float32)
    groups = torch.tensor([0, 0, 0, 1, 2, 2, 3])
    adv = compute_advantages("grpo", rewards, groups)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert adv[3].item() == 0.0  # singleton group
    assert adv[6].item() == 0.0
    assert torch.isfinite(adv).all()
    assert adv[4].item() > 0 > adv[5].item()


def test_rewards_one_and_one_point_zero_zero_one_stay_distinct() -> None:
    rewards = torch.tensor([1.0, 1.001, 1.0, 1.001], dtype=torch.float32)
    adv = compute_advantages("grpo", rewards, torch.zeros(4, dtype=torch.int64))
    assert adv[1] > 0 > adv[0]
    ref = _reference([float(x) for x in rewards], [0] * 4, True, 1e-6)
    # the same float32 rewards on both sides; float64 statistics (1.001 - 1 is exact there), one rounding: rel <= u
    assert adv.tolist() == pytest.approx(ref, rel=1e-5)
    raw = compute_advantages("grpo", rewards, torch.zeros(4, dtype=torch.int64), norm_by_std=False)
    # against the decimal 0.0005: float32's 1.001 is off by up to u * 1.001 = 6e-8, 1.2e-4 of 0.0005
    assert raw[1].item() == pytest.approx(0.0005, rel=1e-3)


def test_group_of_1024_with_1e5_tokens_each() -> None:
    b, r = 1024, 100_000
    mask = torch.ones(b, r, dtype=torch.bool)  # 100 MB of bools, no float tensor of that size
    mask[0, -1] = False
    mask[1, -3:] = False
    denom = loss_denominators(mask)
    del mask
    assert isinstance(denom.num_tokens, int)
    assert denom.num_tokens == b * r - 4  # 102,399,996: not representable in fp32, far beyond bf16's 256
    assert float(torch.tensor(denom.num_tokens, dtype=torch.float32)) != denom.num_tokens
    assert denom.num_seqs == b and denom.max_response_len == r

    g = torch.Generator().manual_seed(1)
    rewards = (torch.rand(b, generator=g) > 0.7).float() + 1e-3 * torch.rand(b, generator=g)
    adv = compute_advantages("grpo", rewards, torch.zeros(b, dtype=torch.int64))
    assert torch.isfinite(adv).all()
    r64 = rewards.double()
    ref = (r64 - r64.mean()) / (r64.std() + 1e-6)
    # float64 statistics of 1024 rewards (1e3 * 2^-53 ~ 1e-13), one rounding to float32: rel <= u; |A| < 2
    assert torch.allclose(adv.double(), ref, rtol=1e-6, atol=1e-6)
    # the float64 mean of the rounded values: the exact mean is 0 up to 1e-13, each rounding <= u |A| < 1.2e-7
    assert abs(float(adv.double().mean())) < 1e-6


def test_bad_rewards_are_named() -> None:
    with pytest.raises(ValueError, match=r"rewards\[2\] is nan"):
        compute_advantages("grpo", torch.tensor([0.0, 1.0, float("nan")]), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TypeError, match="bf16"):
        compute_advantages("grpo", torch.zeros(3, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="algorithm.adv_estimator: unknown advantage estimator 'gae'"):
        compute_advantages("gae", torch.zeros(3), torch.zeros(3, dtype=torch.int64))
