"""Benchmarks: avg@k / pass@k with confidence intervals per benchmark, BF16 next to the deployed rollout
precision, per run and per correction."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st

from dashboards import common, data, frames

st.title("Benchmarks")
src = common.sources()
common.sources_caption(src)


@st.cache_data(show_spinner=False, ttl=common.TTL_S)
def load_bench(tracking_uri: str, registry_url: str, outputs_dir: str, mlflow_ui: str) -> tuple[pd.DataFrame, list[str]]:
    """Registry evaluations first (they know the pipeline, hence run and correction), then any `evaluate`
    output under outputs/eval/ the registry does not hold (a manual `python -m parity evaluate`)."""
    src = data.Sources(tracking_uri, registry_url, outputs_dir, mlflow_ui)
    notes: list[str] = []
    summaries, problems = data.eval_summaries(src.outputs_dir)
    notes += problems
    by_dir = {str(p.parent): s for p, s in summaries}
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
        for out_dir in set(evals["out_dir"].dropna().astype(str)) - set(by_dir):
            try:  # an evaluation recorded elsewhere: its metrics.json holds the intervals
                by_dir[out_dir] = data.read_json(Path(out_dir) / "metrics.json")
            except data.SourceUnavailable:
                pass
        rows += frames.registry_rows(evals, by_dir, runs)
    known = set(evals["out_dir"].dropna().astype(str)) if evals is not None and not evals.empty else set()
    configs = data.run_configs(src.outputs_dir)
    for path, summary in summaries:
        if str(path.parent) in known:
            continue
        run = frames.run_of_eval_dir(path.parent.name)
        corr = frames.param(configs.get(run, {}), "algorithm.correction.name", "")
        try:
            rows += frames.file_rows(str(path.parent), summary, run, corr)
        except (ValueError, AttributeError, TypeError) as e:
            notes.append(f"{path}: unexpected layout ({e})")
    return pd.DataFrame(rows, columns=frames.BENCH_COLUMNS), notes


bench, notes = load_bench(src.tracking_uri, src.registry_url, src.outputs_dir, src.mlflow_ui)
for msg in notes:
    st.warning(msg)
if bench.empty:
    st.info(f"No benchmark results yet: the registry holds no evaluation and there is no `evaluate` output "
            f"under {src.outputs_dir}/eval/. Run the train-and-eval flow or `python -m parity evaluate`.")
    st.stop()

c1, c2 = st.columns(2)
metrics = [m for m in ["avg@k", "pass@k", "pass@1", "maj@k"] if m in set(bench["metric"])] or sorted(bench["metric"].unique())
metric = c1.selectbox("metric", metrics, key="bench_metric")
by = c2.radio("rows", ["run", "correction"], horizontal=True, key="bench_by")
st.caption("Cells: value in percent [confidence interval], the latest evaluation of each row at each rollout "
           "precision; columns: BF16 first, then the deployed precisions.")
table = frames.side_by_side(bench, metric, by=by)
if table.empty:
    st.info(f"No `{metric}` values recorded.")
else:
    st.dataframe(table, hide_index=True, width="stretch")

with st.expander("All results"):
    st.dataframe(bench, hide_index=True, width="stretch",
                 column_config={c: st.column_config.NumberColumn(c, format="%.4f") for c in ["value", "ci_low", "ci_high"]})
