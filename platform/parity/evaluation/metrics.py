"""Evaluation metrics over a [problems x samples] grid of grades, in float64.

    avg@k   mean accuracy over the k samples of each problem, averaged over problems
    pass@k  unbiased estimator (Chen et al. 2021): 1 - C(n-c, k) / C(n, k) per problem, n samples, c correct
    maj@k   the majority answer among the first k samples (extracted answers, normalised for voting) is
            correct; ties go to the answer that appeared first, so the result is deterministic

Confidence intervals are percentile bootstraps over problems (the unit that was sampled); the macro
average's interval averages per-benchmark bootstrap replicates, the benchmarks being independent.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_VOTE_DROP = re.compile(r"\s+|\\left|\\right|\\!|\\,|\\;|\\:|\\ |\$")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    # Exact integers: the ratio of binomials is formed once, so no cancellation for n in the thousands.
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def vote_key(answer: str | None) -> str | None:
    """Answers that differ only in spacing, \\left/\\right or $ vote together; None does not vote."""
    if answer is None:
        return None
    key = _VOTE_DROP.sub("", answer).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    return key or None


def majority_index(answers: Sequence[str | None]) -> int | None:
    """Index of the first sample carrying the most frequent answer (earliest first appearance wins a
    tie); None when no sample has an answer."""
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, a in enumerate(answers):
        key = vote_key(a)
        if key is None:
            continue
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, i)
    if not counts:
        return None
    best = max(counts, key=lambda key: (counts[key], -first[key]))
    return first[best]


def per_problem_avg(correct: np.ndarray, k: int | None = None) -> np.ndarray:
    c = _grid(correct)
    k = c.shape[1] if k is None else k
    return c[:, :k].mean(axis=1)


def per_problem_pass(correct: np.ndarray, k: int) -> np.ndarray:
    c = _grid(correct)
    n = c.shape[1]
    return np.array([pass_at_k(n, int(row.sum()), k) for row in c], dtype=np.float64)


def per_problem_maj(correct: np.ndarray, answers: Sequence[Sequence[str | None]], k: int) -> np.ndarray:
    c = _grid(correct)
    if len(answers) != c.shape[0]:
        raise ValueError(f"maj@k: {len(answers)} answer rows for {c.shape[0]} problems")
    out = np.zeros(c.shape[0], dtype=np.float64)
    for p, row in enumerate(answers):
        if len(row) != c.shape[1]:
            raise ValueError(f"maj@k: problem {p} has {len(row)} answers for {c.shape[1]} grades")
        i = majority_index(row[:k])
        out[p] = 0.0 if i is None else float(c[p, i])
    return out


def _grid(correct: np.ndarray) -> np.ndarray:
    c = np.asarray(correct, dtype=np.float64)
    if c.ndim != 2 or c.shape[0] == 0 or c.shape[1] == 0:
        raise ValueError(f"grades must be a non-empty [problems, samples] grid, got shape {c.shape}")
    return c


def bootstrap_replicates(values: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """Means of `n_boot` resamples (with replacement) of the per-problem values."""
    v = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, v.shape[0], size=(n_boot, v.shape[0]))
    return v[idx].mean(axis=1)


def percentile_ci(replicates: np.ndarray, level: float) -> tuple[float, float]:
    if not 0.0 < level < 1.0:
        raise ValueError(f"confidence level must be in (0, 1), got {level}")
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(replicates, [a, 1.0 - a])
    return float(lo), float(hi)


@dataclass
class Estimate:
    value: float
    ci: tuple[float, float]
    replicates: np.ndarray  # kept for the macro average's interval

    def as_dict(self) -> dict:
        return {"value": self.value, "ci_low": self.ci[0], "ci_high": self.ci[1]}


def estimate(per_problem: np.ndarray, n_boot: int, level: float, seed: int) -> Estimate:
    reps = bootstrap_replicates(per_problem, n_boot, seed)
    return Estimate(float(np.mean(per_problem)), percentile_ci(reps, level), reps)


def pass_ks(n: int, extra: Sequence[int] = ()) -> list[int]:
    """1, 2, 4, ... up to n, plus n and any requested k <= n."""
    ks = {1, n} | {k for k in extra if 1 <= k <= n}
    k = 2
    while k < n:
        ks.add(k)
        k *= 2
    return sorted(ks)


def benchmark_metrics(correct: np.ndarray, answers: Sequence[Sequence[str | None]], n_boot: int = 1000,
                      level: float = 0.95, seed: int = 0) -> dict[str, Estimate]:
    """Metrics of one benchmark with n samples a problem, under names that are comparable across
    benchmarks sampled with different n (the macro average needs that): 'avg@k' (= avg@n),
    'pass@1', 'pass@k' (= pass@n) and 'maj@k' (= maj@n). The bootstraps share one seed, so the
    intervals of one benchmark come from the same resampled problem sets."""
    c = _grid(correct)
    n = c.shape[1]
    return {
        "avg@k": estimate(per_problem_avg(c), n_boot, level, seed),
        "pass@1": estimate(per_problem_pass(c, 1), n_boot, level, seed),
        "pass@k": estimate(per_problem_pass(c, n), n_boot, level, seed),
        "maj@k": estimate(per_problem_maj(c, answers, n), n_boot, level, seed),
    }


def pass_curve(correct: np.ndarray, extra: Sequence[int] = ()) -> dict[int, float]:
    """pass@k for k = 1, 2, 4, ... n (point estimates)."""
    c = _grid(correct)
    return {k: float(per_problem_pass(c, k).mean()) for k in pass_ks(c.shape[1], extra)}


def macro_average(per_benchmark: dict[str, Estimate], level: float) -> Estimate:
    """Unweighted mean over benchmarks (each counts once, whatever its size)."""
    if not per_benchmark:
        raise ValueError("macro average of no benchmarks")
    ests = list(per_benchmark.values())
    reps = np.mean(np.stack([e.replicates for e in ests]), axis=0)
    return Estimate(float(np.mean([e.value for e in ests])), percentile_ci(reps, level), reps)


def _cell(e: dict | None) -> str:
    return "" if e is None else f"{100 * e['value']:.1f} [{100 * e['ci_low']:.1f}, {100 * e['ci_high']:.1f}]"


def format_table(rows: dict[str, dict], macro: dict[str, dict] | None = None) -> str:
    """Markdown table in percent, `value [ci_low, ci_high]`; rows[name] = {'problems', 'k', 'metrics'}."""
    cols: list[str] = []
    for r in rows.values():
        cols += [c for c in r["metrics"] if c not in cols]
    lines = ["| benchmark | problems | k | " + " | ".join(cols) + " |", "|---" * (len(cols) + 3) + "|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['problems']} | {r['k']} | "
                     + " | ".join(_cell(r["metrics"].get(c)) for c in cols) + " |")
    if macro:
        lines.append("| macro average | | | " + " | ".join(_cell(macro.get(c)) for c in cols) + " |")
    return "\n".join(lines)
