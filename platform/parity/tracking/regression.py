"""Paired bootstrap of a benchmark's score against its stored baseline, per problem.

Both evaluations graded the same problems; pairing by problem removes the between-problem variance
that dominates small benchmarks (AIME: 30 problems). For each problem i common to both,
d_i = mean score of the candidate's samples - mean score of the baseline's samples; the estimate is
mean(d) and its interval a percentile bootstrap over problems (the sampled unit). float64 throughout.

A check fails when the drop is both larger than the margin (mean(d) < -margin) and real: the interval's
upper end is below 0. A small noisy benchmark therefore does not fail nightly on a fluke, and a clear
drop smaller than the margin is tolerated by design."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from parity.config import as_plain


@dataclass(frozen=True)
class PairedComparison:
    benchmark: str
    paired_problems: int
    baseline_mean: float
    candidate_mean: float
    delta: float
    ci_low: float
    ci_high: float
    margin: float
    passed: bool
    message: str

    def as_dict(self) -> dict:
        return asdict(self)


def paired_differences(baseline: dict[str, list[float]], candidate: dict[str, list[float]]) -> tuple[np.ndarray, np.ndarray, list[str]]:
    common = sorted(set(baseline) & set(candidate))
    b = np.array([np.mean(np.asarray(baseline[p], dtype=np.float64)) for p in common], dtype=np.float64)
    c = np.array([np.mean(np.asarray(candidate[p], dtype=np.float64)) for p in common], dtype=np.float64)
    return b, c, common


def bootstrap_mean_ci(d: np.ndarray, n_boot: int, level: float, seed: int) -> tuple[float, float]:
    if not 0 < level < 1:
        raise ValueError(f"regression ci_level must be in (0, 1), got {level}")
    if n_boot < 1:
        raise ValueError(f"regression bootstrap must be >= 1, got {n_boot}")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(d), size=(n_boot, len(d)))
    reps = d[idx].mean(axis=1)
    alpha = (1.0 - level) / 2.0
    lo, hi = np.quantile(reps, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def compare(benchmark: str, baseline: dict[str, list[float]], candidate: dict[str, list[float]], *,
            margin: float, n_boot: int = 2000, level: float = 0.95, seed: int = 0,
            names: tuple[str, str] = ("candidate", "baseline")) -> PairedComparison:
    """`names`: what the message calls the two sides (('candidate v3', 'champion v2'))."""
    if margin < 0:
        raise ValueError(f"regression margin must be >= 0, got {margin}")
    b, c, common = paired_differences(baseline, candidate)
    if not common:
        raise ValueError(f"benchmark {benchmark!r}: the candidate and the baseline share no problem ids "
                         f"(baseline {len(baseline)}, candidate {len(candidate)} problems)")
    d = c - b
    delta = float(d.mean())
    lo, hi = bootstrap_mean_ci(d, n_boot, level, seed)
    passed = not (delta < -margin and hi < 0.0)
    verdict = "ok" if passed else "REGRESSION"
    msg = (f"{benchmark}: {verdict}: {names[0]} {c.mean():.4f} vs {names[1]} {b.mean():.4f} on {len(common)} paired "
           f"problems, delta {delta:+.4f} ({level:.0%} CI [{lo:+.4f}, {hi:+.4f}]), margin {margin:.4f}")
    return PairedComparison(benchmark, len(common), float(b.mean()), float(c.mean()), delta, lo, hi, float(margin),
                            passed, msg)


# eval keys that choose the model or where results go, not what the scores are
_NOT_SETTINGS = ("model_path", "run_name", "registered_model", "out_dir", "grade_workers", "batch_size")


def evaluation_settings(cfg) -> str:
    """A digest of everything that decides an evaluation's scores besides the model: the eval section (suite,
    sampling, k, limit, per-benchmark overrides, ...), the data's prompt template, the rollout engine and its
    precision spec, and the compute dtype. Two evaluations of one model with the same digest are the same
    measurement, so the regression check reuses a champion's stored result instead of evaluating it again."""
    import hashlib
    import json

    from parity.precision.config import resolve_precision, spec_of

    ev = as_plain(cfg.eval)
    payload = {"eval": {k: v for k, v in ev.items() if k not in _NOT_SETTINGS},
               "prompt_template": str(cfg.data.prompt_template), "engine": str(cfg.rollout.name),
               "precision": spec_of(resolve_precision(cfg)), "dtype": str(cfg.model.dtype)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:32]
