"""Mismatch telemetry against hand computations, and StepMetrics' independence of the micro-batch split."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from parity.algorithms import StepMetrics, record_mismatch

NAN = float("nan")


def _record(p_train: list[list[float]], p_inf: list[list[float]], metrics: StepMetrics, tol: float = 0.2) -> None:
    pt, pi = torch.tensor(p_train, dtype=torch.float64), torch.tensor(p_inf, dtype=torch.float64)
    mask = ~torch.isnan(pt)
    # padding holds garbage on purpose
    record_mismatch(metrics, torch.where(mask, pt.log(), 5.0).float(), torch.where(mask, pi.log(), NAN).float(), mask, tol)


def test_values_by_hand() -> None:
    m = StepMetrics()
    _record([[0.5, 0.25], [0.9, NAN]], [[0.4, 0.5], [0.9, NAN]], m)
    out = m.compute()
    r = [1.25, 0.5, 1.0]
    # The inputs are float32 roundings of log p (u |log p| each, the same on every CPU); the metrics are float64.
    # So each value is off by a few u of its terms: the worst, k1 = mean(log p_inf - log p_train), cancels to 0.157
    # from terms summing to 3.7 u: 5e-7 relative, under 1e-6.
    assert out["mismatch/tokens"] == 3
    assert out["mismatch/abs_prob_diff_mean"] == pytest.approx(0.35 / 3, rel=1e-6)
    assert out["mismatch/abs_prob_diff_max"] == pytest.approx(0.25, rel=1e-6)
    assert out["mismatch/k1_kl"] == pytest.approx(-(math.log(1.25) + math.log(0.5)) / 3, rel=1e-6)
    assert out["mismatch/k3_kl"] == pytest.approx(sum(x - 1 - math.log(x) for x in r) / 3, rel=1e-6)
    assert out["mismatch/chi2"] == pytest.approx((0.0625 + 0.25) / 3, rel=1e-6)
    assert out["mismatch/ess"] == pytest.approx(2.75 ** 2 / (3 * (1.5625 + 0.25 + 1.0)), rel=1e-6)
    assert out["mismatch/frac_over_tol"] == pytest.approx(1 / 3)
    assert out["mismatch/prob_pearson"] == pytest.approx(statistics.correlation([0.5, 0.25, 0.9], [0.4, 0.5, 0.9]), rel=1e-6)
    assert out["mismatch/ppl_ratio"] == pytest.approx((1 / math.sqrt(0.625) + 1.0) / 2, rel=1e-6)
    assert not any("#" in k for k in out)


def test_on_policy_is_the_identity() -> None:
    m = StepMetrics()
    _record([[0.5, 0.25], [0.9, 0.1]], [[0.5, 0.25], [0.9, 0.1]], m)
    out = m.compute()
    assert out["mismatch/k3_kl"] == 0 and out["mismatch/abs_prob_diff_max"] == 0 and out["mismatch/chi2"] == 0
    # float64 of equal inputs: 1 up to a few float64 roundings (~1e-15), inside pytest.approx's default 1e-6
    assert out["mismatch/ess"] == pytest.approx(1.0) and out["mismatch/prob_pearson"] == pytest.approx(1.0)
    assert out["mismatch/ppl_ratio"] == pytest.approx(1.0)


@pytest.mark.parametrize("split", [[1, 1, 1, 1, 1, 1], [4, 2], [3, 3]])
def test_split_invariance(split: list[int]) -> None:
    g = torch.Generator().manual_seed(0)
    b, r = 6, 9
    mask = torch.arange(r)[None] < torch.tensor([9, 1, 4, 0, 7, 3])[:, None]
    lt = torch.log(torch.rand(b, r, generator=g) * 0.98 + 0.01)
    li = lt + 0.05 * torch.randn(b, r, generator=g)
    whole = StepMetrics()
    record_mismatch(whole, lt, li, mask, 0.01)
    whole.add_masked_mean("x/mean", lt, mask)
    parts = StepMetrics()
    start = 0
    for n in split:
        s = slice(start, start + n)
        record_mismatch(parts, lt[s], li[s], mask[s], 0.01)
        parts.add_masked_mean("x/mean", lt[s], mask[s])
        start += n
    a, c = whole.compute(), parts.compute()
    assert a.keys() == c.keys()
    # the same float32 inputs, float64 arithmetic: only the grouping of sums of <= 33 terms changes, within
    # 33 * 2^-53 ~ 4e-15 of their magnitudes; 1e-12 leaves room for the cancellation in pearson's moments
    for k in a:
        assert c[k] == pytest.approx(a[k], rel=1e-12, abs=1e-15), k


def test_step_metrics_kinds() -> None:
    m = StepMetrics()
    m.add_masked_max("m/max", torch.tensor([1.0, 7.0]), torch.tensor([True, False]))
    m.add_masked_max("m/max", torch.tensor([3.0]), torch.tensor([True]))
    m.add_masked_max("m/none", torch.tensor([3.0]), torch.tensor([False]))
    m.add_mean("m/mean", torch.tensor(6.0), 4)
    m.add_mean("m/empty", 0.0, 0)
    m.set_value("m/value", 0.5)
    out = m.compute()
    assert out == {"m/max": 3.0, "m/mean": 1.5, "m/value": 0.5}
    m.reset()
    assert m.compute() == {}
