"""Regression: the history of benchmark-regression checks (the registered candidate against the champion, each in
its deploy precision, paired bootstrap per problem), both models labelled like every page, failed checks (a real
drop beyond the margin) highlighted."""

from __future__ import annotations

import altair as alt
import streamlit as st

from dashboards import common, data, frames
from parity.tracking.secrets import mask_url

st.title("Benchmark regression checks")
src = common.sources()
common.sources_caption(src)
try:
    checks = common.registry_checks(src.registry_url)
except data.SourceUnavailable as e:
    st.warning(str(e))
    st.stop()
if checks is None:
    st.info(f"The registry at {mask_url(src.registry_url)} has no regression_checks table yet (it is created by the "
            "registry's migrations on the first pipeline run).")
    st.stop()
if checks.empty:
    st.info("No regression checks recorded yet. The `benchmark-regression` flow records one per benchmark "
            "(nightly deployment: `benchmark-regression/nightly`).")
    st.stop()

d = frames.flag_checks(checks)
n_flagged = int(d["flagged"].sum())
if n_flagged:
    latest = d[d["flagged"]].iloc[0]
    st.error(f"{n_flagged} of {len(d)} checks flagged a drop. Latest: {latest['message']}")
else:
    st.success(f"All {len(d)} checks passed.")

benches = sorted(d["benchmark"].unique())
pick = st.multiselect("benchmarks", benches, key="regression_benchmarks")
shown = d[d["benchmark"].isin(pick)] if pick else d
cols = ["checked", "benchmark", "flagged", "delta", "ci_low", "ci_high", "candidate", "champion", "precision",
        "margin", "paired_problems", "message", "baseline_result_id", "candidate_result_id", "pipeline_id",
        "flow_run_id"]


def _highlight(row):  # whole row red when the check failed
    return ["background-color: rgba(255, 75, 75, 0.25)" if row["flagged"] else "" for _ in row]


st.dataframe(shown[cols].style.apply(_highlight, axis=1).format(
    {c: "{:+.2f}" for c in ("delta", "ci_low", "ci_high")} | {"margin": "{:.2f}"}), hide_index=True, width="stretch")
st.caption("delta = candidate - champion over paired problems, in points, each evaluated in its deploy precision "
           "(`precision`: the candidate's); a check fails when delta < -margin and the interval lies below 0. "
           "Models: what they were trained as, and their registered version.")

# a time axis whose ticks are minutes at least (frames.time_window), labelled as dates and times
lo, hi = frames.time_window(shown["created_at"])
chart = alt.Chart(shown).encode(
    x=alt.X("created_at:T", title="checked", scale=alt.Scale(domain=[alt.DateTime(**lo), alt.DateTime(**hi)]),
            axis=alt.Axis(format=frames.AXIS_TIME_FORMAT, labelOverlap=True, labelAngle=0)),
    color="benchmark:N")
band = chart.mark_rule(opacity=0.5).encode(y=alt.Y("ci_low:Q", title="delta (points)", axis=alt.Axis(format="+.2~f")),
                                          y2="ci_high:Q")
dots = chart.mark_point(filled=True, size=70).encode(
    y="delta:Q", shape=alt.Shape("flagged:N", scale=alt.Scale(domain=[False, True], range=["circle", "cross"])),
    tooltip=["benchmark", "checked", "candidate", "champion", "precision", "delta", "ci_low", "ci_high", "margin",
             "message"])
st.altair_chart(alt.layer(band, dots).properties(height=260, usermeta={"embedOptions": {"renderer": "svg"}}),
                width="stretch")  # SVG: the axis labels are text in the page
