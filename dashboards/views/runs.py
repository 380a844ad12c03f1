"""Runs: one row per pipeline or plain training run (its stages folded under it), filterable, each linked to its
MLflow page: what it trained, how it did (reward, held-out accuracy, mismatch, benchmarks, collapse), how far it got
(steps, duration) and why it failed."""

from __future__ import annotations

import streamlit as st

from dashboards import common, frames

st.title("Runs")
src = common.sources()
common.sources_caption(src)
runs = common.runs_or_stop(src)
top = frames.top_level(runs)

FILTERS = ["experiment", "sweep", "precision", "correction", "seed", "status"]
cols = st.columns(len(FILTERS))
choices = {}
for col, name in zip(cols, FILTERS, strict=True):
    options = sorted(v for v in top[name].astype(str).unique() if v)
    choices[name] = col.multiselect(name, options, key=f"runs_filter_{name}")
c1, c2, c3 = st.columns([2, 1, 3])
text = c1.text_input("run name contains", key="runs_filter_text")
c2.write("")  # aligns the toggle with the text box
show_stages = c2.toggle("show stages", key="runs_show_stages", help="list each pipeline's stage runs under it")
shown_top = frames.filter_runs(top, choices, text)
shown = frames.with_stages(runs, shown_top) if show_stages else shown_top

n_pipelines = int((shown_top["kind"] == "pipeline").sum())
c3.write("")
c3.write(f"{len(shown_top)} of {len(top)} runs ({n_pipelines} pipelines, "
         f"{int((shown_top['kind'] == 'train').sum())} plain training runs)"
         + (f", with their {len(shown) - len(shown_top)} stage runs" if show_stages else ""))
# the MLflow link comes second so it shows however long the run names are; every cell is text, '—' where missing
COLUMNS = ["run", "mlflow", "status", "precision", "correction", "seed", "final_reward", "heldout_accuracy", "mismatch",
           "benchmark_avg", "bench_set", "collapsed", "steps", "duration", "started", "failure"]
WIDTH = {"run": 250, "mlflow": 52, "status": 75, "precision": 85, "correction": 80, "seed": 40, "final_reward": 62,
         "heldout_accuracy": 65, "mismatch": 70, "benchmark_avg": 60, "bench_set": 120, "collapsed": 72, "steps": 48,
         "duration": 80, "started": 82, "failure": 260}
NUMBERS = {"final_reward": "{:.3f}", "heldout_accuracy": "{:.3f}", "mismatch": "{:.2e}", "benchmark_avg": "{:.3f}",
           "steps": "{:.0f}"}
label = {"final_reward": "reward", "heldout_accuracy": "held-out", "benchmark_avg": "bench.", "bench_set": "bench. over"}
HELP = {"bench_set": "the benchmarks (and their problems) the bench. average is over: compare bench. values only "
                     "between runs over the same set"}
table = frames.as_text(shown[COLUMNS].assign(started=shown["started"].dt.strftime("%m-%d %H:%M")), NUMBERS)
st.dataframe(
    table,
    hide_index=True,
    width="stretch",
    column_config={
        **{c: st.column_config.TextColumn(label.get(c, c), width=WIDTH[c], help=HELP.get(c)) for c in COLUMNS
           if c != "mlflow"},
        "mlflow": st.column_config.LinkColumn("MLflow", display_text="open", width=WIDTH["mlflow"]),
    },
)
sets = frames.bench_sets(shown)
if len(sets) > 1:  # averages over different sets in one column: said, with what each set is
    st.info(f"bench. is over {len(sets)} different benchmark sets here (column \"bench. over\"); an average "
            "compares only with averages over the same set.\n\n" + "\n".join(f"- **{s}**: {full}"
                                                                     for s, full in sets.items()))
st.caption("reward: the last `reward/mean`; held-out: the last `eval/accuracy`, the training task's held-out problems "
           "through the rollout engine; mismatch: the last step's mean |p_train - p_inf| "
           "(`mismatch/abs_prob_diff_mean`); bench.: the evaluate stage's `avg@k`, averaged over the benchmarks "
           "named in bench. over (with their number of problems"
           + (f": {next(iter(sets.values()))}" if len(sets) == 1 else "")
           + "); collapsed: the collapse alarm (`train/collapsed`); steps: the last training step logged; "
           "failure: why a failed run stopped (the stage and its error); — where a run did not measure it. "
           "Experiment and sweep of each run: the filters above, and the Compare page.")
