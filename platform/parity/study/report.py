"""A study's table (mean +- standard error over seeds, per arm) and its figures (matplotlib, PNG)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path


def mean_se(values: list[float | None]) -> tuple[float | None, float | None, int]:
    """(mean, standard error of the mean = sample std / sqrt(n), n) over the values that exist; se None for n < 2."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not xs:
        return None, None, 0
    if len(xs) == 1:
        return xs[0], None, 1
    return statistics.fmean(xs), statistics.stdev(xs) / math.sqrt(len(xs)), len(xs)


def _fmt(values: list[float | None], digits: int = 3) -> str:
    m, se, n = mean_se(values)
    if m is None:
        return "—"
    return f"{m:.{digits}f}" + (f" ± {se:.{digits}f}" if se is not None else "")


def group_by_arm(results: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in results:
        if "error" not in r:
            groups.setdefault(r["arm"], []).append(r)
    return groups


def arm_rows(results: list[dict]) -> list[dict]:
    """One summary per arm: the statistics of the table, as numbers (for study.json and tests)."""
    rows = []
    for arm, rs in group_by_arm(results).items():
        steps = [r["collapse_step"] for r in rs if r["collapse_step"] is not None]
        row = {"arm": arm, "labels": rs[0].get("labels", {}), "seeds": sorted(r["seed"] for r in rs),
               "collapsed": len(steps), "collapse_step_mean": statistics.fmean(steps) if steps else None}
        for key in ("initial_reward", "final_reward", "peak_reward", "heldout_initial", "heldout_final",
                    "heldout_engine_final", "mismatch_mean", "delta_cosine_final"):
            m, se, n = mean_se([r.get(key) for r in rs])
            row[key] = {"mean": m, "se": se, "n": n}
        rows.append(row)
    return rows


def table(results: list[dict]) -> str:
    """The Markdown table: one row per arm, mean ± s.e. over its seeds."""
    lines = ["| arm | seeds | reward start → final (peak) | held-out acc, trained weights unquantized: start → final | "
             "held-out acc, rollout engine | collapsed (mean step) | mean abs(p − q) | drift cos(θ−θ0, Δ) final |",
             "|---|---|---|---|---|---|---|---|"]
    for arm, rs in group_by_arm(results).items():
        steps = [r["collapse_step"] for r in rs if r["collapse_step"] is not None]
        collapse = f"{len(steps)}/{len(rs)}" + (f" (step {statistics.fmean(steps):.0f})" if steps else "")
        mm = mean_se([r.get("mismatch_mean") for r in rs])[0]
        lines.append(
            f"| {arm} | {len(rs)} | {_fmt([r['initial_reward'] for r in rs])} → {_fmt([r['final_reward'] for r in rs])} "
            f"({_fmt([r['peak_reward'] for r in rs])}) | {_fmt([r['heldout_initial'] for r in rs])} → "
            f"{_fmt([r['heldout_final'] for r in rs])} | {_fmt([r.get('heldout_engine_final') for r in rs])} | "
            f"{collapse} | {'—' if mm is None else f'{mm:.2e}'} | {_fmt([r.get('delta_cosine_final') for r in rs])} |")
    for r in results:
        if "error" in r:
            last = ([ln for ln in r["error"].strip().splitlines() if ln.strip() and "HYDRA_FULL_ERROR" not in ln]
                    or ["?"])[-1][:140]
            lines.append(f"| {r['arm']} | seed {r['seed']} failed | {last} | | | | | |")
    return "\n".join(lines) + "\n"


# ---- figures ------------------------------------------------------------------------------------------------

def _smooth(y: list[float], window: int) -> list[float]:
    if window <= 1:
        return y
    out, acc = [], 0.0
    for i, v in enumerate(y):
        acc += v
        if i >= window:
            acc -= y[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _band(runs: list[dict], key: str, source: str = "curves", window: int = 1):
    """steps, mean, lo, hi (mean ± s.e. over seeds) of one curve, on the steps every seed has."""
    series = [dict((s, v) for s, v in r[source].get(key, [])) for r in runs]
    series = [s for s in series if s]
    if not series:
        return None
    steps = sorted(set.intersection(*(set(s) for s in series)))
    if not steps:
        return None
    ys = [_smooth([s[t] for t in steps], window) for s in series]
    mean = [statistics.fmean(col) for col in zip(*ys)]
    if len(ys) > 1:
        se = [statistics.stdev(col) / math.sqrt(len(col)) for col in zip(*ys)]
    else:
        se = [0.0] * len(mean)
    return steps, mean, [m - e for m, e in zip(mean, se)], [m + e for m, e in zip(mean, se)]


def figures(results: list[dict], out_dir: Path, title: str, smooth: int = 5) -> list[Path]:
    """reward_curves.png, drift_curves.png and final_accuracy.png in `out_dir`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = group_by_arm(results)
    colors = plt.get_cmap("tab10" if len(groups) <= 10 else "tab20")
    paths = []

    def curve_panel(ax, key: str, source: str = "curves", window: int = smooth, label: str | None = None) -> None:
        for i, (arm, rs) in enumerate(groups.items()):
            b = _band(rs, key, source, window)
            if b is None:
                continue
            steps, mean, lo, hi = b
            ax.plot(steps, mean, color=colors(i), label=arm, lw=1.6)
            ax.fill_between(steps, lo, hi, color=colors(i), alpha=0.18, lw=0)
            hits = [r["collapse_step"] for r in rs if r.get("collapse_step") is not None]
            for s in hits:
                ax.axvline(s, color=colors(i), ls=":", lw=0.9)
        ax.set_title(label or key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    curve_panel(axes[0], "reward/mean", label=f"sampled reward (mean of {smooth} steps; band ± s.e. over seeds; "
                                              "dotted: collapse alarm)")
    curve_panel(axes[1], "eval/accuracy_unquantized", "evals", 1, "held-out accuracy, trained weights unquantized")
    if not any(r["evals"].get("eval/accuracy_unquantized") for rs in groups.values() for r in rs):
        axes[1].cla()
        curve_panel(axes[1], "eval/accuracy", "evals", 1, "held-out accuracy (rollout engine)")
    axes[0].legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    paths.append(out_dir / "reward_curves.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    keys = [("mismatch/abs_prob_diff_mean", "mean abs(p_train − p_inf)"),
            ("drift/delta_cosine", "cos(θ_t − θ_0, Δ)"), ("drift/adv_token_mean", "token-weighted mean advantage"),
            ("response/length_mean", "response length (tokens)"), ("response/entropy", "sampler entropy (nats/token)"),
            ("response/repeat_4gram_frac", "repeated 4-grams")]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    for ax, (key, label) in zip(axes.flat, keys):
        curve_panel(ax, key, label=label)
    axes.flat[0].legend(fontsize=7, loc="best")
    fig.suptitle(title + ": mismatch and drift", fontsize=10)
    fig.tight_layout()
    paths.append(out_dir / "drift_curves.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    rows = arm_rows(results)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.75 * len(rows) + 2), 4.2))
    xs = range(len(rows))
    for key, off, name in (("heldout_final", -0.2, "held-out acc, unquantized weights"),
                           ("final_reward", 0.2, "final sampled reward")):
        ax.bar([x + off for x in xs], [r[key]["mean"] or 0.0 for r in rows], width=0.38,
               yerr=[r[key]["se"] or 0.0 for r in rows], capsize=3, label=name, alpha=0.85)
    ax.set_xticks(list(xs), [r["arm"] for r in rows], rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("mean ± s.e. over seeds", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(title + ": final outcome per arm", fontsize=10)
    fig.tight_layout()
    paths.append(out_dir / "final_accuracy.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
