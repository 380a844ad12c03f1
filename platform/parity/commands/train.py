"""`python -m parity train [overrides]`: the RL loop on the configured experiment (in-process, or over Ray
actors when distributed.enabled=true). With tracking.enabled=true the run is logged to MLflow
(tracking.tracking_uri): params, per-step metrics and the run's files (parity.tracking.train_run);
without it nothing is written outside outputs/runs/<run_name>."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from parity.distributed.driver import ray_runner
from parity.tracking.train_run import tracked_train
from parity.training.local import local_runner
from parity.training.loop import train as run_loop

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig

GROUPS = ["experiment", "model", "rollout", "precision", "algorithm", "data", "trainer", "distributed"]
KEYS = [
    "trainer.total_steps: RL steps (optimizer steps = total_steps x trainer.mini_batches)",
    "trainer.lr, trainer.prompts_per_step, rollout.n: learning rate; prompts a step; responses a prompt (G)",
    "algorithm.correction.name: registered corrections joined by + (none, tis, icepop, mis, score_centering, dual)",
    "algorithm.policy_loss: ppo_clip | reinforce (score centering needs reinforce)",
    "rollout.precision.weights / .activations / .kv_cache: the rollout's numerics (bf16, int8, fp8, ...)",
    "rollout.name: torch | vllm;  rollout.topk_logprobs: top-K log-probs a token (score centering needs them)",
    "trainer.run_name: outputs/runs/<run_name>;  trainer.resume: continue from the latest valid checkpoint",
    "tracking.enabled: log the run to MLflow;  distributed.enabled: the same loop over Ray actors",
]
EXAMPLES = [
    "python -m parity train trainer.total_steps=100 algorithm.correction.name=tis",
    "python -m parity train +precision=w8a8_int8_kv_int4 algorithm.correction.name=icepop",
    "python -m parity train algorithm.correction.name=score_centering+tis algorithm.policy_loss=reinforce "
    "rollout.topk_logprobs=64",
    "python -m parity train trainer.run_name=my_run trainer.resume=true",
    "python -m parity train tracking.enabled=true +distributed=local",
    "python -m parity train experiment=seed_qwen35_9b_int8_sc_quick",
]


def runner_of(cfg: ParityConfig) -> Callable:
    """The runner of the RL loop that distributed.enabled asks for: Ray actors, or this process."""
    return ray_runner if cfg.distributed.enabled else local_runner


def train(cfg: ParityConfig, callbacks: list[Any] | None = None) -> dict:
    """The RL loop (parity.training.loop.train) with the runner distributed.enabled asks for; what this command
    and the pipeline's train stage run."""
    return run_loop(cfg, callbacks, runner=runner_of(cfg))


def run(cfg: ParityConfig) -> dict:
    if cfg.tracking.enabled:
        return {"command": "train", **tracked_train(cfg, train)}
    return {"command": "train", **train(cfg, [])}
