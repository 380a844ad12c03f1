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
        lost = [r["lost_gain_step"] for r in rs if r.get("lost_gain_step") is not None]
        row = {"arm": arm, "labels": rs[0].get("labels", {}), "seeds": sorted(r["seed"] for r in rs),
               "collapsed": len(steps), "collapse_step_mean": statistics.fmean(steps) if steps else None,
               "lost_gain": len(lost), "lost_gain_step_mean": statistics.fmean(lost) if lost else None,
               "arm_lost_gain_step": arm_lost_gain_step(rs)}
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


# ---- the long horizon's rules (docs/study/grpo_study.md, "what is fixed before its arms run") ---------------

LOST_GAIN_MIN = 0.03  # a run that never gained 3 points over its start never had a gain to lose
LOST_GAIN_FROM = 30   # the first step at which a loss of the gain is read
LOST_GAIN_WINDOW = 3  # evaluations averaged (t - 20, t - 10, t at an evaluation every 10 steps)


def lost_gain_step(series: list[list[float]], window: int = LOST_GAIN_WINDOW, min_gain: float = LOST_GAIN_MIN,
                   from_step: int = LOST_GAIN_FROM) -> int | None:
    """The first evaluation step t >= `from_step` at which the mean of the `window` evaluations ending at t is at
    or below the step-0 accuracy plus half of the best such mean's gain reached before t, provided that best gain
    was at least `min_gain`; None if that never happens. `series`: [[step, accuracy], ...] with step 0 in it."""
    pts = sorted((int(s), float(v)) for s, v in series)
    if not pts or pts[0][0] != 0:
        return None
    start = pts[0][1]
    best = None
    for i in range(window - 1, len(pts)):
        t = pts[i][0]
        m = statistics.fmean(v for _, v in pts[i - window + 1:i + 1])
        if t >= from_step and best is not None and best - start >= min_gain and m <= start + 0.5 * (best - start):
            return t
        best = m if best is None else max(best, m)
    return None


def arm_curve(runs: list[dict], key: str = "heldout_unquantized") -> list[list[float]]:
    """The seeds' mean of an evaluation series, at the steps every seed has."""
    series = [dict((int(s), v) for s, v in r.get("evals", {}).get(key, [])) for r in runs]
    steps = sorted(set.intersection(*(set(d) for d in series))) if series else []
    return [[s, statistics.fmean(d[s] for d in series)] for s in steps]


def arm_lost_gain_step(runs: list[dict]) -> int | None:
    """The lost-gain rule on the arm's seed-mean exact-engine held-out curve: the step at which the corrections
    of that format are compared a second time."""
    return lost_gain_step(arm_curve(runs))


# signals read for an early warning of the collapse alarm: (curve key, what it is)
WARNING_SIGNALS = (("mismatch/abs_prob_diff_mean", "mean |p - q|"), ("mismatch/k3_kl", "k3"),
                   ("response/entropy", "entropy"), ("response/length_mean", "length"),
                   ("response/truncated_frac", "truncated fraction"), ("drift/adv_length_cov", "adv-length cov"))
ONSET_BASE = 10   # steps 1-10 are a signal's baseline
ONSET_SMOOTH = 3  # the rolling mean of the last 3 steps is compared with it
ONSET_Z = 4.0     # an onset: that mean departs from the baseline mean by more than 4 baseline standard deviations


def signal_onset(series: list[list[float]], base: int = ONSET_BASE, smooth: int = ONSET_SMOOTH,
                 z: float = ONSET_Z) -> int | None:
    """The first step after the baseline (steps 1..`base`) at which the mean of the last `smooth` values departs
    from the baseline's mean by more than `z` of its standard deviations (either way); None if it never does or
    the series is shorter than its baseline. The deviation is floored at 1% of |baseline mean| (a near-constant
    baseline does not turn rounding into onsets) and at 1e-12, so a signal at exactly 0 in its baseline (a
    truncated fraction) has its onset at its first move: its false-alarm count says whether that is useful."""
    pts = sorted((int(s), float(v)) for s, v in series if v is not None and math.isfinite(float(v)))
    head = [v for s, v in pts if s <= base]
    if len(head) < 3:
        return None
    mu, sd = statistics.fmean(head), statistics.stdev(head)
    sd = max(sd, 0.01 * abs(mu), 1e-12)
    vals = [v for _, v in pts]
    for i, (s, _) in enumerate(pts):
        if s > base and abs(statistics.fmean(vals[max(0, i - smooth + 1):i + 1]) - mu) > z * sd:
            return s
    return None


def early_warning(results: list[dict]) -> dict:
    """Per signal: its lead in steps over the collapse alarm in each collapsed run (alarm step - onset step;
    positive = it moved first, None = no onset before the alarm), and its false alarms (runs whose alarm never
    fired but whose signal had an onset)."""
    runs = [r for r in results if "error" not in r]
    out = {}
    for key, what in WARNING_SIGNALS:
        leads, false = {}, []
        for r in runs:
            onset = signal_onset(r.get("curves", {}).get(key, []))
            if r.get("collapse_step") is not None:
                c = int(r["collapse_step"])
                leads[r["name"]] = c - onset if onset is not None and onset <= c else None
            elif onset is not None:
                false.append(r["name"])
        led = [v for v in leads.values() if v is not None]
        out[key] = {"signal": what, "leads": leads, "led_every_collapse": bool(leads) and len(led) == len(leads),
                    "lead_mean": statistics.fmean(led) if led else None, "false_alarms": false,
                    "runs_without_alarm": sum(1 for r in runs if r.get("collapse_step") is None)}
    return out


def early_warning_table(results: list[dict]) -> str:
    """The early-warning table in Markdown: empty when no run's alarm fired."""
    ew = early_warning(results)
    if not any(v["leads"] for v in ew.values()):
        return ""
    lines = [f"Lead of each signal's onset over the collapse alarm (steps; onset: the 3-step mean departs from "
             f"steps 1-{ONSET_BASE} by > {ONSET_Z:g} s.d.):", "",
             "| signal | collapsed runs it led | mean lead | false alarms (runs without the alarm) |", "|---|---|---|---|"]
    for v in ew.values():
        led = sum(1 for x in v["leads"].values() if x is not None)
        lead = "—" if v["lead_mean"] is None else f"{v['lead_mean']:.1f}"
        lines.append(f"| {v['signal']} | {led}/{len(v['leads'])} | {lead} | "
                     f"{len(v['false_alarms'])}/{v['runs_without_alarm']} |")
    return "\n".join(lines) + "\n"


def _pts(d: dict | None) -> str:
    if not d or d.get("mean") is None:
        return "—"
    return f"{100 * d['mean']:+.1f}" + (f" ± {100 * d['se']:.1f}" if d.get("se") is not None else "")


def gains_table(results: list[dict], step: int | None = None, why: str = "the last evaluation every run reached") -> str:
    """Held-out accuracy at `step` (default: the last evaluation step every run has), in points: the arms
    compared at one step."""
    step = common_eval_step(results) if step is None else step
    if step is None:
        return ""
    ref = reference_arm(results)
    lines = [f"Held-out accuracy of the trained weights at step {step}, {why} "
             f"(points; mean ± s.e. over seeds; reference arm: {ref or '—'}, compared seed by seed):", "",
             "| arm | held-out at step " + str(step) + " | gain over its start | per seed | vs reference (paired) |",
             "|---|---|---|---|---|"]
    for row in gains_at(results, step):
        h = row["heldout"]
        acc = "—" if h["mean"] is None else f"{100 * h['mean']:.1f}" + (f" ± {100 * h['se']:.1f}" if h["se"] else "")
        per = ", ".join(f"{100 * g:+.1f}" for _, g in sorted(row["gain_per_seed"].items()) if g is not None)
        lines.append(f"| {row['arm']} | {acc} | {_pts(row['gain'])} | {per} | {_pts(row['vs_reference'])} |")
    return "\n".join(lines) + "\n"


HARMLESS_MIN_SEEDS = 3  # the rule's verdict needs at least this many seeds with the final evaluation


def final_rows(results: list[dict]) -> list[dict]:
    """Per arm, the larger final evaluation (512 x 4 at the last step; `heldout_large_final` on the exact engine,
    `heldout_large_deployed_final` in the rollout's format): mean ± s.e. of both, the paired difference from the
    reference arm seed by seed on the exact engine, the seeds that collapsed or lost the gain, and the "harmless"
    rule of docs/study/grpo_study.md: harmless when the paired difference lies within two standard errors of 0
    over at least HARMLESS_MIN_SEEDS seeds and no seed collapsed or lost the gain; not harmless as soon as one
    seed collapsed or lost the gain, or when the difference lies below -2 s.e.; `above` when it lies above +2 s.e.;
    else undecided. A run without the final evaluation (stopped early) counts as a missing seed."""
    groups = group_by_arm(results)
    ref = reference_arm(results)
    ref_by_seed = {r["seed"]: r.get("heldout_large_final") for r in groups.get(ref, [])} if ref else {}
    rows = []
    for arm, rs in groups.items():
        failed = sorted(r["seed"] for r in rs if r.get("collapse_step") is not None or r.get("lost_gain_step") is not None)
        diffs = {r["seed"]: r["heldout_large_final"] - ref_by_seed[r["seed"]] for r in rs
                 if r.get("heldout_large_final") is not None and ref_by_seed.get(r["seed"]) is not None}
        d = dict(zip(("mean", "se", "n"), mean_se(list(diffs.values()))))
        if arm == ref:
            verdict = "reference"
        elif failed:
            verdict = "not harmless"
        elif d["n"] < HARMLESS_MIN_SEEDS or d["se"] is None:
            verdict = f"undecided ({d['n']} seed{'s' if d['n'] != 1 else ''})"
        elif d["mean"] < -2 * d["se"]:
            verdict = "not harmless"
        elif d["mean"] > 2 * d["se"]:
            verdict = "above"
        else:
            verdict = "harmless"
        rows.append({"arm": arm, "exact": dict(zip(("mean", "se", "n"), mean_se([r.get("heldout_large_final") for r in rs]))),
                     "deployed": dict(zip(("mean", "se", "n"),
                                          mean_se([r.get("heldout_large_deployed_final") for r in rs]))),
                     "vs_reference": None if arm == ref else d, "per_seed": dict(sorted(diffs.items())),
                     "failed_seeds": failed, "verdict": verdict})
    return rows


def final_table(results: list[dict]) -> str:
    """The larger final evaluation per arm in Markdown (points), with the "harmless" rule's verdict; empty when no
    run has it."""
    rows = final_rows(results)
    if not any(r["exact"]["n"] for r in rows):
        return ""

    def acc(d: dict) -> str:
        if d["mean"] is None:
            return "—"
        return f"{100 * d['mean']:.1f}" + (f" ± {100 * d['se']:.1f}" if d["se"] is not None else "")

    lines = ["The larger final evaluation (512 problems x 4 at the last step; points, mean ± s.e. over the seeds that "
             f"have it; paired with the reference arm {reference_arm(results) or '—'} seed by seed; the harmless rule "
             f"needs {HARMLESS_MIN_SEEDS} seeds):", "",
             "| arm | exact engine | deployed format | vs reference (paired) | per seed | seeds that collapsed or lost the gain | harmless? |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        per = ", ".join(f"s{s} {100 * v:+.1f}" for s, v in r["per_seed"].items()) if r["vs_reference"] else ""
        lines.append(f"| {r['arm']} | {acc(r['exact'])} | {acc(r['deployed'])} | {_pts(r['vs_reference'])} | {per} | "
                     f"{', '.join(map(str, r['failed_seeds'])) or '—'} | {r['verdict']} |")
    return "\n".join(lines) + "\n"


def lost_gain_tables(results: list[dict]) -> str:
    """The arms compared again at each step where an uncorrected arm's seed-mean curve lost its gain."""
    by_step: dict[int, list[str]] = {}
    for arm, rs in group_by_arm(results).items():
        if rs[0].get("labels", {}).get("correction") != "none":
            continue
        step = arm_lost_gain_step(rs)
        if step is not None:
            by_step.setdefault(step, []).append(arm)
    parts = []
    for step, arms in sorted(by_step.items()):  # one table a step, naming every arm that lost its gain there
        which = f"arm {arms[0]} lost its gain" if len(arms) == 1 else f"arms {' and '.join(arms)} lost their gain"
        parts.append(gains_table(results, step, f"where the uncorrected {which}"))
    return "\n".join(parts)


def table(results: list[dict]) -> str:
    """The Markdown table: one row per arm, mean ± s.e. over its seeds."""
    lines = ["| arm | seeds | steps done | reward start → final (peak) | held-out acc, trained weights unquantized: start → final | "
             "held-out acc, rollout engine | collapsed (mean step) | lost the gain (mean step) | mean abs(p − q) | "
             "drift cos(θ−θ0, Δ) final |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, rs in group_by_arm(results).items():
        steps = [r["collapse_step"] for r in rs if r["collapse_step"] is not None]
        collapse = f"{len(steps)}/{len(rs)}" + (f" (step {statistics.fmean(steps):.0f})" if steps else "")
        lost = [r["lost_gain_step"] for r in rs if r.get("lost_gain_step") is not None]
        lost_s = f"{len(lost)}/{len(rs)}" + (f" (step {statistics.fmean(lost):.0f})" if lost else "")
        mm = mean_se([r.get("mismatch_mean") for r in rs])[0]
        done = sorted(r.get("steps", 0) for r in rs)
        done_s = f"{done[0]}" if done[0] == done[-1] else f"{done[0]}-{done[-1]}"
        if any(r.get("partial") for r in rs):
            done_s += " (stopped early)"
        lines.append(
            f"| {arm} | {len(rs)} | {done_s} | {_fmt([r['initial_reward'] for r in rs])} → {_fmt([r['final_reward'] for r in rs])} "
            f"({_fmt([r['peak_reward'] for r in rs])}) | {_fmt([r['heldout_initial'] for r in rs])} → "
            f"{_fmt([r['heldout_final'] for r in rs])} | {_fmt([r.get('heldout_engine_final') for r in rs])} | "
            f"{collapse} | {lost_s} | {'—' if mm is None else f'{mm:.2e}'} | {_fmt([r.get('delta_cosine_final') for r in rs])} |")
    for r in results:
        if "error" in r:
            last = ([ln for ln in r["error"].strip().splitlines() if ln.strip() and "HYDRA_FULL_ERROR" not in ln]
                    or ["?"])[-1][:140]
            lines.append(f"| {r['arm']} | seed {r['seed']} failed | | {last} | | | | | | |")
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

    for rs in groups.values():  # study.json files written before the key existed
        for r in rs:
            r["evals"].setdefault("heldout_unquantized", r["evals"].get("eval/accuracy_unquantized")
                                  or r["evals"].get("eval/accuracy", []))
    # the deployed model: the trained weights through the rollout's own engine (a run whose rollout is exact has
    # only that engine: its curve is the exact one, drawn as the reference)
    deployed = any(r["evals"].get("eval/accuracy_unquantized") and r["evals"].get("eval/accuracy")
                   for rs in groups.values() for r in rs)
    fig, axes = plt.subplots(1, 3 if deployed else 2, figsize=(18 if deployed else 12, 4.2))
    curve_panel(axes[0], "reward/mean", label=f"sampled reward (mean of {smooth} steps; band ± s.e. over seeds; "
                                              "dotted: collapse alarm)")
    curve_panel(axes[1], "heldout_unquantized", "evals", 1, "held-out accuracy, trained weights on an exact engine")
    if deployed:
        curve_panel(axes[2], "eval/accuracy", "evals", 1,
                    "held-out accuracy, the deployed model (trained weights in the rollout's format)")
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
