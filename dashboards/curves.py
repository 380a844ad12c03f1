"""Per-step curves of the Compare page: TensorBoard-style smoothing, seeds of one configuration as a mean line
with a min..max band, collapse markers, the metric panels and their Vega-Lite specs. Pure functions of
tables (no I/O), checked by hand in tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

# What the Compare page charts first, in this order, when the runs logged it.
PANEL_TITLES = {
    "reward/mean": "reward (mean over responses)",
    "eval/accuracy": "held-out accuracy: rollout engine",
    "eval/accuracy_unquantized": "held-out accuracy: unquantized weights",
    "mismatch/abs_prob_diff_mean": "mismatch: mean |p_train - p_inf|",
    "mismatch/k3_kl": "mismatch: k3 KL(pi_inf || pi_train)",
    "correction/lambda": "dual correction: lambda",
}
DEFAULT_MISMATCH = ("mismatch/abs_prob_diff_mean", "mismatch/k3_kl")
MAX_DRIFT_PANELS = 4
COLLAPSE_KEY = "train/collapsed"  # 0.0 before, 1.0 from the step the collapse alarm fires
# a categorical palette (Tableau 10): Streamlit's theme otherwise shades one hue when the scale has a domain
PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f",
           "#bab0ac"]
# Offered first in the metric picker (METRICS.md and the training loop name them).
CURVE_METRICS = ["reward/mean", "eval/accuracy", "eval/accuracy_unquantized", "mismatch/abs_prob_diff_mean",
                 "mismatch/k3_kl", "correction/lambda", "correction/sc_term_abs", "perf/rollout_tokens_per_s"]


def default_panels(present: Sequence[str]) -> list[str]:
    """Reward, both held-out accuracies, two mismatch measures, the drift metrics (up to four) and the dual's
    lambda, each only where the runs logged it."""
    have = set(present)
    out = [k for k in ("reward/mean", "eval/accuracy", "eval/accuracy_unquantized") if k in have]
    out += [k for k in DEFAULT_MISMATCH if k in have]
    if not any(k in have for k in DEFAULT_MISMATCH):
        out += sorted(k for k in have if k.startswith("mismatch/"))[:2]
    out += sorted(k for k in have if k.startswith("drift/"))[:MAX_DRIFT_PANELS]
    out += [k for k in ("correction/lambda",) if k in have]
    return out


def panel_title(key: str) -> str:
    return PANEL_TITLES.get(key, key)


def default_smoothing(steps: int) -> float:
    """0.6 (TensorBoard's default) for runs of 20 steps or more; short runs unsmoothed, each point a step."""
    return 0.6 if steps >= 20 else 0.3 if steps >= 10 else 0.0


def ema(values: Sequence[float], weight: float) -> np.ndarray:
    """TensorBoard-style smoothing: s_t = w s_{t-1} + (1 - w) x_t from s_0 = 0, divided by 1 - w^(t+1) so
    early points are not pulled to zero. weight = 0 returns the values."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight must be in [0, 1), got {weight}")
    x = np.asarray(values, dtype=np.float64)
    out = np.empty_like(x)
    s = 0.0
    for t, v in enumerate(x):
        s = weight * s + (1.0 - weight) * v
        out[t] = s / (1.0 - weight ** (t + 1))
    return out


PLOT_COLUMNS = ["series", "key", "step", "value", "lo", "hi", "n"]
# a legend label's room under a chart of the two-column grid (a chart of a 1400 px page is about 450 px wide): the
# labels of frames.config_labels (at most frames.MAX_LABEL_CHARS characters) fit whole in it
LEGEND_LABEL_PX = 420


def curves(history: pd.DataFrame, labels: dict[str, str], smoothing: float = 0.0,
           group_seeds: bool = False) -> pd.DataFrame:
    """Plot table (series, key, step, value, lo, hi, n) from a metric history (run_id, key, step, value) and
    each run's legend label. Each run is smoothed on its own, and only where a metric is logged on most
    steps: a sparse one (held-out accuracy every N steps) is left as measured, since an average over points
    N steps apart would misstate where the run ended. With group_seeds, runs sharing a label become one
    series: the mean over them at each step with the min..max band (n = runs present at that step);
    otherwise lo = hi = value."""
    if history.empty:
        return pd.DataFrame(columns=PLOT_COLUMNS)
    h = history[history["run_id"].isin(list(labels))].sort_values(["run_id", "key", "step"]).copy()
    if smoothing > 0 and not h.empty:
        def smooth(g: pd.DataFrame) -> pd.Series:
            dense = len(g) >= 0.5 * (g["step"].iloc[-1] - g["step"].iloc[0] + 1)
            return pd.Series(ema(g["value"].to_numpy(), smoothing) if dense else g["value"].to_numpy(), index=g.index)

        h["value"] = pd.concat([smooth(g) for _, g in h.groupby(["run_id", "key"], sort=False)])
    h["series"] = h["run_id"].map(labels)
    if not group_seeds:
        h["lo"] = h["hi"] = h["value"]
        h["n"] = 1
        return h[PLOT_COLUMNS].reset_index(drop=True)
    g = h.groupby(["series", "key", "step"], sort=True)["value"]
    out = pd.DataFrame({"value": g.mean(), "lo": g.min(), "hi": g.max(), "n": g.count()}).reset_index()
    return out[PLOT_COLUMNS]


def collapse_markers(history: pd.DataFrame, labels: dict[str, str],
                     fallback_steps: dict[str, float | None] | None = None) -> pd.DataFrame:
    """(series, run_id, step) of each run's collapse: the first step where `train/collapsed` reaches 1, or the
    run's recorded `collapse_step` when the per-step flag is not there."""
    rows = []
    flagged = history[(history["key"] == COLLAPSE_KEY) & (history["value"] >= 0.5)] if not history.empty else history
    first = flagged.groupby("run_id")["step"].min() if not flagged.empty else pd.Series(dtype=float)
    for rid, label in labels.items():
        step = first.get(rid)
        if step is None or pd.isna(step):
            step = (fallback_steps or {}).get(rid)
        if step is not None and not pd.isna(step):
            rows.append({"series": label, "run_id": rid, "step": int(step)})
    return pd.DataFrame(rows, columns=["series", "run_id", "step"])


def missing_metrics(history: pd.DataFrame, run_names: dict[str, str], keys: Sequence[str]) -> dict[str, list[str]]:
    """{key: the labels of the selected runs that have no value of it}, for each selected key some run lacks (a
    label once however many runs share it)."""
    have = set(zip(history["run_id"], history["key"], strict=True)) if not history.empty else set()
    out: dict[str, list[str]] = {}
    for k in keys:
        names = list(dict.fromkeys(name for rid, name in run_names.items() if (rid, k) not in have))
        if names:
            out[k] = names
    return out


def missing_text(missing: dict[str, list[str]]) -> str:
    """The page's note on them (markdown): one line per metric, the metric and each label set apart, so a label that
    holds a slash or a colon never reads into the metric's name."""
    return "Not logged by these runs (left out of the charts):\n\n" + "\n".join(
        f"- `{k}`: not logged by " + ", ".join(f"**{n}**" for n in names) for k, names in missing.items())


def wide_csv(plot: pd.DataFrame) -> str:
    """The plotted data as CSV, one row per (series, step), one column per metric (plus bands when grouped)."""
    if plot.empty:
        return "series,step\n"
    value = plot.pivot_table(index=["series", "step"], columns="key", values="value", aggfunc="first")
    if (plot["n"] > 1).any():
        lo = plot.pivot_table(index=["series", "step"], columns="key", values="lo", aggfunc="first").add_suffix(" (min)")
        hi = plot.pivot_table(index=["series", "step"], columns="key", values="hi", aggfunc="first").add_suffix(" (max)")
        value = value.join(lo).join(hi)
    return value.reset_index().to_csv(index=False)


def curve_spec(key: str, banded: bool, points: bool, series: Sequence[str] = (),
               markers: pd.DataFrame | None = None, details: bool = False) -> dict[str, Any]:
    """Vega-Lite spec of one metric's curves over the plot table's columns (written by hand: building it
    through Altair costs ~0.15 s a chart, most of a cached page's time). The legend sits below the chart so
    two charts fit side by side, each label whole up to LEGEND_LABEL_PX; collapse markers are dashed rules in
    their series' colour; with `details`, a point's hover names every config key its run differs in (the
    table's `config` column). SVG, so the legend's labels are text in the page."""
    x = {"field": "step", "type": "quantitative", "title": "step", "axis": {"format": "d", "tickMinStep": 1}}
    color = {"field": "series", "type": "nominal", "title": None,
             # the band's faint fill would otherwise be the legend's symbol: a full-strength stroke, as the lines
             "legend": {"orient": "bottom", "direction": "vertical", "labelLimit": LEGEND_LABEL_PX, "symbolType": "stroke",
                        "symbolOpacity": 1, "symbolStrokeWidth": 3},
             **({"scale": {"domain": list(series), "range": PALETTE}} if series else {})}
    line = {"mark": {"type": "line", "point": points},
            "encoding": {"x": x, "color": color,
                         "y": {"field": "value", "type": "quantitative", "title": None, "scale": {"zero": False},
                               "axis": {"format": "~g"}},
                         "tooltip": [{"field": "series", "type": "nominal"}, {"field": "step", "type": "quantitative"},
                                     {"field": "value", "type": "quantitative", "format": ".6g"},
                                     {"field": "n", "type": "quantitative", "title": "seeds"},
                                     *([{"field": "config", "type": "nominal", "title": "differs"}] if details
                                       else [])]}}
    band = {"mark": {"type": "area", "opacity": 0.2},
            "encoding": {"x": x, "color": color, "y": {"field": "lo", "type": "quantitative"}, "y2": {"field": "hi"}}}
    layers = [band, line] if banded else [line]
    if markers is not None and not markers.empty:
        layers.append({"data": {"values": markers[["series", "step"]].to_dict("records")},
                       "mark": {"type": "rule", "strokeDash": [6, 3], "strokeWidth": 2},
                       "encoding": {"x": x, "color": color,
                                    "tooltip": [{"field": "series", "type": "nominal"},
                                                {"field": "step", "type": "quantitative", "title": "collapse at step"}]}})
    # fit-x: the width follows the column, the height is the plot's own (legend and title come on top of it)
    return {"height": 200, "autosize": {"type": "fit-x", "contains": "padding"},
            "title": {"text": panel_title(key), "anchor": "start", "fontSize": 13},
            "layer": layers, "usermeta": {"embedOptions": {"renderer": "svg"}}}
