"""Precision: every validation report of `python -m parity validate` (quantized rollout vs BF16: mismatch, task
accuracy, the thresholds and the verdict), newest first, read from outputs/precision_validation/<checkpoint>/
validations/ (older folders: their one validation.json). Nothing else in those folders is opened."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboards import common, data, frames

st.title("Precision validation")
src = common.sources()
common.sources_caption(src)


@st.cache_data(show_spinner=False, ttl=common.TTL_S)
def load_reports(outputs_dir: str) -> tuple[pd.DataFrame, list[str]]:
    reports, problems = data.precision_reports(outputs_dir)
    hist_dir = "validations"
    rows = [row for path, rep in reports
            for row in frames.report_rows((path.parent.parent if path.parent.name == hist_dir else path.parent).name,
                                          rep, path.name)]
    return frames.validation_history(rows), problems


table, problems = load_reports(src.outputs_dir)
for msg in problems:
    st.warning(msg)
if table.empty:
    st.info(f"No validation reports under {src.outputs_dir}/precision_validation/ yet. `python -m parity validate` "
            "keeps one per validation beside the quantized checkpoint (validations/<precision>-<time>.json).")
    st.stop()

latest = table[table["latest"]]
n_failed = int((~latest["passed"]).sum())
if n_failed:
    st.error(f"{n_failed} of {len(latest)} precisions failed their latest validation: " + "; ".join(
        f"{r['precision']} on {r['checkpoint']} ({r['validated'] or 'undated'}): {r['failures']}"
        for r in latest[~latest["passed"]].to_dict("records")))
else:
    st.success(f"The latest validation of each of the {len(latest)} precision(s) passed.")

MISMATCH = ("abs_prob_diff", "kl", "top1", "ppl", "prefix", "identical")
thresholds = [c for c in table.columns if c.startswith("threshold.")]
metric_cols = [c for c in table.columns if c not in thresholds]
mismatch = [c for c in metric_cols if any(s in c for s in MISMATCH)]
accuracy = [c for c in metric_cols if "accuracy" in c]
first = ["validated", "checkpoint", "precision", "latest", "verdict", "failures", "engine"]
st.subheader(f"History: {len(table)} validation(s), newest first")
shown = frames.missing_as_dash(table[first + mismatch + accuracy + thresholds],
                               ["validated", "failures", "engine"])
numbers = mismatch + accuracy + thresholds


def _highlight(row: pd.Series) -> list[str]:  # a failed validation in red
    return ["background-color: rgba(255, 75, 75, 0.25)" if row["verdict"] == "FAILED" else "" for _ in row]


st.dataframe(shown.style.apply(_highlight, axis=1).format({c: "{:.4g}" for c in numbers}, na_rep=frames.MISSING),
             hide_index=True, width="stretch",
             column_config={"latest": st.column_config.CheckboxColumn("latest", help="the verdict that stands for "
                                                                      "this checkpoint and precision")})
st.caption("latest: the newest validation of its checkpoint and precision. threshold.*: the limits each validation "
           "was checked against (`rollout.precision.validation.*`); — where a check was off.")
with st.expander("Every field of every report"):
    st.dataframe(table, hide_index=True, width="stretch")
