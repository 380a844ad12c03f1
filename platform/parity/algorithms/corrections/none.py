"""`none`: plain GRPO on the rollout's samples (the telemetry is still recorded)."""

from __future__ import annotations

from parity.algorithms.corrections.base import CORRECTIONS, Correction


@CORRECTIONS.register("none")
class NoCorrection(Correction):
    """No section, no state, no effect."""
