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


def heldout_at(run: dict, step: int) -> float | None:
    """Held-out accuracy of the run's trained weights (exact engine) evaluated at `step`, or None."""
    for s, v in run.get("evals", {}).get("heldout_unquantized", []):
        if s == step:
            return v
    return None


def common_eval_step(results: list[dict]) -> int | None:
    """The last held-out evaluation step that every run has: where runs cut at different steps compare alike."""
    steps = [{s for s, _ in r.get("evals", {}).get("heldout_unquantized", [])} for r in results if "error" not in r]
    both = set.intersection(*steps) if steps else set()
    return max(both) if both else None


def reference_arm(results: list[dict]) -> str | None:
    """The unperturbed, uncorrected arm (source bf16, correction none), against which the gains are read."""
    for r in results:
        lab = r.get("labels", {})
        if "error" not in r and lab.get("source") == "bf16" and lab.get("correction") == "none" and not lab.get("extra"):
            return r["arm"]
    return None


def gains_at(results: list[dict], step: int) -> list[dict]:
    """Per arm at `step`: held-out accuracy (mean, s.e.), its gain over the arm's own start (mean, s.e. of the
    per-seed gains), and the difference from the reference arm's accuracy (seeds paired: runs of one seed start
    from the same weights)."""
    groups = group_by_arm(results)
    ref = reference_arm(results)
    ref_by_seed = {r["seed"]: heldout_at(r, step) for r in groups.get(ref, [])} if ref else {}
    rows = []
    for arm, rs in groups.items():
        acc = [heldout_at(r, step) for r in rs]
        gain = [heldout_at(r, step) - heldout_at(r, 0) if heldout_at(r, step) is not None and heldout_at(r, 0)
                is not None else None for r in rs]
        diff = [heldout_at(r, step) - ref_by_seed[r["seed"]] if heldout_at(r, step) is not None and
                ref_by_seed.get(r["seed"]) is not None else None for r in rs]
        rows.append({"arm": arm, "step": step, "heldout": dict(zip(("mean", "se", "n"), mean_se(acc))),
                     "gain": dict(zip(("mean", "se", "n"), mean_se(gain))),
                     "gain_per_seed": {r["seed"]: g for r, g in zip(rs, gain, strict=True)},
                     "vs_reference": dict(zip(("mean", "se", "n"), mean_se(diff))) if ref and arm != ref else None})
    return rows


def _pts(d: dict | None) -> str:
    if not d or d.get("mean") is None:
        return "—"
    return f"{100 * d['mean']:+.1f}" + (f" ± {100 * d['se']:.1f}" if d.get("se") is not None else "")


def gains_table(results: list[dict]) -> str:
    """Held-out accuracy at the last evaluation step every run has, in points: the arms compared at one step."""
    step = common_eval_step(results)
    if step is None:
        return ""
    ref = reference_arm(results)
    lines = [f"Held-out accuracy of the trained weights at step {step}, the last evaluation every run reached "
             f"(points; mean ± s.e. over seeds; reference arm: {ref or '—'}, compared seed by seed):", "",
             "| arm | held-out at step " + str(step) + " | gain over its start | per seed | vs reference (paired) |",
             "|---|---|---|---|---|"]
    for row in gains_at(results, step):
        h = row["heldout"]
        acc = "—" if h["mean"] is None else f"{100 * h['mean']:.1f}" + (f" ± {100 * h['se']:.1f}" if h["se"] else "")
        per = ", ".join(f"{100 * g:+.1f}" for _, g in sorted(row["gain_per_seed"].items()) if g is not None)
        lines.append(f"| {row['arm']} | {acc} | {_pts(row['gain'])} | {per} | {_pts(row['vs_reference'])} |")
    return "\n".join(lines) + "\n"


def table(results: list[dict]) -> str:
    """The Markdown table: one row per arm, mean ± s.e. over its seeds."""
    lines = ["| arm | seeds | steps done | reward start → final (peak) | held-out acc, trained weights unquantized: start → final | "
             "held-out acc, rollout engine | collapsed (mean step) | mean abs(p − q) | drift cos(θ−θ0, Δ) final |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm, rs in group_by_arm(results).items():
        steps = [r["collapse_step"] for r in rs if r["collapse_step"] is not None]
        collapse = f"{len(steps)}/{len(rs)}" + (f" (step {statistics.fmean(steps):.0f})" if steps else "")
        mm = mean_se([r.get("mismatch_mean") for r in rs])[0]
        done = sorted(r.get("steps", 0) for r in rs)
        done_s = f"{done[0]}" if done[0] == done[-1] else f"{done[0]}-{done[-1]}"
        if any(r.get("partial") for r in rs):
            done_s += " (stopped early)"
        lines.append(
            f"| {arm} | {len(rs)} | {done_s} | {_fmt([r['initial_reward'] for r in rs])} → {_fmt([r['final_reward'] for r in rs])} "
            f"({_fmt([r['peak_reward'] for r in rs])}) | {_fmt([r['heldout_initial'] for r in rs])} → "
            f"{_fmt([r['heldout_final'] for r in rs])} | {_fmt([r.get('heldout_engine_final') for r in rs])} | "
            f"{collapse} | {'—' if mm is None else f'{mm:.2e}'} | {_fmt([r.get('delta_cosine_final') for r in rs])} |")
    for r in results:
        if "error" in r:
            last = ([ln for ln in r["error"].strip().splitlines() if ln.strip() and "HYDRA_FULL_ERROR" not in ln]
                    or ["?"])[-1][:140]
            lines.append(f"| {r['arm']} | seed {r['seed']} failed | | {last} | | | | | |")
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


def r_is_reference(runs: list[dict]) -> bool:
    """Whether these runs are an uncorrected arm (drawn beside the duals for comparison)."""
    return all(r.get("labels", {}).get("correction") == "none" for r in runs)


def figures(results: list[dict], out_dir: Path, title: str, smooth: int = 5) -> list[Path]:
    """reward_curves.png, drift_curves.png, dual_diagnosis.png (when a dual ran) and final_accuracy.png in
    `out_dir`."""
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
    for rs in groups.values():  # study.json files written before the key existed
        for r in rs:
            r["evals"].setdefault("heldout_unquantized", r["evals"].get("eval/accuracy_unquantized")
                                  or r["evals"].get("eval/accuracy", []))
    curve_panel(axes[1], "heldout_unquantized", "evals", 1, "held-out accuracy, trained weights on an exact engine")
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

    duals = {arm: rs for arm, rs in groups.items()
             if any(r.get("labels", {}).get("correction", "").startswith("dual") for r in rs)
             or r_is_reference(rs)}
    if any(arm for arm, rs in duals.items() if not r_is_reference(rs)):
        keys = [("correction/lambda", "lambda (the price of the gap)"),
                ("correction/dual_delta_mean", "D: mean over responses of mean |p − q|"),
                ("correction/dual_c", "c: the tolerance"),
                ("correction/shift_over_adv", "mean |lambda-shift| / mean |A| over tokens"),
                ("response/entropy", "sampler entropy (nats/token)"),
                ("response/length_mean", "response length (tokens)")]
        fig, axes = plt.subplots(2, 3, figsize=(14, 7))
        for ax, (key, label) in zip(axes.flat, keys):
            for i, (arm, rs) in enumerate(groups.items()):
                if arm not in duals:
                    continue
                b = _band(rs, key, "curves", 1 if key.startswith("correction/") else smooth)
                if b is None:
                    continue
                steps, mean, lo, hi = b
                ax.plot(steps, mean, color=colors(i), label=arm, lw=1.6)
                ax.fill_between(steps, lo, hi, color=colors(i), alpha=0.18, lw=0)
            ax.set_title(label, fontsize=9)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
        handles: dict = {}
        for ax in axes.flat:
            for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(lab, h)
        fig.legend(list(handles.values()), list(handles), fontsize=7, loc="lower center", ncol=min(4, len(handles)))
        fig.suptitle(title + ": the dual's diagnosis (band ± s.e. over seeds)", fontsize=10)
        fig.tight_layout(rect=(0, 0.06, 1, 1))
        paths.append(out_dir / "dual_diagnosis.png")
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
