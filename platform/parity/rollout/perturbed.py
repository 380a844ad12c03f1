"""An engine whose weights are the trainer's plus a fixed or redrawn bias (parity.precision.perturbation).

Wraps any Engine: at the start it loads theta_start + Delta_k through the engine's own weight sync (k = the
syncs done before, 0 on a fresh run), and every later sync passes theta + Delta on to the engine, which then
applies its own format (a quantized engine quantizes the perturbed weights). Everything else is the engine's."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from parity.core.sampling import SamplingSpec
from parity.precision.perturbation import Perturbation
from parity.types import RolloutBatch


class PerturbedEngine:
    def __init__(self, engine: Any, perturbation: Perturbation, start: dict[str, torch.Tensor],
                 syncs: int = 0) -> None:
        """`start`: the named weights the engine was built from; `syncs`: weight syncs done before (a resumed
        run), which under `redraw` picks the draw."""
        self.engine, self.perturbation, self.syncs = engine, perturbation, int(syncs)
        self.engine.update_weights(self.perturbation.apply(start.items(), self.syncs))

    @property
    def name(self) -> str:
        return self.engine.name

    def generate(self, prompt_token_ids: list[list[int]], spec: SamplingSpec,
                 prompt_ids: list[int] | None = None) -> RolloutBatch:
        return self.engine.generate(prompt_token_ids, spec, prompt_ids)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], syncs: int | None = None) -> float:
        """`syncs`: the trainer steps these weights come after, when the caller knows it (a restarted worker of a
        distributed run); else one more than before."""
        self.syncs = self.syncs + 1 if syncs is None else int(syncs)
        return self.engine.update_weights(self.perturbation.apply(named_tensors, self.syncs))

    def describe(self) -> dict:
        return {**self.engine.describe(), "perturbation": {**self.perturbation.describe(), "syncs": self.syncs}}

    def close(self) -> None:
        self.engine.close()

    def __getattr__(self, item: str) -> Any:  # model, recorder, ... of the wrapped engine
        return getattr(self.__dict__["engine"], item)
