"""Benchmarks: one row per evaluation (a pipeline's, or a manual `python -m parity evaluate`), benchmarks as
columns with their confidence intervals, and a grouped bar chart of the same."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st

from dashboards import bench, common, data, frames

st.title("Benchmarks")
src = common.sources()
common.sources_caption(src)


@st.cache_data(show_spinner=False, ttl=common.TTL_S)
def load_bench(tracking_uri: str, registry_url: str, outputs_dir: str, mlflow_ui: str) -> tuple[pd.DataFrame, list[str]]:
    """Registry evaluations (they know the pipeline, hence its run and correction) and every `evaluate` folder
    under outputs/eval/, each evaluation once: a folder the registry holds is matched on its `eval/<folder>`
    tail whether either side wrote it absolute or relative, and shown with its absolute path."""
    src = data.Sources(tracking_uri, registry_url, outputs_dir, mlflow_ui)
    notes: list[str] = []
    summaries, problems = data.eval_summaries(src.outputs_dir)
    notes += problems
    by_key = {bench.eval_key(p.parent): s for p, s in summaries}
    folders = {bench.eval_key(p.parent): str(p.parent.resolve()) for p, _ in summaries}
    rows: list[dict] = []
    try:
        evals = data.registry_evaluations(src.registry_url)
    except data.SourceUnavailable as e:
        evals = None
        notes.append(str(e))
    if evals is not None and not evals.empty:
        try:  # only the registry's rows need MLflow (their pipeline's run name and correction)
            runs = common.load_runs(src.tracking_uri, src.mlflow_ui)
        except data.SourceUnavailable as e:
            runs = pd.DataFrame(columns=frames.RUN_COLUMNS)
            notes.append(f"Runs and corrections are not labelled: {e}")
        for out_dir in set(evals["out_dir"].dropna().astype(str)):
            key = bench.eval_key(out_dir)
            if key not in by_key:
                try:  # an evaluation recorded elsewhere: its metrics.json holds the intervals
                    by_key[key] = data.read_json(Path(out_dir) / "metrics.json")
                except data.SourceUnavailable:
                    pass
        rows += bench.registry_rows(evals, by_key, runs, folders)
    configs = data.run_configs(src.outputs_dir)
    for path, summary in summaries:
        ck = bench.checkpoint_step((summary.get("model") or {}).get("path"))
        corr = frames.param(configs.get(ck[0], {}) if ck else {}, "algorithm.correction.name", "")
        try:
            rows += bench.file_rows(str(path.parent.resolve()), summary, corr)
        except (ValueError, AttributeError, TypeError) as e:
            notes.append(f"{path}: unexpected layout ({e})")
    return bench.one_per_evaluation(pd.DataFrame(rows, columns=bench.BENCH_COLUMNS)), notes


results, notes = load_bench(src.tracking_uri, src.registry_url, src.outputs_dir, src.mlflow_ui)
for msg in notes:
    st.warning(msg)
if results.empty:
    st.info(f"No benchmark results yet: the registry holds no evaluation and there is no `evaluate` output "
            f"under {src.outputs_dir}/eval/. Run the train-and-eval flow or `python -m parity evaluate`.")
    st.stop()

c1, c2 = st.columns([1, 3])
metrics = [m for m in bench.METRIC_NAMES if m in set(results["metric"])] or sorted(results["metric"].unique())
metric = c1.selectbox("metric", metrics, key="bench_metric")
table = bench.benchmark_table(results, metric)
if table.empty:
    st.info(f"No `{metric}` values recorded.")
    st.stop()
names = list(table["evaluation"])
picked = c2.multiselect(f"evaluations ({len(names)})", names, default=names[:12], key="bench_evaluations")
shown = table[table["evaluation"].isin(picked)] if picked else table
st.caption("Cells: value in percent [confidence interval]; one row per evaluation, newest first. A pipeline's "
           "evaluation is labelled with its run and the checkpoint's step, a manual one with its model. average: the "
           "mean over the evaluation's benchmarks (each counts once; of one benchmark, its value), the run's benchmark "
           "average on the Runs page; set: the benchmarks it is over, with their number of problems.")
sets = sorted(set(shown["set"]))
if len(sets) > 1:  # averages over different sets in one column: said
    st.info(f"The averages here are over {len(sets)} different benchmark sets ({', '.join(sets)}): an average "
            "compares only with averages over the same set.")
st.dataframe(frames.missing_as_dash(shown, list(shown.columns)), hide_index=True, width="stretch",
             column_config={"evaluation": st.column_config.TextColumn("evaluation", width="large"),
                            bench.AVERAGE_COLUMN: st.column_config.TextColumn(
                                bench.AVERAGE_COLUMN, help="mean over the benchmarks in `set`"),
                            "set": st.column_config.TextColumn("set", help="the benchmarks the average is over "
                                                                           "(their problems)"),
                            "out_dir": st.column_config.TextColumn("outputs", width="medium")})
bars = bench.chart_rows(results[results["evaluation"].isin(list(shown["evaluation"]))], metric)
st.vega_lite_chart(bars, bench.bar_spec(metric, list(shown["evaluation"])), width="stretch")

with st.expander("All results"):
    st.dataframe(results, hide_index=True, width="stretch",
                 column_config={c: st.column_config.NumberColumn(c, format="%.4f") for c in ["value", "ci_low", "ci_high"]})
