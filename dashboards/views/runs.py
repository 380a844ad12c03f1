"""Runs: every MLflow run, filterable, each linked to its MLflow page."""

from __future__ import annotations

import streamlit as st

from dashboards import common, frames

st.title("Runs")
src = common.sources()
common.sources_caption(src)
runs = common.runs_or_stop(src)

FILTERS = ["experiment", "model", "precision", "correction", "status", "stage"]
cols = st.columns(len(FILTERS) + 1)
choices = {}
for col, name in zip(cols, FILTERS, strict=False):
    options = sorted(v for v in runs[name].astype(str).unique() if v)
    choices[name] = col.multiselect(name, options, key=f"runs_filter_{name}")
text = cols[-1].text_input("run name contains", key="runs_filter_text")
shown = frames.filter_runs(runs, choices, text)

st.write(f"{len(shown)} of {len(runs)} runs")
st.dataframe(
    shown.drop(columns=["parent_id"]),
    hide_index=True,
    width="stretch",
    column_config={
        "mlflow": st.column_config.LinkColumn("MLflow", display_text="open"),
        "final_reward": st.column_config.NumberColumn("final reward", format="%.3f"),
        "benchmark_avg": st.column_config.NumberColumn("benchmark avg", format="%.3f"),
        "started": st.column_config.DatetimeColumn("started", format="YYYY-MM-DD HH:mm"),
        "run_id": st.column_config.TextColumn("run id"),
    },
)
missing = shown[shown["final_reward"].isna() & (shown["stage"].isin(["train", ""]))]
if len(missing):
    st.caption(f"{len(missing)} run(s) logged no `reward/mean` (not a training run, or it stopped before step 1).")
