"""Compare: per-step curves of chosen runs overlaid, optional smoothing, seeds of one configuration as a
mean line with a min..max band; the plotted data as CSV and the figure as PNG."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboards import common, data, frames

st.title("Compare runs")
src = common.sources()
common.sources_caption(src)
runs = common.runs_or_stop(src)

# Runs with per-step training metrics first; default to the five newest of them.
trained = runs[runs["final_reward"].notna()]
candidates = pd.concat([trained, runs[runs["final_reward"].isna()]])
dup = candidates["run_name"].duplicated(keep=False)
labels = dict(zip(candidates["run_id"], [f"{n} ({r[:6]})" if d else n for n, r, d in
                                         zip(candidates["run_name"], candidates["run_id"], dup, strict=True)],
                  strict=True))
picked = st.multiselect("runs", list(labels), default=list(trained["run_id"][:5]), format_func=labels.get,
                        key="compare_runs")
if not picked:
    st.info("Pick one or more runs to compare.")
    st.stop()

extra = [k for k in common.latest_metric_keys(src.tracking_uri, tuple(picked)) if k not in frames.CURVE_METRICS]
present = set(common.latest_metric_keys(src.tracking_uri, tuple(picked)))
default_keys = [k for k in frames.CURVE_METRICS if k in present][:4] or frames.CURVE_METRICS[:1]  # first 4 logged
c1, c2, c3 = st.columns([3, 1, 1])
keys = c1.multiselect("metrics", frames.CURVE_METRICS + extra, default=default_keys, key="compare_metrics")
smoothing = c2.slider("smoothing (EMA weight)", 0.0, 0.99, 0.0, 0.01, key="compare_smoothing")
group = c3.checkbox("group seeds of one configuration (mean, min..max band)", key="compare_group")
if not keys:
    st.info("Pick one or more metrics.")
    st.stop()

try:
    history = common.load_history(src.tracking_uri, tuple(picked), tuple(keys))
except data.SourceUnavailable as e:
    st.warning(str(e))
    st.stop()
names = {rid: labels[rid] for rid in picked}
missing = frames.missing_metrics(history, names, keys)
if missing:
    st.info("Not logged by these runs (left out of the charts): " + ", ".join(missing))
if history.empty:
    st.warning("None of the chosen runs logged any of the chosen metrics.")
    st.stop()

plot = frames.curves(history, runs, smoothing=smoothing, group_seeds=group)
for key in keys:
    d = plot[plot["key"] == key]
    if d.empty:
        continue
    st.subheader(key)
    st.vega_lite_chart(d, frames.curve_spec(key, banded=group, points=len(d) < 60), width="stretch")


def _png(plot: pd.DataFrame, keys: list[str]) -> bytes:
    from dashboards import figures  # matplotlib loads only when a figure is asked for

    return figures.curves_png(plot, keys)


c1, c2 = st.columns(2)
c1.download_button("Download data (CSV)", lambda: frames.wide_csv(plot), file_name="parity_compare.csv", mime="text/csv",
                   key="compare_csv")
c2.download_button("Download figure (PNG)", lambda: _png(plot, keys), file_name="parity_compare.png",
                   mime="image/png", key="compare_png")
with st.expander("Plotted data"):
    st.dataframe(plot, hide_index=True, width="stretch")
