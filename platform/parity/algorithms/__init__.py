"""Advantages, policy losses, corrections and mismatch metrics: pure tensor functions, registered by name.

The trainer builds its `Objective` once, then calls `compute_advantages` once per step, `loss_denominators` once
per mini-batch, the objective once per micro-batch, and `CorrectionStack.end_step` / `StepMetrics.compute` at the end
of the step."""

from parity.algorithms.advantages import ADV_ESTIMATORS, compute_advantages
from parity.algorithms.aggregation import (
    AGG_MODES,
    AGGREGATIONS,
    LossDenominators,
    aggregate_loss,
    loss_denominators,
)
from parity.algorithms.corrections import CORRECTIONS, Correction, CorrectionStack, build_corrections
from parity.algorithms.logprobs import chunked_token_logprobs, masked_token_logprobs
from parity.algorithms.losses import POLICY_LOSSES, get_policy_loss
from parity.algorithms.mismatch import StepMetrics, record_mismatch
from parity.algorithms.objective import Objective

__all__ = [
    "ADV_ESTIMATORS", "AGG_MODES", "AGGREGATIONS", "CORRECTIONS", "POLICY_LOSSES", "Correction", "CorrectionStack",
    "LossDenominators", "Objective", "StepMetrics", "aggregate_loss", "build_corrections", "chunked_token_logprobs",
    "compute_advantages", "get_policy_loss", "loss_denominators", "masked_token_logprobs", "record_mismatch",
]
