"""`python -m parity train [overrides]`: the RL loop on the configured experiment (in-process, or over Ray
actors when distributed.enabled=true)."""

from __future__ import annotations

from omegaconf import DictConfig

from parity.training.loop import train


def run(cfg: DictConfig) -> dict:
    if cfg.distributed.enabled:
        from parity.distributed.driver import train_distributed  # lazy: Ray only when asked for

        return {"command": "train", **train_distributed(cfg)}
    return {"command": "train", **train(cfg)}
