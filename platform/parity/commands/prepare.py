"""`python -m parity prepare [overrides]`: build and warm-start the default model (cached), or check a given one."""

from __future__ import annotations

from omegaconf import DictConfig

from parity.models.prepare import prepare_model


def run(cfg: DictConfig) -> dict:
    return {"command": "prepare", **prepare_model(cfg)}
