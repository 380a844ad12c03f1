"""`python -m parity prepare [overrides]`: build and warm-start the default model (cached), or check a given one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from parity.training.warm_start import prepare_model

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig

GROUPS = ["model", "data"]
KEYS = [
    "model.warm_start.steps, model.warm_start.lr: the supervised warm start of the tiny model",
    "model.warm_start.teacher_error, model.warm_start.teacher_error_rate: the imperfect teacher's slip",
    "model.tiny.hidden_size, model.tiny.num_hidden_layers: the tiny model's shape",
    "model.path: with model=hf, a Hugging Face checkpoint folder or hub id to check",
]
EXAMPLES = [
    "python -m parity prepare",
    "python -m parity prepare model=tiny_qwen3_moe",
    "python -m parity prepare model=hf model.path=/models/Qwen3-0.6B",
]


def run(cfg: ParityConfig) -> dict:
    return {"command": "prepare", **prepare_model(cfg)}
