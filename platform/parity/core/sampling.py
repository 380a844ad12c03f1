"""The sampling contract: SamplingSpec (what to sample) and the Engine interface every rollout engine implements
(torch reference engine, vLLM) and the validation sampler (parity.precision.sampler) follows."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from parity.types import RolloutBatch


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    n: int = 1  # responses per prompt; rows of one prompt are adjacent and share a group id
    topk_logprobs: int = 0  # 0 = off; else K top log-probs (after temperature) per response position
    seed: int | None = None
    # left-pad prompts to at least this length: shards of one batch padded alike give bit-identical rows
    pad_prompts_to: int = 0


@runtime_checkable
class Engine(Protocol):
    name: str

    def generate(self, prompt_token_ids: list[list[int]], spec: SamplingSpec,
                 prompt_ids: list[int] | None = None) -> RolloutBatch:
        """Sample spec.n responses for every prompt. Rewards come back as zeros (the caller grades);
        group id of a row = index of its prompt in this call (offset by the caller if needed)."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Load new trainer weights (HF parameter names, BF16/FP32) in place, re-quantizing where the
        engine runs a low-precision format. Returns seconds taken."""
        ...

    def describe(self) -> dict:
        """Engine name, precision and the numeric path taken (e.g. int8 GEMM vs simulated)."""
        ...

    def close(self) -> None: ...
