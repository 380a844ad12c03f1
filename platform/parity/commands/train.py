"""`python -m parity train [overrides]`: the RL loop on the configured experiment."""

from __future__ import annotations

from omegaconf import DictConfig

from parity.training.loop import train


def run(cfg: DictConfig) -> dict:
    return {"command": "train", **train(cfg)}
