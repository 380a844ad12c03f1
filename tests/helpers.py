"""Calls the tests make in one line that the library spells out in two (an object built, then called)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from parity.algorithms import Objective


def rl_objective(hidden: torch.Tensor, lm_head_weight: torch.Tensor, batch: Any, advantages: torch.Tensor,
                 old_logprobs: torch.Tensor | None, temperature: float, corrections: Any, alg_cfg: Any, denom: Any,
                 metrics: Any, rows: torch.Tensor | None = None, ids_checked: bool = False) -> torch.Tensor:
    """One micro-batch's loss from a fresh Objective(alg_cfg, corrections), as a trainer's built-once one gives."""
    return Objective(alg_cfg, corrections)(hidden, lm_head_weight, batch=batch, advantages=advantages,
                                           old_logprobs=old_logprobs, temperature=temperature, denom=denom,
                                           metrics=metrics, rows=rows, ids_checked=ids_checked)


def resolve_eval_model(cfg: Any) -> tuple[Path | str, str]:
    """(model folder or hub id, how it was chosen): the evaluate command's choice without the registry's record."""
    from parity.commands.evaluate import resolve_eval_model_info

    model, chosen, _ = resolve_eval_model_info(cfg)
    return model, chosen
