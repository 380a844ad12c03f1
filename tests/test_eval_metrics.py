"""avg@k, unbiased pass@k, maj@k against hand computations; bootstrap intervals."""

import math
from fractions import Fraction
from itertools import combinations

import numpy as np
import pytest

from parity.evaluation.metrics import (
    benchmark_metrics,
    bootstrap_replicates,
    estimate,
    format_table,
    macro_average,
    majority_index,
    pass_at_k,
    pass_curve,
    per_problem_avg,
    per_problem_maj,
    per_problem_pass,
    vote_key,
)


def brute_pass_at_k(row: list[int], k: int) -> float:
    """Fraction of the k-subsets of the n samples that hold at least one correct sample."""
    subsets = list(combinations(range(len(row)), k))
    return float(Fraction(sum(any(row[i] for i in s) for s in subsets), len(subsets)))


def test_pass_at_k_by_hand():
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 1, 2) == 0.5
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10 (exact binomials, a division and 1 - x: two float64 roundings,
    # <= 2.2e-16, in pure Python: the same on every CPU)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-15)
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0  # n - c < k
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3, abs=1e-15)  # pass@1 = c/n
    # n=32, c=1, k=8: exactly k/n
    assert pass_at_k(32, 1, 8) == pytest.approx(0.25, abs=1e-15)


@pytest.mark.parametrize("row", [[0, 1, 0, 0, 1], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 1]])
def test_pass_at_k_equals_subset_enumeration(row):
    for k in range(1, len(row) + 1):
        assert pass_at_k(len(row), sum(row), k) == pytest.approx(brute_pass_at_k(row, k), abs=1e-14)


def test_pass_at_k_large_n_is_finite_and_exact():
    # C(2000, 1000) overflows float64; the estimator must not.
    v = pass_at_k(2000, 3, 1000)
    exact = 1 - Fraction(math.comb(1997, 1000), math.comb(2000, 1000))
    assert v == pytest.approx(float(exact), rel=1e-12)


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError, match="n=4, c=5"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(4, 1, 5)


def test_avg_and_pass_per_problem():
    c = np.array([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert per_problem_avg(c).tolist() == [0.5, 0.0, 1.0]
    assert per_problem_pass(c, 1).tolist() == [0.5, 0.0, 1.0]
    # problem 0: n=4 c=2 k=2 -> 1 - C(2,2)/C(4,2) = 5/6
    assert per_problem_pass(c, 2).tolist() == pytest.approx([5 / 6, 0.0, 1.0], abs=1e-15)
    assert pass_curve(c) == pytest.approx({1: 0.5, 2: (5 / 6 + 1) / 3, 4: 2 / 3})


def test_vote_key_normalises_spacing_and_delimiters():
    assert vote_key(" \\left( 1, 2 \\right) ") == vote_key("(1,2)") == "(1,2)"
    assert vote_key("\\dfrac{1}{2}") == vote_key("\\frac{1}{2}")
    assert vote_key("$5$") == "5"
    assert vote_key(None) is None and vote_key("  ") is None


def test_majority_by_hand():
    assert majority_index(["3", "4", "4", "3", "4"]) == 1  # 4 wins 3:2, first seen at 1
    assert majority_index(["3", "4", "4", "3"]) == 0  # tie 2:2 -> the answer seen first
    assert majority_index(["4", "3", "3", "4"]) == 0
    assert majority_index([None, "7", None]) == 1  # missing answers do not vote
    assert majority_index([None, None]) is None
    assert majority_index(["1 / 2", "1/2", "0.5"]) == 0  # spacing-equal answers pool their votes


def test_maj_at_k_by_hand():
    answers = [
        ["3", "4", "4", "3", "4"],  # majority 4 (wrong here) -> 0
        ["3", "4", "4", "3", "3"],  # majority 3 (right) -> 1
        [None, None, "9", None, None],  # single vote, right -> 1
        [None] * 5,  # no answer -> 0
    ]
    correct = np.array([
        [1, 0, 0, 1, 0],
        [1, 0, 0, 1, 1],
        [0, 0, 1, 0, 0],
        [0, 0, 0, 0, 0],
    ])
    assert per_problem_maj(correct, answers, 5).tolist() == [0.0, 1.0, 1.0, 0.0]
    # first 4 samples only: problem 0 is a 2:2 tie won by "3" (first seen) -> right; problem 1 the same
    assert per_problem_maj(correct, answers, 4).tolist() == [1.0, 1.0, 1.0, 0.0]
    m = benchmark_metrics(correct, answers, n_boot=200, seed=0)
    assert m["maj@k"].value == 0.5
    assert m["avg@k"].value == pytest.approx((0.4 + 0.6 + 0.2 + 0.0) / 4)
    assert m["pass@1"].value == pytest.approx(m["avg@k"].value)
    assert m["pass@k"].value == 0.75


def test_bootstrap_covers_the_point_estimate_and_narrows_with_more_problems():
    rng = np.random.default_rng(0)
    widths = []
    for n in (20, 80, 320, 1280):
        values = (rng.random(n) < 0.4).astype(float)
        e = estimate(values, n_boot=2000, level=0.95, seed=1)
        assert e.ci[0] <= e.value <= e.ci[1]
        assert e.value == values.mean()
        widths.append(e.ci[1] - e.ci[0])
    assert all(a > b for a, b in zip(widths, widths[1:])), widths
    # width ~ 2 * 1.96 * sqrt(p(1-p)/n): quadrupling n halves it (within bootstrap noise)
    assert widths[-1] == pytest.approx(2 * 1.96 * math.sqrt(0.24 / 1280), rel=0.15)


def test_bootstrap_is_deterministic_and_degenerate_cases():
    v = np.array([0.0, 1.0, 1.0, 0.5])
    assert np.array_equal(bootstrap_replicates(v, 50, 3), bootstrap_replicates(v, 50, 3))
    e = estimate(np.ones(10), 100, 0.95, 0)
    assert e.ci == (1.0, 1.0) and e.value == 1.0


def test_macro_average_and_table():
    a = estimate(np.array([1.0, 0.0, 1.0, 1.0]), 500, 0.9, 0)
    b = estimate(np.array([0.0, 0.0]), 500, 0.9, 0)
    m = macro_average({"a": a, "b": b}, 0.9)
    assert m.value == pytest.approx((0.75 + 0.0) / 2)
    assert m.ci[0] <= m.value <= m.ci[1]
    rows = {"a": {"problems": 4, "k": 1, "metrics": {"avg@k": a.as_dict()}},
            "b": {"problems": 2, "k": 1, "metrics": {"avg@k": b.as_dict()}}}
    table = format_table(rows, {"avg@k": m.as_dict()})
    assert "| a | 4 | 1 | 75.0 [" in table and "| macro average |" in table and "37.5" in table


def test_bad_grids_are_rejected():
    with pytest.raises(ValueError, match="grid"):
        per_problem_avg(np.zeros((0, 3)))
    with pytest.raises(ValueError, match="answer rows"):
        per_problem_maj(np.zeros((2, 2)), [["1", "2"]], 2)
