"""Pure pieces of the distributed loop: how prompts are split over rollout workers and how the shards'
batches are put back together. No Ray here, so they are tested on their own.

The invariant: a step's batch is the same whatever the number of workers. The torch engine draws each row's
randomness from (seed, global prompt id, sample index), and every shard is left-padded to the step's global
longest prompt (SamplingSpec.pad_prompts_to), so concatenating the shards' rows gives the one-worker batch bit
for bit."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from parity.core.sampling import SamplingSpec
from parity.types import RolloutBatch


@dataclass(frozen=True)
class Shard:
    worker: int  # index of the rollout worker that samples it
    start: int  # first prompt (index into the step's prompt list)
    stop: int


def shard_prompts(n_prompts: int, n_workers: int) -> list[Shard]:
    """Contiguous, near-equal shards (the first n % k workers take one more); workers left without a prompt get
    no shard, so every shard is non-empty."""
    if n_workers < 1:
        raise ValueError(f"config key `distributed.num_rollout_workers`: must be >= 1, got {n_workers}")
    base, extra = divmod(n_prompts, n_workers)
    shards, start = [], 0
    for w in range(n_workers):
        size = base + (1 if w < extra else 0)
        if size:
            shards.append(Shard(w, start, start + size))
        start += size
    return shards


def global_spec(spec: SamplingSpec, prompt_token_ids: list[list[int]]) -> SamplingSpec:
    """The spec every shard uses: padded to the longest prompt of the whole call."""
    longest = max((len(p) for p in prompt_token_ids), default=0)
    return replace(spec, pad_prompts_to=max(spec.pad_prompts_to, longest))


def _pad_right(t: torch.Tensor, length: int, value: float | int | bool) -> torch.Tensor:
    if t.shape[1] == length:
        return t
    pad = torch.full((t.shape[0], length - t.shape[1], *t.shape[2:]), value, dtype=t.dtype)
    return torch.cat([t, pad], dim=1)


def merge_batches(parts: list[tuple[int, RolloutBatch]], pad_token_id: int) -> RolloutBatch:
    """Concatenate shard batches (given with the index of their shard's first prompt) into the step's batch.

    Group ids become global (offset by the shard start); response tensors of shards that stopped early (every row
    hit EOS) are right-padded to the longest shard, with masks False and log-probs 0 on the padding, exactly as one
    engine call fills rows that finished before others."""
    if not parts:
        raise ValueError("merge_batches: no shard batches to merge")
    parts = sorted(parts, key=lambda p: p[0])
    P = {b.prompts.shape[1] for _, b in parts}
    if len(P) != 1:
        raise ValueError(f"merge_batches: shards have different prompt widths {sorted(P)}; pad every shard to the "
                         "global longest prompt (SamplingSpec.pad_prompts_to)")
    R = max(b.responses.shape[1] for _, b in parts)
    pad_values = {"responses": pad_token_id, "response_mask": False, "rollout_logprobs": 0.0, "topk_ids": 0,
                  "topk_logprobs": 0.0}
    out: dict = {}
    for f in fields(RolloutBatch):
        vals = [getattr(b, f.name) for _, b in parts]
        if f.name == "group_ids":
            out[f.name] = torch.cat([b.group_ids + start for start, b in parts])
        elif f.name in pad_values:
            out[f.name] = None if vals[0] is None else torch.cat([_pad_right(v, R, pad_values[f.name]) for v in vals])
        elif isinstance(vals[0], torch.Tensor):
            out[f.name] = torch.cat(vals)
        elif f.name in ("answers", "texts"):
            out[f.name] = [x for v in vals for x in v]
        elif f.name == "routed_experts":
            out[f.name] = _merge_routing(vals)
        elif f.name == "meta":
            out[f.name] = dict(vals[0])
    return RolloutBatch(**out)


def _merge_routing(vals: list) -> object:
    if all(v is None for v in vals):
        return None
    if any(v is None for v in vals) or not hasattr(type(vals[0]), "concat"):
        raise ValueError("merge_batches: routed experts cannot be merged across shards (every shard must carry "
                         "them, and the routing type must provide concat)")
    return type(vals[0]).concat(vals)
