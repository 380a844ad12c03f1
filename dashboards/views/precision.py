"""Precision: the validation reports of `python -m parity validate` (quantized rollout vs BF16: per-mode
mismatch and task accuracy), read from outputs/precision_validation/*/."""

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
    rows = [row for path, rep in reports for row in frames.report_rows(path.parent.name, rep)]
    return pd.DataFrame(rows), problems


table, problems = load_reports(src.outputs_dir)
for msg in problems:
    st.warning(msg)
if table.empty:
    st.info(f"No validation reports under {src.outputs_dir}/precision_validation/ yet. `python -m parity validate` "
            "writes one beside each quantized model's config.json.")
    st.stop()

KEY_FIRST = ["report", "mode", "engine", "passed"]
MISMATCH = ("abs_prob_diff", "kl", "top1", "ppl", "prefix", "identical")
metric_cols = [c for c in table.columns if not c.startswith("threshold.")]
mismatch = [c for c in metric_cols if any(s in c for s in MISMATCH)]
accuracy = [c for c in metric_cols if "accuracy" in c]
first = [c for c in KEY_FIRST if c in table.columns]
st.subheader("Mismatch and accuracy per mode")
main = first + mismatch + accuracy + (["failures"] if "failures" in table.columns else [])
st.dataframe(table[main] if mismatch or accuracy else table, hide_index=True, width="stretch",
             column_config={c: st.column_config.NumberColumn(c, format="%.4g") for c in mismatch + accuracy})
failed = table[table["passed"].astype(str).str.lower().isin(["false", "0"])] if "passed" in table.columns else table[:0]
if len(failed):
    st.error(f"{len(failed)} mode(s) failed validation: " + "; ".join(
        f"{r['report']} / {r['mode']}" + (f" ({r['failures']})" if r.get("failures") else "")
        for r in failed.to_dict("records")))
with st.expander("Every field of every report (thresholds included)"):
    st.dataframe(table, hide_index=True, width="stretch")
