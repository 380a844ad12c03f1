"""The Compare page's figure as a PNG (matplotlib, Agg backend): one panel per metric, the same series,
smoothing and seed bands as the interactive charts."""

from __future__ import annotations

import io
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")  # no display on a server
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402


def curves_png(plot: pd.DataFrame, keys: Sequence[str], dpi: int = 110) -> bytes:
    """PNG bytes of the plot table (series, key, step, value, lo, hi, n) from frames.curves."""
    keys = [k for k in keys if (plot["key"] == k).any()] or ["(no data)"]
    fig, axes = plt.subplots(len(keys), 1, figsize=(9, 2.8 * len(keys)), squeeze=False, sharex=True)
    try:
        for ax, key in zip(axes[:, 0], keys, strict=True):
            d = plot[plot["key"] == key]
            for i, (series, s) in enumerate(d.groupby("series", sort=True)):
                color = f"C{i % 10}"
                ax.plot(s["step"], s["value"], color=color, label=str(series), lw=1.5)
                if (s["n"] > 1).any():
                    ax.fill_between(s["step"], s["lo"], s["hi"], color=color, alpha=0.2, lw=0)
            ax.set_ylabel(key)
            ax.grid(alpha=0.3)
        axes[-1, 0].set_xlabel("step")
        handles, labels = axes[0, 0].get_legend_handles_labels()
        if handles:
            axes[0, 0].legend(handles, labels, fontsize=8, loc="best")
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi)
        return buf.getvalue()
    finally:
        plt.close(fig)
