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

    def padded(self, multiple: int, pad_id: int = 0) -> RolloutBatch:
        """The batch with its prompts left-padded and its responses right-padded to the next multiple of `multiple`
        tokens (padded positions masked: prompt_mask and response_mask False, log-prob 0, top-K id -1 and log-prob
        0); the same batch when both widths are multiples already. Not for a batch with MoE routing (its replay
        is laid out by position)."""
        if multiple < 1:
            raise ValueError(f"padded: multiple must be >= 1, got {multiple}")
        P, R = self.prompts.shape[1], self.responses.shape[1]
        dp, dr = -P % multiple, -R % multiple
        if not (dp or dr):
            return self
        if self.routed_experts is not None:
            raise ValueError("padded: a batch with MoE routing replay keeps its widths (trainer.pad_to_multiple=0)")
        b = self.batch_size

        def right(t: torch.Tensor | None, value: float) -> torch.Tensor | None:
            if t is None or not dr:
                return t
            return torch.cat([t, t.new_full((b, dr, *t.shape[2:]), value)], dim=1)

        def left(t: torch.Tensor, value: float) -> torch.Tensor:
            return torch.cat([t.new_full((b, dp), value), t], dim=1) if dp else t

        return replace(self, prompts=left(self.prompts, pad_id), prompt_mask=left(self.prompt_mask, False),
                       responses=right(self.responses, pad_id), response_mask=right(self.response_mask, False),
                       rollout_logprobs=right(self.rollout_logprobs, 0.0), topk_ids=right(self.topk_ids, -1),
                       topk_logprobs=right(self.topk_logprobs, 0.0))

    def to(self, device: torch.device | str) -> RolloutBatch:
        out = {f.name: getattr(self, f.name).to(device) for f in fields(self)
               if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **out)
