"""Paired bootstrap of a benchmark against its baseline: against hand computations and a float64
loop reference, and the pass/fail rule at its edges."""

from __future__ import annotations

import numpy as np
import pytest

from parity.tracking.regression import bootstrap_mean_ci, compare, paired_differences


def test_paired_differences_by_hand():
    base = {"a": [1.0, 0.0], "b": [1.0, 1.0], "c": [0.0, 0.0], "only_base": [1.0]}
    cand = {"a": [1.0, 1.0], "b": [0.0, 1.0], "c": [0.0, 0.0], "only_cand": [0.0]}
    b, c, common = paired_differences(base, cand)
    assert common == ["a", "b", "c"]
    np.testing.assert_array_equal(b, [0.5, 1.0, 0.0])
    np.testing.assert_array_equal(c, [1.0, 0.5, 0.0])
    r = compare("x", base, cand, margin=0.0, n_boot=500)
    assert r.paired_problems == 3 and r.delta == pytest.approx(0.0) and r.passed


def test_bootstrap_matches_loop_reference():
    rng = np.random.default_rng(3)
    d = rng.choice([-1.0, -0.5, 0.0, 0.5, 1.0], size=40)
    lo, hi = bootstrap_mean_ci(d, 300, 0.9, seed=7)
    gen = np.random.default_rng(7)
    idx = gen.integers(0, len(d), size=(300, len(d)))
    reps = sorted(float(sum(d[j] for j in row) / len(d)) for row in idx)  # plain float64 loop
    assert lo == pytest.approx(np.quantile(reps, 0.05), abs=1e-12)
    assert hi == pytest.approx(np.quantile(reps, 0.95), abs=1e-12)


def test_constant_drop_fails_and_small_or_noisy_drop_passes():
    problems = [f"p{i}" for i in range(50)]
    base = {p: [1.0] for p in problems}
    drop = {p: [0.0 if i < 10 else 1.0] for i, p in enumerate(problems)}  # 20% of problems now wrong
    r = compare("aime", base, drop, margin=0.05, n_boot=2000)
    assert r.delta == pytest.approx(-0.2) and r.ci_high < 0 and not r.passed
    assert "REGRESSION" in r.message and "aime" in r.message
    assert compare("aime", base, drop, margin=0.25, n_boot=2000).passed  # drop within the margin
    noisy_base = {p: [float(i % 2)] for i, p in enumerate(problems)}
    noisy = {p: [1.0 - (i % 2) if i % 4 < 2 else float(i % 2)] for i, p in enumerate(problems)}  # 13 up, 12 down
    r2 = compare("amc", noisy_base, noisy, margin=0.0, n_boot=2000)
    assert r2.ci_low < 0 < r2.ci_high and r2.passed  # not significant: no failure


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="share no problem ids"):
        compare("math500", {"a": [1.0]}, {"b": [1.0]}, margin=0.1)
    with pytest.raises(ValueError, match="margin"):
        compare("math500", {"a": [1.0]}, {"a": [1.0]}, margin=-0.1)
    with pytest.raises(ValueError, match="ci_level"):
        bootstrap_mean_ci(np.zeros(3), 10, 1.5, 0)
