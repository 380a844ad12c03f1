"""What a runner gives the RL loop (parity.training.loop): a rollout side and a learner side.

Two runners implement them: parity.training.local (one engine and one Trainer in this process) and
parity.distributed.driver (rollout worker actors and trainer actors over Ray). A runner is a context manager
`runner(cfg, base_dir, run, measured_discrepancy) -> Sides`: it builds both sides from the run's starting point
(the prepared model, or the checkpoint `run.resume_from` with the learner's state restored; the learner's
corrections take `measured_discrepancy`, what the validate stage measured for tolerance=auto, or None), and tears
them down on exit.

Weights pass from the learner to the rollout side as an opaque handle (`LearnerSide.publish`): a generator of
named tensors in one process, an object-store reference or a pending collective broadcast over Ray. Only the
rollout side of the same runner reads it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from parity.core.sampling import SamplingSpec
from parity.training.checkpoint import CheckpointManager
from parity.types import RolloutBatch


@dataclass
class RolloutResult:
    batch: RolloutBatch
    min_version: int  # oldest weights any part of the batch was sampled with (trainer steps behind them)


class RolloutSide(Protocol):
    def submit(self, prompt_token_ids: list[list[int]], spec: SamplingSpec) -> Any:
        """Start sampling spec.n responses for every prompt (a row's group id = its prompt's index) with the
        weights loaded now; returns the handle `collect` takes."""
        ...

    def begin(self, handle: Any) -> None:
        """Start the submission's sampling now if `submit` left it for later (the in-process engine samples at
        `collect`): the loop begins its first rollout before the step-0 evaluation."""
        ...

    def collect(self, handle: Any) -> RolloutResult:
        """The submission's batch (rewards zero: the loop grades)."""
        ...

    def load(self, weights: Any, version: int, wait: bool) -> float:
        """Take the learner's published weights, `version` trainer steps in. wait=False: the load may finish
        behind submissions already made (off-policy overlap). Returns the seconds of the loads it saw finish."""
        ...

    def generate(self, prompt_token_ids: list[list[int]], spec: SamplingSpec,
                 prompt_ids: list[int] | None = None) -> RolloutBatch:
        """One call of the Engine interface, on the current weights (held-out evaluation)."""
        ...

    def step_metrics(self) -> dict[str, float]:
        """What the side measured since the last call, for the step's row (e.g. worker restarts)."""
        ...


class LearnerSide(Protocol):
    def step(self, batch: RolloutBatch) -> dict[str, float]:
        """One RL update on a graded batch; its metrics, perf/train_s (the update's own seconds) among them."""
        ...

    def publish(self) -> Any:
        """The weights after the last step, in the form this runner's rollout side loads."""
        ...

    def weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The same weights as named tensors in the loop's process (the unquantized evaluation engine)."""
        ...

    def save(self, ckpts: CheckpointManager, step: int, data_state: dict) -> None:
        """A checkpoint after `step` steps: weights, trainer state, RNG, and `data_state` (the stream's position)."""
        ...


@dataclass
class Sides:
    rollout: RolloutSide
    learner: LearnerSide
    summary: dict = field(default_factory=dict)  # what the runner adds to the run summary (engine, cluster)


__all__ = ["RolloutSide", "LearnerSide", "RolloutResult", "Sides"]
