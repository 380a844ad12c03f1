"""Data contracts shared by every stage (DESIGN.md, Data contracts).

Layout of a RolloutBatch: prompts are left-padded to a common length P, responses right-padded
to a common length R, so `torch.cat([prompts, responses], 1)` is the full sequence and every
per-token tensor of the response side is [B, R]. One row per response; the G responses of a
prompt share a group id.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch


@dataclass
class RolloutBatch:
    prompts: torch.Tensor  # int64 [B, P], left-padded with pad_token_id
    prompt_mask: torch.Tensor  # bool [B, P], True on real prompt tokens
    responses: torch.Tensor  # int64 [B, R], right-padded
    response_mask: torch.Tensor  # bool [B, R], True on sampled tokens (EOS included)
    rollout_logprobs: torch.Tensor  # fp32 [B, R], engine log-prob of each sampled token after temperature (pi_inf)
    rewards: torch.Tensor  # fp32 [B]
    truncated: torch.Tensor  # bool [B], hit max length without EOS
    group_ids: torch.Tensor  # int64 [B]
    prompt_ids: torch.Tensor  # int64 [B], index of the source prompt in its dataset
    topk_ids: torch.Tensor | None = None  # int32 [B, R, K], engine top-K per position
    topk_logprobs: torch.Tensor | None = None  # fp32 [B, R, K], after temperature, full-vocab normalised
    routed_experts: Any = None  # compact per-response routing (parity.moe), or None
    answers: list[str] = field(default_factory=list)  # reference answers, one per row
    texts: list[str] = field(default_factory=list)  # decoded responses, one per row
    meta: dict[str, Any] = field(default_factory=dict)  # engine name, precision path, timings

    def __post_init__(self) -> None:
        b = self.prompts.shape[0]
        for f in ("prompt_mask", "responses", "response_mask", "rollout_logprobs", "rewards", "truncated",
                  "group_ids", "prompt_ids"):
            t = getattr(self, f)
            if t.shape[0] != b:
                raise ValueError(f"RolloutBatch.{f} has {t.shape[0]} rows, prompts has {b}")
        if self.rollout_logprobs.dtype != torch.float32:
            raise TypeError(f"RolloutBatch.rollout_logprobs must be float32, got {self.rollout_logprobs.dtype}")
        if self.rewards.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"RolloutBatch.rewards must be float32 or wider, got {self.rewards.dtype}")

    @property
    def batch_size(self) -> int:
        return int(self.prompts.shape[0])

    @property
    def input_ids(self) -> torch.Tensor:
        return torch.cat([self.prompts, self.responses], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1, dtype=torch.int64)

    def select(self, idx: torch.Tensor | list[int]) -> RolloutBatch:
        """Rows `idx` of the batch (tensors indexed, lists picked); used to split micro-batches and shards."""
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                out[f.name] = v[idx_t]
            elif isinstance(v, list) and len(v) == self.batch_size:
                out[f.name] = [v[i] for i in idx_t.tolist()]
            elif f.name == "routed_experts" and v is not None and hasattr(v, "select"):
                out[f.name] = v.select(idx_t.tolist())
            else:
                out[f.name] = v
        return replace(self, **out)

    def to(self, device: torch.device | str) -> RolloutBatch:
        out = {f.name: getattr(self, f.name).to(device) for f in fields(self)
               if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **out)
