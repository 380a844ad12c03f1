"""The correction tolerance c of a run (`algorithm.correction.tolerance`), resolved once before it starts and
handed to the learner: a number as configured; or `auto` = tolerance_multiple x the mean |p_train - p_inf| that
the validate stage measured for this rollout precision (its report, validation.json beside the quantized
checkpoint), or, without such a report, measured by the corrections over the first tolerance_steps steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from parity.algorithms.corrections.stack import resolve_tolerance
from parity.precision.config import resolve_precision
from parity.precision.validate import validated_discrepancy

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig


@dataclass(frozen=True)
class ToleranceSetting:
    measured: float | None  # the validate stage's mean |p_train - p_inf| (tolerance=auto with a report), else None
    value: float | None  # c at the start of the run (None: measured over the first steps)
    source: str | None  # the report's path, "first N steps", or None for a configured number


def tolerance_setting(cfg: ParityConfig) -> ToleranceSetting:
    c = cfg.algorithm.correction
    if str(c.tolerance).strip().lower() != "auto":
        return ToleranceSetting(None, resolve_tolerance(c.tolerance), None)
    found = validated_discrepancy(cfg, resolve_precision(cfg))
    measured, source = found if found else (None, f"first {int(c.tolerance_steps)} steps")
    return ToleranceSetting(measured, resolve_tolerance(c.tolerance, measured, float(c.tolerance_multiple)), source)


__all__ = ["ToleranceSetting", "tolerance_setting"]
