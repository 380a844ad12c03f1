"""Compare: training curves of chosen runs side by side. Runs are picked by experiment, sweep and config
(correction, precision, seed); legend labels are the config keys that differ between them; seeds of one
configuration are a mean line with a min..max band; collapse alarms are dashed markers. Opened with
`?sweep=<id>` (the link a sweep flow prints) it shows that sweep's members without any picking;
`?experiment=`, `?correction=`, `?precision=`, `?seed=` (comma-separated) preset the other filters."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboards import common, curves, data, frames

ANY = "(any)"
MAX_DEFAULT_RUNS = 12
FILTERS = ("experiment", "correction", "precision", "seed")

st.title("Compare runs")
src = common.sources()
common.sources_caption(src)
runs = common.runs_or_stop(src)
cands = frames.top_level(runs)
cands = cands[cands["train_run_id"] != ""]
if cands.empty:
    st.info("No training runs yet: the store holds no run with a train stage or per-step training metrics.")
    st.stop()


def _init(key: str, value: object) -> None:
    if key not in st.session_state:
        st.session_state[key] = value


def _reset_runs() -> None:
    st.session_state.pop("compare_runs", None)


def _listed(name: str) -> list[str]:
    raw = st.query_params.get(name, "")
    return [v for v in str(raw).split(",") if v]


sweeps = [s for s in dict.fromkeys(cands["sweep"]) if s]  # newest first, as the runs are
asked_sweep = st.query_params.get("sweep", "")
_init("compare_sweep", asked_sweep if asked_sweep in sweeps else ANY)
if asked_sweep and asked_sweep not in sweeps:
    st.warning(f"No training runs of sweep {asked_sweep!r} in this store (yet); showing the latest runs.")
_init("compare_experiment", _listed("experiment")
      or ([] if st.session_state["compare_sweep"] != ANY else [cands["experiment"].iloc[0]]))
for name in FILTERS[1:]:
    _init(f"compare_{name}", _listed(name))

c = st.columns([1.4, 1.2, 1, 1, 0.8])
sweep = c[0].selectbox("sweep", [ANY, *sweeps], key="compare_sweep", on_change=_reset_runs)
pool = cands if sweep == ANY else cands[cands["sweep"] == sweep]
chosen = {}
for col, name in zip(c[1:], FILTERS, strict=True):
    options = sorted({str(v) for v in pool[name] if str(v)} | set(st.session_state.get(f"compare_{name}", [])))
    chosen[name] = col.multiselect(name, options, key=f"compare_{name}", on_change=_reset_runs)
    pool = frames.filter_runs(pool, {name: chosen[name]})
if pool.empty:
    st.info("No training run matches these filters.")
    st.stop()

options = list(pool["run_id"])
names = dict(zip(runs["run_id"], runs["run_name"], strict=True))
_init("compare_runs", options[:MAX_DEFAULT_RUNS])
st.session_state["compare_runs"] = [r for r in st.session_state["compare_runs"] if r in options]
picked = st.multiselect(f"runs ({len(options)} match)", options, key="compare_runs", format_func=names.get)
if not picked:
    st.info("Pick one or more runs to compare.")
    st.stop()

sel = pool.set_index("run_id").loc[picked]
c1, c2, c3 = st.columns([3, 1, 1])
_init("compare_group", True)
group = c3.checkbox("group seeds", key="compare_group",
                    help="runs of one configuration that differ only in their seed: one mean line, min..max band")
params_by_run = {rid: sel.at[rid, "params"] for rid in picked}
labels = frames.config_labels(params_by_run, names, group_seeds=group)
details = frames.config_details(params_by_run, group_seeds=group)  # every key that differs: the hover
train_of = {sel.at[rid, "train_run_id"]: rid for rid in picked}  # the run that holds the per-step metrics
series = {tid: labels[rid] for tid, rid in train_of.items()}

present = common.latest_metric_keys(src.tracking_uri, tuple(train_of))
panels = curves.default_panels(present)
_init("compare_metrics", panels or curves.CURVE_METRICS[:1])
offered = list(dict.fromkeys([*panels, *curves.CURVE_METRICS, *present]))
keys = c1.multiselect("metrics", offered, key="compare_metrics", format_func=curves.panel_title)
if not keys:
    st.info("Pick one or more metrics.")
    st.stop()
try:
    history = common.load_history(src.tracking_uri, tuple(train_of), tuple(dict.fromkeys([*keys, curves.COLLAPSE_KEY])))
except data.SourceUnavailable as e:
    st.warning(str(e))
    st.stop()
_init("compare_smoothing", curves.default_smoothing(int(history["step"].max()) if not history.empty else 0))
smoothing = c2.slider("smoothing (EMA weight)", 0.0, 0.99, step=0.01, key="compare_smoothing")

plotted = history[history["key"].isin(keys)]
missing = curves.missing_metrics(plotted, {tid: series[tid] for tid in train_of}, keys)
if missing:
    st.info(curves.missing_text(missing))
if plotted.empty:
    st.warning("None of the chosen runs logged any of the chosen metrics.")
    st.stop()

plot = curves.curves(plotted, series, smoothing=smoothing, group_seeds=group)
detail_of = {labels[rid]: details[rid] for rid in picked}
has_details = any(detail_of.values())
if has_details:
    plot = plot.assign(config=plot["series"].map(detail_of))
fallback = {tid: sel.at[rid, "collapse_step"] for tid, rid in train_of.items()}
markers = curves.collapse_markers(history, series, fallback)
order = list(dict.fromkeys(series[t] for t in train_of))
if group and (plot["n"] > 1).any():
    st.caption("Each line is the mean over the seeds of one configuration (their number in the tooltip); the band "
               "spans their min..max.")
if frames.label_keys(params_by_run, group)[1]:
    st.caption("Labels: what differs between the chosen runs, shortened (`+N more`: keys they do not name); hover a "
               "point for every key, or see \"What differs\" under the charts.")
if not markers.empty:
    st.caption("Collapse alarm (dashed marker): " + ", ".join(f"{m.series} at step {m.step}" for m in markers.itertuples()))
drawn = [k for k in keys if (plot["key"] == k).any()]
for i in range(0, len(drawn), 2):
    for col, key in zip(st.columns(2), drawn[i:i + 2], strict=False):
        d = plot[plot["key"] == key]
        col.vega_lite_chart(d, curves.curve_spec(key, banded=group, points=len(d) < 60, series=order, markers=markers,
                                                 details=has_details), width="stretch")

st.subheader("Chosen runs")
summary = sel.assign(label=[labels[r] for r in picked])[
    ["label", "run_name", "mlflow", "final_reward", "heldout_accuracy", "benchmark_avg", "bench_set", "collapsed"]]
# every cell as text, '—' where a run did not measure it (as on the Runs page)
st.dataframe(frames.as_text(summary, {c: "{:.3f}" for c in ("final_reward", "heldout_accuracy", "benchmark_avg")}),
             hide_index=True, width="stretch", column_config={
                 "label": st.column_config.TextColumn("label", width=330),
                 "run_name": st.column_config.TextColumn("run", width=260),
                 "mlflow": st.column_config.LinkColumn("MLflow", display_text="open", width=60),
                 "final_reward": st.column_config.TextColumn("final reward", width=100),
                 "heldout_accuracy": st.column_config.TextColumn("held-out acc.", width=100),
                 "benchmark_avg": st.column_config.TextColumn("bench. avg", width=90),
                 "bench_set": st.column_config.TextColumn("bench. over", width=130,
                                                          help="the benchmarks (their problems) the average is over"),
                 "collapsed": st.column_config.TextColumn("collapsed", width=100)})
sets = frames.bench_sets(sel)
if len(sets) > 1:
    st.info(f"bench. avg is over {len(sets)} different benchmark sets here: it compares only between runs over the "
            "same set.\n\n" + "\n".join(f"- **{s}**: {full}" for s, full in sets.items()))
diff = frames.differences_table(params_by_run, labels, names)
if len(diff.columns) > 2:
    st.subheader("What differs")
    st.caption("Every config key whose value differs between the chosen runs (— where a run's config has no such "
               "key); the labels above name the first of them.")
    st.dataframe(diff, hide_index=True, width="stretch",
                 column_config={"label": st.column_config.TextColumn("label", width=330),
                                "run": st.column_config.TextColumn("run", width=260)})


def _png(plot: pd.DataFrame, keys: list[str]) -> bytes:
    from dashboards import figures  # matplotlib loads only when a figure is asked for

    return figures.curves_png(plot, keys)


c1, c2 = st.columns(2)
c1.download_button("Download data (CSV)", lambda: curves.wide_csv(plot), file_name="parity_compare.csv",
                   mime="text/csv", key="compare_csv")
c2.download_button("Download figure (PNG)", lambda: _png(plot, drawn), file_name="parity_compare.png",
                   mime="image/png", key="compare_png")
with st.expander("Plotted data"):
    st.dataframe(plot, hide_index=True, width="stretch")
