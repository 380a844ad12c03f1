"""Benchmark results of the Benchmarks page: one row per evaluation however it was found (the registry and the
`evaluate` folders under outputs/ describe the same evaluation: paths are matched on their `eval/<folder>`
tail, so an absolute and a relative spelling are one), readable labels (the pipeline's run and the
checkpoint step, or a manual evaluation's model and step), benchmarks as columns, and the grouped bar
chart with confidence intervals. Pure functions of tables, checked by hand in tests."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pandas as pd

from dashboards import frames
from dashboards.curves import PALETTE
from dashboards.frames import facts_dict, short_of_label
from parity.tracking import naming

BENCH_COLUMNS = ["evaluation", "model", "run", "correction", "precision", "benchmark", "metric", "k", "value",
                 "ci_low", "ci_high", "problems", "out_dir", "source", "key", "stamp"]
METRIC_NAMES = ("avg@k", "pass@1", "pass@k", "maj@k")
AVERAGE = "macro"  # the rows of an evaluation's average over its benchmarks (unweighted: each benchmark counts once)
AVERAGE_COLUMN = "average"  # its column in the table, beside `set`: the benchmarks (and problems) it is over
_STEP = re.compile(r"(?:^|/)runs/(?P<run>[^/]+)/checkpoints/step_0*(?P<step>\d+)/?$")
_HF_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/[0-9a-f]+/?$")
_HEXLIKE = re.compile(r"^[0-9a-f]{12,}$")
_STAMP = re.compile(r"-(?P<d>\d{8})-(?P<t>\d{6})$")


def eval_key(out_dir: str | Path) -> str:
    """`eval/<folder>`: the same evaluation whether its folder is written absolute or relative."""
    parts = Path(str(out_dir)).parts
    return "/".join(parts[-2:]) if parts else ""


def stamp_of(out_dir: str | Path) -> str:
    """'2026-12-01 10:15:00' from evaluate's `<label>-YYYYmmdd-HHMMSS` folder name, '' when it has none."""
    m = _STAMP.search(Path(str(out_dir)).name)
    if not m:
        return ""
    d, t = m["d"], m["t"]
    return f"{d[:4]}-{d[4:6]}-{d[6:]} {t[:2]}:{t[2:4]}:{t[4:]}"


def checkpoint_step(path: str | None) -> tuple[str, int] | None:
    """(run, step) of a checkpoint folder outputs/runs/<run>/checkpoints/step_<N>."""
    m = _STEP.search(str(path or "").replace("\\", "/"))
    return (m["run"], int(m["step"])) if m else None


def model_label(model: dict | None, out_dir: str) -> str:
    """What a manual `python -m parity evaluate` evaluated, in words: 'NAME v3' (a registered model),
    '<run> @ step 40' (a checkpoint of a run), 'org/name' (a hub snapshot), else the model folder's name
    (its parent's when the folder is a hash)."""
    model = model or {}
    reg = model.get("registered_model") or {}
    if reg.get("name"):
        return f"{reg['name']} v{reg.get('version', '?')}"
    path = str(model.get("path") or "")
    ck = checkpoint_step(path)
    if ck:
        return f"{ck[0]} @ step {ck[1]}"
    m = _HF_SNAPSHOT.search(path.replace("\\", "/"))
    if m:
        return f"{m['org']}/{m['name']}"
    if path:
        p = Path(path)
        names = [n for n in (p.name, p.parent.name, p.parent.parent.name) if n and not _HEXLIKE.match(n)]
        if names:
            return names[0]
    name = Path(out_dir).name
    return _STAMP.sub("", name) or name


def eval_precision(summary: dict) -> str:
    """The precision the engine of an `evaluate` output ran in, labelled like every page (naming.precision_short)."""
    eng = summary.get("engine") or {}
    return naming.precision_short(*(str(eng.get(k) or "bf16") for k in ("weights", "activations", "kv_cache")))


def _row(**kw: Any) -> dict[str, Any]:
    return {c: kw.get(c) for c in BENCH_COLUMNS}


def file_rows(out_dir: str, summary: dict, correction: str = "") -> list[dict[str, Any]]:
    """Long rows of one `evaluate` metrics.json: one per benchmark and metric, plus the average over them
    (`macro`, with its interval; of one benchmark, that benchmark's value, as the run's benchmark average in MLflow
    and on the Runs page). ValueError names the file when its layout is not evaluate's."""
    benches = summary.get("benchmarks")
    if not isinstance(benches, dict):
        raise ValueError(f"{out_dir}/metrics.json: key `benchmarks` must be an object")
    label, prec = model_label(summary.get("model"), out_dir), eval_precision(summary)
    items = [(name, b.get("k"), b.get("problems"), b.get("metrics") or {}) for name, b in benches.items()]
    if summary.get("macro"):
        items.append((AVERAGE, None, None, summary["macro"]))
    return [_row(model=label, run=label, correction=correction, precision=prec, benchmark=name, metric=metric, k=k,
                 value=e.get("value"), ci_low=e.get("ci_low"), ci_high=e.get("ci_high"), problems=n, out_dir=out_dir,
                 source="file", key=eval_key(out_dir), stamp=stamp_of(out_dir))
            for name, k, n, ms in items for metric, e in ms.items()]


def registry_rows(evals: pd.DataFrame, summaries: dict[str, dict], runs: pd.DataFrame,
                  folders: dict[str, str]) -> list[dict[str, Any]]:
    """Long rows of the registry's evaluation_results. The registry keeps point values; the intervals come
    from the evaluation's own metrics.json (found by its eval_key) when it is still there. The label is the
    pipeline's MLflow run name and the evaluated checkpoint's step; `folders` maps eval_key -> the folder's
    absolute path as the dashboard found it (a relative path the registry stored is resolved here)."""
    by_run = runs.set_index("run_id") if not runs.empty else None
    rows = []
    for r in evals.itertuples(index=False):
        metrics = json.loads(r.metrics) if isinstance(r.metrics, str) else (r.metrics or {})
        run, corr = f"pipeline {r.pipeline_id}", _override(r.overrides, "algorithm.correction.name")
        facts = facts_dict(getattr(r, "facts", None))
        if facts:  # what the evaluated model was trained as, whichever pipeline evaluated it (a regression check)
            run, corr = frames.model_label(facts), facts.get("correction") or "none"
        elif by_run is not None and r.mlflow_run_id in by_run.index:
            run, corr = by_run.at[r.mlflow_run_id, "run_name"], by_run.at[r.mlflow_run_id, "correction"]
        ck = checkpoint_step(r.artifact_path)
        model = f"{run} @ step {ck[1]}" if ck else run
        key = eval_key(r.out_dir or "")
        out_dir = folders.get(key) or (str(Path(str(r.out_dir)).resolve()) if r.out_dir else "")
        cis = (((summaries.get(key) or {}).get("benchmarks") or {}).get(r.benchmark) or {}).get("metrics") or {}
        for metric, value in metrics.items():
            if metric not in METRIC_NAMES:
                continue
            ci = cis.get(metric) or {}
            prec = getattr(r, "eval_precision", None)
            prec = prec if isinstance(prec, str) and prec else r.precision  # older rows: the artifact's
            rows.append(_row(model=model, run=run, correction=corr or "none", precision=short_of_label(prec),
                             benchmark=r.benchmark, metric=metric, k=r.k, value=ci.get("value", value),
                             ci_low=ci.get("ci_low"), ci_high=ci.get("ci_high"), problems=r.problems, out_dir=out_dir,
                             source="registry", key=key or f"registry-{r.id}", stamp=stamp_of(out_dir)))
    return rows


def _override(overrides: Any, key: str) -> str:
    items = json.loads(overrides) if isinstance(overrides, str) else (overrides or [])
    for o in items:
        if str(o).lstrip("+~").startswith(key + "="):
            return str(o).split("=", 1)[1]
    return ""


def one_per_evaluation(rows: pd.DataFrame) -> pd.DataFrame:
    """Each (evaluation, benchmark, metric) once, the registry's row first (it knows the pipeline), and an
    `evaluation` label unique per evaluation: the model, its precision where the model was evaluated at
    several, the folder's time where it was evaluated more than once."""
    if rows.empty:
        return rows
    d = rows.assign(_reg=(rows["source"] != "registry").astype(int)).sort_values("_reg", kind="stable")
    d = d.drop_duplicates(["key", "benchmark", "metric"], keep="first").drop(columns="_reg")
    per_eval = d.drop_duplicates("key")[["key", "model", "precision", "stamp"]]
    multi_prec = per_eval.groupby("model")["precision"].transform("nunique") > 1
    label = per_eval["model"] + [f" [{p}]" if m else "" for p, m in zip(per_eval["precision"], multi_prec)]
    dup = label.duplicated(keep=False)
    label = [f"{lab} ({s or k})" if dd else lab for lab, s, k, dd in zip(label, per_eval["stamp"], per_eval["key"], dup)]
    d["evaluation"] = d["key"].map(dict(zip(per_eval["key"], label)))
    return d.reset_index(drop=True)


def fmt_ci(value: float | None, lo: float | None, hi: float | None) -> str:
    if value is None or pd.isna(value):
        return ""
    if lo is None or hi is None or pd.isna(lo) or pd.isna(hi):
        return f"{100 * value:.1f}"
    return f"{100 * value:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def _set_names(d: pd.DataFrame) -> dict[str, str]:
    """evaluation -> the set its average is over, named like every page (naming.benchmark_set_short)."""
    per = d[d["benchmark"] != AVERAGE].drop_duplicates(["evaluation", "benchmark"])
    return {ev: naming.benchmark_set_short(naming.benchmark_problems(
        {b: {"problems": n} for b, n in zip(g["benchmark"], g["problems"], strict=True)}))
        for ev, g in per.groupby("evaluation", sort=False)}


def _averages(d: pd.DataFrame) -> pd.DataFrame:
    """One AVERAGE row per evaluation: the evaluation's own (with its interval), else (a registry row whose folder is
    gone) the mean of its benchmarks' values, the interval kept only where there is one benchmark."""
    own = d[d["benchmark"] == AVERAGE]
    rows = [own]
    without = d[(d["benchmark"] != AVERAGE) & ~d["evaluation"].isin(set(own["evaluation"]))]
    for _, g in without.groupby("evaluation", sort=False):
        one = len(g) == 1
        rows.append(g.iloc[:1].assign(benchmark=AVERAGE, value=g["value"].mean(), problems=g["problems"].sum(),
                                      ci_low=g["ci_low"].iloc[0] if one else None,
                                      ci_high=g["ci_high"].iloc[0] if one else None))
    return pd.concat(rows, ignore_index=True)


def benchmark_table(bench: pd.DataFrame, metric: str) -> pd.DataFrame:
    """One row per evaluation (newest folder first), one column per benchmark, then `average` (the mean over the
    evaluation's benchmarks, the number the Runs page and MLflow show) and `set` (what that average is over:
    'arithmetic (64)', '7 benchmarks (112)'): 'value [ci_low, ci_high]' in percent."""
    d = bench[bench["metric"] == metric]
    if d.empty:
        return pd.DataFrame()
    d = pd.concat([d[d["benchmark"] != AVERAGE], _averages(d)], ignore_index=True)
    d["cell"] = [fmt_ci(v, lo, hi) for v, lo, hi in zip(d["value"], d["ci_low"], d["ci_high"], strict=True)]
    info = d.drop_duplicates("evaluation").set_index("evaluation")[["correction", "precision", "out_dir", "stamp"]]
    info = info.assign(set=pd.Series(_set_names(d)))
    t = d.pivot(index="evaluation", columns="benchmark", values="cell").fillna("")
    cols = sorted(c for c in t.columns if c != AVERAGE)
    t = t.rename(columns={AVERAGE: AVERAGE_COLUMN})[[*cols, AVERAGE_COLUMN]].join(info).reset_index()
    t = t.sort_values("stamp", ascending=False, kind="stable")
    return t[["evaluation", *cols, AVERAGE_COLUMN, "set", "correction", "precision", "out_dir"]].reset_index(drop=True)


def bar_spec(metric: str, evaluations: list[str]) -> dict[str, Any]:
    """Grouped bars (benchmark on x, one bar per evaluation) with the confidence interval as an error bar, in
    percent, over the long rows' columns (value, ci_low, ci_high scaled by the page)."""
    color = {"field": "evaluation", "type": "nominal", "title": None, "scale": {"domain": evaluations, "range": PALETTE},
             "legend": {"orient": "bottom", "direction": "vertical", "labelLimit": 600}}
    x = {"field": "benchmark", "type": "nominal", "title": None, "axis": {"labelAngle": 0}}
    tooltip = [{"field": "evaluation"}, {"field": "benchmark"},
               {"field": "pct", "type": "quantitative", "title": metric, "format": ".1f"},
               {"field": "lo", "type": "quantitative", "title": "CI low", "format": ".1f"},
               {"field": "hi", "type": "quantitative", "title": "CI high", "format": ".1f"}]
    bars = {"mark": {"type": "bar"}, "encoding": {
        "x": x, "xOffset": {"field": "evaluation", "sort": evaluations}, "color": color,
        "y": {"field": "pct", "type": "quantitative", "title": f"{metric} (%)", "scale": {"domain": [0, 100]}},
        "tooltip": tooltip}}
    errs = {"mark": {"type": "rule", "color": "#333", "strokeWidth": 1.5}, "encoding": {
        "x": x, "xOffset": {"field": "evaluation", "sort": evaluations}, "y": {"field": "lo", "type": "quantitative"},
        "y2": {"field": "hi"}, "tooltip": tooltip}}
    return {"height": 260, "autosize": {"type": "fit-x", "contains": "padding"}, "layer": [bars, errs],
            "usermeta": {"embedOptions": {"renderer": "svg"}}}


def chart_rows(bench: pd.DataFrame, metric: str) -> pd.DataFrame:
    """The bars: each benchmark of each evaluation, and the evaluations' averages (`average`) where one of them has
    several benchmarks (of one, the average is that benchmark's bar again)."""
    d = bench[bench["metric"] == metric]
    several = (d[d["benchmark"] != AVERAGE].groupby("evaluation")["benchmark"].nunique() > 1).any()
    d = d if several else d[d["benchmark"] != AVERAGE]
    d = d[["evaluation", "benchmark", "value", "ci_low", "ci_high"]].replace({"benchmark": {AVERAGE: AVERAGE_COLUMN}})
    d["pct"], d["lo"], d["hi"] = 100 * d["value"], 100 * d["ci_low"], 100 * d["ci_high"]
    return d
