"""`python -m parity train [overrides]`: the RL loop on the configured experiment (in-process, or over Ray
actors when distributed.enabled=true). With tracking.enabled=true the run is logged to MLflow
(tracking.tracking_uri): params, per-step metrics and the run's files (parity.tracking.train_run);
without it nothing is written outside outputs/runs/<run_name>."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from parity.training.loop import train


def _train(cfg: DictConfig, callbacks: list[Any]) -> dict:
    if cfg.distributed.enabled:
        from parity.distributed.driver import train_distributed  # lazy: Ray only when asked for

        return train_distributed(cfg, callbacks=callbacks)
    return train(cfg, callbacks=callbacks)


def run(cfg: DictConfig) -> dict:
    if cfg.tracking.enabled:
        from parity.tracking.train_run import tracked_train  # lazy: MLflow only when asked for

        return {"command": "train", **tracked_train(cfg, _train)}
    return {"command": "train", **_train(cfg, [])}
