"""Pure table transforms behind the pages: run rows, per-step curves with smoothing and seed bands, benchmark
tables. No I/O here, so every number the dashboard shows can be checked by hand in tests."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pandas as pd

from dashboards.data import RunRecord, mlflow_run_url

# Per-step curves the Compare page offers first (METRICS.md and the training loop name them).
CURVE_METRICS = [
    "reward/mean", "eval/accuracy", "eval/accuracy_unquantized", "mismatch/abs_prob_diff_mean", "mismatch/k3_kl",
    "correction/lambda",
    "correction/sc_term_abs", "perf/rollout_tokens_per_s",
]
# Metric names a run may carry its benchmark average under (first found wins).
BENCH_AVG_KEYS = ("eval/macro/avg@k", "eval/avg@k", "benchmark/macro_avg", "eval/benchmark_avg")
_BENCH_AVG_RE = re.compile(r"(macro|average|bench\w*_avg)", re.IGNORECASE)
# Keys that differ between seeds (or names/paths) of one configuration and so do not define it.
_NOT_CONFIG = re.compile(r"(^|\.)(seed|shuffle_seed|run_name|experiment_name|resume)$|(^|\.)(outputs_dir|out_dir|"
                         r"path|model_path|datasets_dir|export_dir|tracking_uri|registry_url)$|^tracking\.|^hydra")
_UNSET = ("", "None", "null", "none")


def param(params: dict[str, str], key: str, default: str = "") -> str:
    v = params.get(key)
    return default if v is None or v in _UNSET else str(v)


def precision_label(params: dict[str, str]) -> str:
    """'bf16' or 'wint8-aint8-kvint4_per_token_head' (the label the pipeline gives its artifacts). The seed block's `quantization` selects W8A8 and its
    vLLM kv_cache_dtype, as parity.precision resolves it."""
    q = param(params, "actor_rollout_ref.rollout.quantization")
    if q:
        kv = param(params, "actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_dtype", "bf16")
        return f"w{q}-a{q}-kv{kv}"
    w, a, kv = (param(params, f"rollout.precision.{k}", "bf16") for k in ("weights", "activations", "kv_cache"))
    return "bf16" if (w, a, kv) == ("bf16", "bf16", "bf16") else f"w{w}-a{a}-kv{kv}"


def config_key(params: dict[str, str]) -> str:
    """Short hash of the parameters that define a configuration (seeds, names and paths left out), so runs
    that differ only in their seed share a key."""
    kept = sorted((k, v) for k, v in params.items() if not _NOT_CONFIG.search(k))
    return hashlib.sha1(json.dumps(kept).encode()).hexdigest()[:8]


def bench_average(metrics: dict[str, float]) -> float | None:
    for k in BENCH_AVG_KEYS:
        if k in metrics:
            return float(metrics[k])
    for k in sorted(metrics):
        if _BENCH_AVG_RE.search(k) and ("avg" in k or "accuracy" in k):
            return float(metrics[k])
    return None


RUN_COLUMNS = ["run_name", "experiment", "stage", "model", "precision", "correction", "seed", "status",
               "final_reward", "benchmark_avg", "started", "config", "mlflow", "run_id", "parent_id"]


def runs_frame(records: Sequence[RunRecord], mlflow_ui: str) -> pd.DataFrame:
    """One row a run. A stage run (nested under a pipeline run) inherits what it lacks from its pipeline:
    the benchmark average of an evaluate sibling shows on the train run and on the pipeline."""
    by_id = {r.run_id: r for r in records}
    family: dict[str, list[RunRecord]] = {}
    for r in records:
        family.setdefault(r.parent_id or r.run_id, []).append(r)

    def related_avg(r: RunRecord) -> float | None:
        own = bench_average(r.metrics)
        if own is not None:
            return own
        for other in family.get(r.parent_id or r.run_id, []):
            v = bench_average(other.metrics)
            if v is not None:
                return v
        return None

    rows = []
    for r in records:
        params = dict(by_id[r.parent_id].params) if r.parent_id in by_id else {}
        params.update(r.params)
        rows.append({
            "run_name": r.run_name, "experiment": param(params, "experiment_name", r.experiment),
            "stage": r.tags.get("parity.stage", r.tags.get("stage", "pipeline" if r.run_id in family
                                                           and len(family[r.run_id]) > 1 else "")),
            "model": param(params, "model.name", param(params, "model.path")),
            "precision": precision_label(params),
            "correction": param(params, "algorithm.correction.name", "none") if params else "",
            "seed": param(params, "trainer.seed"), "status": r.status,
            "final_reward": r.metrics.get("reward/mean"), "benchmark_avg": related_avg(r),
            "started": pd.to_datetime(r.start_time, unit="ms") if r.start_time else pd.NaT,
            "config": config_key(params), "mlflow": mlflow_run_url(mlflow_ui, r.experiment_id, r.run_id),
            "run_id": r.run_id, "parent_id": r.parent_id or "",
        })
    return pd.DataFrame(rows, columns=RUN_COLUMNS)


def filter_runs(df: pd.DataFrame, choices: dict[str, Iterable[str]], text: str = "") -> pd.DataFrame:
    """Rows whose column values are among the chosen ones (an empty choice keeps all) and whose run name
    contains `text` (case-insensitive)."""
    mask = pd.Series(True, index=df.index)
    for col, allowed in choices.items():
        allowed = list(allowed)
        if allowed:
            mask &= df[col].astype(str).isin(allowed)
    if text:
        mask &= df["run_name"].str.contains(text, case=False, regex=False)
    return df[mask]


def ema(values: Sequence[float], weight: float) -> np.ndarray:
    """TensorBoard-style smoothing: s_t = w s_{t-1} + (1 - w) x_t from s_0 = 0, divided by 1 - w^(t+1) so
    early points are not pulled to zero. weight = 0 returns the values."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    x = np.asarray(values, dtype=np.float64)
    out = np.empty_like(x)
    s = 0.0
    for t, v in enumerate(x):
        s = weight * s + (1.0 - weight) * v
        out[t] = s / (1.0 - weight ** (t + 1))
    return out


def curves(history: pd.DataFrame, runs: pd.DataFrame, smoothing: float = 0.0, group_seeds: bool = False) -> pd.DataFrame:
    """Plot table (series, key, step, value, lo, hi, n) from a metric history (run_id, key, step, value).
    Each run is smoothed on its own; with group_seeds, runs of one configuration become one series: the mean
    over seeds at each step with the min..max band (n = seeds present at that step); otherwise lo = hi = value."""
    cols = ["series", "key", "step", "value", "lo", "hi", "n"]
    if history.empty:
        return pd.DataFrame(columns=cols)
    info = runs.set_index("run_id")
    h = history.sort_values(["run_id", "key", "step"]).copy()
    if smoothing > 0:
        h["value"] = h.groupby(["run_id", "key"], sort=False)["value"].transform(lambda s: ema(s.to_numpy(), smoothing))
    if not group_seeds:
        h["series"] = h["run_id"].map(info["run_name"])
        h["lo"] = h["hi"] = h["value"]
        h["n"] = 1
        return h[cols].reset_index(drop=True)
    h["series"] = h["run_id"].map(lambda rid: series_label(info.loc[rid]))
    g = h.groupby(["series", "key", "step"], sort=True)["value"]
    out = pd.DataFrame({"value": g.mean(), "lo": g.min(), "hi": g.max(), "n": g.count()}).reset_index()
    return out[cols]


def series_label(row: pd.Series) -> str:
    """Name of a configuration's seed group: what differs between configurations, plus its key."""
    return f"{row['correction']} | {row['precision']} | {row['model']} [{row['config']}]"


def missing_metrics(history: pd.DataFrame, run_names: dict[str, str], keys: Sequence[str]) -> list[str]:
    """'run: key' for each selected run that has no value of a selected key."""
    have = set(zip(history["run_id"], history["key"], strict=True)) if not history.empty else set()
    return [f"{name}: {k}" for rid, name in run_names.items() for k in keys if (rid, k) not in have]


def wide_csv(plot: pd.DataFrame) -> str:
    """The plotted data as CSV, one row per (series, step), one column per metric (plus bands when grouped)."""
    if plot.empty:
        return "series,step\n"
    value = plot.pivot_table(index=["series", "step"], columns="key", values="value", aggfunc="first")
    if (plot["n"] > 1).any():
        lo = plot.pivot_table(index=["series", "step"], columns="key", values="lo", aggfunc="first").add_suffix(" (min)")
        hi = plot.pivot_table(index=["series", "step"], columns="key", values="hi", aggfunc="first").add_suffix(" (max)")
        value = value.join(lo).join(hi)
    return value.reset_index().to_csv(index=False)


# ---------------------------------------------------------------- benchmarks

BENCH_COLUMNS = ["source", "run", "correction", "precision", "benchmark", "metric", "k", "value", "ci_low", "ci_high",
                 "problems", "out_dir"]
METRIC_NAMES = ("avg@k", "pass@1", "pass@k", "maj@k")


def eval_precision(summary: dict) -> str:
    eng = summary.get("engine") or {}
    return precision_label({f"rollout.precision.{k}": str(eng.get(k, "bf16")) for k in ("weights", "activations",
                                                                                         "kv_cache")})


def file_rows(out_dir: str, summary: dict, run: str, correction: str) -> list[dict[str, Any]]:
    """Long rows of one `evaluate` metrics.json: one per benchmark and metric, plus the macro average
    when there are several benchmarks. ValueError names the file when its layout is not evaluate's."""
    prec = eval_precision(summary)
    benches = summary.get("benchmarks")
    if not isinstance(benches, dict):
        raise ValueError(f"{out_dir}/metrics.json: key `benchmarks` must be an object")
    items = [(name, b.get("k"), b.get("problems"), b.get("metrics") or {}) for name, b in benches.items()]
    if len(benches) > 1:
        items.append(("macro", None, None, summary.get("macro") or {}))
    return [{"source": "file", "run": run, "correction": correction, "precision": prec, "benchmark": name,
             "metric": metric, "k": k, "value": e.get("value"), "ci_low": e.get("ci_low"), "ci_high": e.get("ci_high"),
             "problems": n, "out_dir": out_dir} for name, k, n, ms in items for metric, e in ms.items()]


def registry_rows(evals: pd.DataFrame, summaries: dict[str, dict], runs: pd.DataFrame) -> list[dict[str, Any]]:
    """Long rows of the registry's evaluation_results. The registry keeps point values; the intervals come
    from the evaluation's own metrics.json (its out_dir) when it is still there. The run and correction are
    those of the pipeline's MLflow run."""
    by_run = runs.set_index("run_id") if not runs.empty else None
    rows = []
    for r in evals.itertuples(index=False):
        metrics = json.loads(r.metrics) if isinstance(r.metrics, str) else (r.metrics or {})
        run, corr = f"pipeline {r.pipeline_id}", _override(r.overrides, "algorithm.correction.name")
        if by_run is not None and r.mlflow_run_id in by_run.index:
            run, corr = by_run.at[r.mlflow_run_id, "run_name"], by_run.at[r.mlflow_run_id, "correction"]
        cis = (((summaries.get(str(r.out_dir)) or {}).get("benchmarks") or {}).get(r.benchmark) or {}).get("metrics") or {}
        for metric, value in metrics.items():
            if metric not in METRIC_NAMES:
                continue
            ci = cis.get(metric) or {}
            rows.append({"source": "registry", "run": run, "correction": corr or "none",
                         "precision": r.precision or "bf16", "benchmark": r.benchmark, "metric": metric, "k": r.k,
                         "value": ci.get("value", value), "ci_low": ci.get("ci_low"), "ci_high": ci.get("ci_high"),
                         "problems": r.problems, "out_dir": str(r.out_dir or "")})
    return rows


def _override(overrides: Any, key: str) -> str:
    items = json.loads(overrides) if isinstance(overrides, str) else (overrides or [])
    for o in items:
        if str(o).lstrip("+~").startswith(key + "="):
            return str(o).split("=", 1)[1]
    return ""


def run_of_eval_dir(name: str) -> str:
    """evaluate names its folder <run or model>-YYYYmmdd-HHMMSS."""
    m = re.match(r"^(.*)-\d{8}-\d{6}$", name)
    return m.group(1) if m else name


def fmt_ci(value: float | None, lo: float | None, hi: float | None) -> str:
    if value is None or pd.isna(value):
        return ""
    if lo is None or hi is None or pd.isna(lo) or pd.isna(hi):
        return f"{100 * value:.1f}"
    return f"{100 * value:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def side_by_side(bench: pd.DataFrame, metric: str, by: str = "run") -> pd.DataFrame:
    """Rows (by, benchmark), one column per rollout precision: 'value [ci_low, ci_high]' in percent, the
    latest evaluation of each (by, benchmark, precision)."""
    d = bench[bench["metric"] == metric]
    if d.empty:
        return pd.DataFrame()
    d = d.drop_duplicates([by, "benchmark", "precision"], keep="last").copy()
    d["cell"] = [fmt_ci(v, lo, hi) for v, lo, hi in zip(d["value"], d["ci_low"], d["ci_high"], strict=True)]
    t = d.pivot(index=[by, "benchmark"], columns="precision", values="cell").fillna("")
    order = ["bf16", *sorted(c for c in t.columns if c != "bf16")]
    return t[[c for c in order if c in t.columns]].reset_index()


# ---------------------------------------------------------------- regression checks and precision reports

def flag_checks(checks: pd.DataFrame) -> pd.DataFrame:
    """Regression checks with a `flagged` column (the check failed: a real drop beyond the margin), newest
    first, deltas and intervals in points of percent."""
    d = checks.copy()
    d["flagged"] = ~d["passed"].astype(bool)
    for c in ("delta", "ci_low", "ci_high", "margin"):
        d[c] = 100.0 * d[c].astype(float)
    return d.iloc[::-1].reset_index(drop=True)


def _scalars(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_scalars(v, f"{prefix}{k}."))
        elif isinstance(v, bool | int | float | str) or v is None:
            out[f"{prefix}{k}"] = v
    return out


def report_rows(folder: str, report: dict) -> list[dict[str, Any]]:
    """One row per precision mode of validation reports. `python -m parity validate` writes one mode per
    report (parity.precision.validate: `quant` describes the quantized side, `metrics` the mismatch and
    accuracy, `failures`/`passed` the threshold verdict); a report with `modes` (an object keyed by mode, or
    a list of objects with `mode`) gives one row each. Thresholds become `threshold.<name>` columns."""
    modes = report.get("modes")
    if isinstance(modes, dict):
        return [{"report": folder, "mode": str(m), **_scalars(v if isinstance(v, dict) else {"value": v})}
                for m, v in modes.items()]
    if isinstance(modes, list):
        return [{"report": folder, "mode": str(v.get("mode", v.get("name", i))), **_scalars(v)}
                for i, v in enumerate(modes) if isinstance(v, dict)]
    quant = report.get("quant") if isinstance(report.get("quant"), dict) else {}
    if any(k in quant for k in ("weights", "activations", "kv_cache")):
        mode = precision_label({f"rollout.precision.{k}": str(quant.get(k, "bf16"))
                                for k in ("weights", "activations", "kv_cache")})
    else:
        mode = str(report.get("mode") or report.get("precision") or folder)  # a quantized HF model: its folder
    row: dict[str, Any] = {"report": folder, "mode": mode}
    if quant.get("engine"):
        row["engine"] = str(quant["engine"])
    if "passed" in report:
        row["passed"] = bool(report["passed"])
    failures = report.get("failures")
    if isinstance(failures, list):
        row["failures"] = "; ".join(map(str, failures))
    row.update(_scalars(report["metrics"]) if isinstance(report.get("metrics"), dict) else {})
    if isinstance(report.get("thresholds"), dict):
        row.update(_scalars(report["thresholds"], "threshold."))
    skip = {"modes", "quant", "metrics", "thresholds", "failures", "passed", "mode", "precision"}
    row.update({k: v for k, v in _scalars({k: v for k, v in report.items() if k not in skip}).items() if k not in row})
    return [row]


def curve_spec(key: str, banded: bool, points: bool) -> dict[str, Any]:
    """Vega-Lite spec of one metric's curves over the plot table's columns (written by hand: building it
    through Altair costs ~0.15 s a chart, most of a cached page's time)."""
    x = {"field": "step", "type": "quantitative", "title": "step", "axis": {"format": "d", "tickMinStep": 1}}
    color = {"field": "series", "type": "nominal", "title": None}
    line = {"mark": {"type": "line", "point": points},
            "encoding": {"x": x, "color": color,
                         "y": {"field": "value", "type": "quantitative", "title": key, "scale": {"zero": False},
                               "axis": {"format": "~g"}},
                         "tooltip": [{"field": "series", "type": "nominal"}, {"field": "step", "type": "quantitative"},
                                     {"field": "value", "type": "quantitative", "format": ".6g"},
                                     {"field": "n", "type": "quantitative", "title": "seeds"}]}}
    band = {"mark": {"type": "area", "opacity": 0.2},
            "encoding": {"x": x, "color": color, "y": {"field": "lo", "type": "quantitative"}, "y2": {"field": "hi"}}}
    return {"height": 260, "layer": [band, line] if banded else [line]}
