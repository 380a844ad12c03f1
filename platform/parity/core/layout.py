"""The batch layout every sampler shares: rows, left padding, per-row seeds, masks, positions, RolloutBatch.

    rows        row r is sample j of prompt i: [(i, j) for i in prompts for j in range(n)], a prompt's rows adjacent
                (they share group id i)
    prompts     left-padded to one width P = max(spec.pad_prompts_to, longest prompt), so every response starts at
                column P and `cat([prompts, responses], 1)` is the full sequence
    seeds       row (i, j) draws from a generator seeded by a hash of (spec.seed, prompt id of i, j): a row's samples
                do not depend on which batch, shard or worker it came in
    masks       the prompt forward's causal mask over real tokens, the key slots a decode step may read
    positions   rope positions count real tokens only (left padding does not shift them)

Used by the torch engine (rollout/torch_engine.py), its CUDA decode path (rollout/cuda_decode.py), the vLLM
engine's per-row seeds and the validation sampler (precision/sampler.py), so their batches line up row for row.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from parity.core.sampling import SamplingSpec
from parity.types import RolloutBatch


def row_seed(seed: int, prompt_id: int, sample: int, namespace: str = "") -> int:
    """A 63-bit seed for sample `sample` of prompt `prompt_id`; `namespace` keeps other users' draws apart."""
    key = f"{namespace}:{seed}:{prompt_id}:{sample}" if namespace else f"{seed}:{prompt_id}:{sample}"
    h = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def left_pad(seqs: list[list[int]], pad_id: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [N, W] (int64, W = `width` or the longest) with each sequence right-aligned, and its bool mask."""
    W = max(len(s) for s in seqs) if width is None else width
    ids = torch.full((len(seqs), W), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), W), dtype=torch.bool)
    for r, s in enumerate(seqs):
        ids[r, W - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[r, W - len(s):] = True
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Rope position of every column of a left-padded batch [B, T]: real tokens count 0, 1, ...; padding gets 0."""
    return (mask.long().cumsum(-1) - 1).clamp_min(0)


def prefill_mask(prompt_mask: torch.Tensor) -> torch.Tensor:
    """[B, P, P] bool: query i attends to the real keys j <= i of its row; a pad query attends to itself, so its
    (unused) output stays finite."""
    P, dev = prompt_mask.shape[1], prompt_mask.device
    q = torch.arange(P, device=dev)
    causal = q[:, None] >= q[None, :]
    return (causal[None] & prompt_mask[:, None, :]) | torch.eye(P, dtype=torch.bool, device=dev)[None]


def key_slots(prompt_mask: torch.Tensor, new_tokens: int, slots: int | None = None) -> torch.Tensor:
    """[B, S] bool over a KV cache of S slots (default P + new_tokens): the real prompt tokens, then the
    `new_tokens` response slots; slots past those are never read."""
    B, P = prompt_mask.shape
    S = P + new_tokens if slots is None else slots
    out = torch.zeros((B, S), dtype=torch.bool, device=prompt_mask.device)
    out[:, :P] = prompt_mask
    out[:, P:P + new_tokens] = True
    return out


@dataclass
class Responses:
    """The response side of a batch being sampled one position at a time (the plain decode loops)."""

    tokens: torch.Tensor  # int64 [B, R], pad_id where nothing was sampled
    mask: torch.Tensor  # bool [B, R]
    logprobs: torch.Tensor  # fp32 [B, R], 0 where nothing was sampled
    topk_ids: torch.Tensor | None  # int32 [B, R, K]
    topk_logprobs: torch.Tensor | None  # fp32 [B, R, K]
    done: torch.Tensor  # bool [B]: the row has sampled EOS

    @classmethod
    def empty(cls, rows: int, new_tokens: int, topk: int, pad_id: int, device: torch.device | None = None
              ) -> Responses:
        B, R, K = rows, new_tokens, topk
        return cls(tokens=torch.full((B, R), pad_id, dtype=torch.long, device=device),
                   mask=torch.zeros((B, R), dtype=torch.bool, device=device),
                   logprobs=torch.zeros((B, R), dtype=torch.float32, device=device),
                   topk_ids=torch.zeros((B, R, K), dtype=torch.int32, device=device) if K else None,
                   topk_logprobs=torch.zeros((B, R, K), dtype=torch.float32, device=device) if K else None,
                   done=torch.zeros(B, dtype=torch.bool, device=device))

    def record(self, t: int, tok: torch.Tensor, logp: torch.Tensor, pad_id: int, eos_id: int | None) -> None:
        """Position t: each live row's sampled token `tok` [B], its log-prob under `logp` [B, V] (and the top-K);
        a row that sampled EOS is done from then on (finished rows get pad, mask False, log-prob 0)."""
        live = ~self.done
        self.tokens[:, t] = torch.where(live, tok, pad_id)
        self.mask[:, t] = live
        self.logprobs[:, t] = torch.where(live, logp.gather(-1, tok[:, None]).squeeze(-1), 0.0)
        if self.topk_ids is not None and self.topk_logprobs is not None:
            v, ix = logp.topk(self.topk_ids.shape[-1], dim=-1)
            self.topk_logprobs[:, t], self.topk_ids[:, t] = v * live[:, None], ix.int() * live[:, None]
        if eos_id is not None:
            self.done = self.done | (live & (tok == eos_id))


@dataclass
class BatchLayout:
    """One call's rows and left-padded prompts (host tensors)."""

    rows: list[tuple[int, int]]  # (prompt index in the call, sample index)
    prompt_ids: list[int]  # source prompt id of each prompt of the call
    prompts: torch.Tensor  # int64 [B, P], left-padded
    prompt_mask: torch.Tensor  # bool [B, P]
    new_tokens: int  # R = spec.max_new_tokens
    seed: int
    namespace: str = ""

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def width(self) -> int:
        return int(self.prompts.shape[1])

    def row_seeds(self) -> list[int]:
        return [row_seed(self.seed, self.prompt_ids[i], j, self.namespace) for i, j in self.rows]

    def uniforms(self) -> torch.Tensor:
        """[B, R] float64: row r's R uniforms, from its own generator (one per sampled position)."""
        return torch.stack([torch.rand(self.new_tokens, generator=torch.Generator().manual_seed(s),
                                       dtype=torch.float64) for s in self.row_seeds()])

    def forced(self, responses: torch.Tensor, pad_id: int) -> torch.Tensor:
        """[B, R] int64 (host): given response tokens laid out as this call's rows, cut or padded to R, for a
        decode that replays them instead of sampling (TorchEngine.replay, CudaDecoder.replay)."""
        if responses.shape[0] != self.size:
            raise ValueError(f"replay: responses has {responses.shape[0]} rows, the call lays out {self.size} "
                             f"({len(self.prompt_ids)} prompts x n={self.size // max(1, len(self.prompt_ids))})")
        out = torch.full((self.size, self.new_tokens), pad_id, dtype=torch.long)
        out[:, :responses.shape[1]] = responses[:, :self.new_tokens].cpu()
        return out

    def batch_of(self, r: Responses, meta: dict[str, Any] | None = None) -> RolloutBatch:
        return self.rollout_batch(r.tokens, r.mask, r.logprobs, ~r.done, r.topk_ids, r.topk_logprobs, meta)

    def rollout_batch(self, responses: torch.Tensor, response_mask: torch.Tensor, logprobs: torch.Tensor,
                      truncated: torch.Tensor, topk_ids: torch.Tensor | None = None,
                      topk_logprobs: torch.Tensor | None = None, meta: dict[str, Any] | None = None) -> RolloutBatch:
        """The RolloutBatch of this layout, every tensor a host copy of its own (the CUDA path's buffers are reused
        by its next call, on the CPU too); rewards are zeros (the caller grades)."""
        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to("cpu", copy=True)

        return RolloutBatch(
            prompts=self.prompts, prompt_mask=self.prompt_mask, responses=host(responses),
            response_mask=host(response_mask), rollout_logprobs=host(logprobs),
            rewards=torch.zeros(self.size, dtype=torch.float32), truncated=host(truncated),
            group_ids=torch.tensor([i for i, _ in self.rows], dtype=torch.long),
            prompt_ids=torch.tensor([self.prompt_ids[i] for i, _ in self.rows], dtype=torch.long),
            topk_ids=host(topk_ids), topk_logprobs=host(topk_logprobs), meta=dict(meta or {}))


def layout_batch(prompt_token_ids: list[list[int]], spec: SamplingSpec, prompt_ids: list[int] | None = None,
                 pad_id: int = 0, max_positions: int | None = None, namespace: str = "") -> BatchLayout:
    """The layout of one generate call; `max_positions`, when given, bounds prompt width + max_new_tokens."""
    if not prompt_token_ids or min(len(p) for p in prompt_token_ids) == 0:
        raise ValueError("a batch needs at least one prompt, and every prompt at least one token")
    prompt_ids = list(range(len(prompt_token_ids))) if prompt_ids is None else list(prompt_ids)
    rows = [(i, j) for i in range(len(prompt_token_ids)) for j in range(spec.n)]
    P, R = max(spec.pad_prompts_to, max(len(p) for p in prompt_token_ids)), spec.max_new_tokens
    if max_positions is not None and P + R > max_positions:
        raise ValueError(f"prompt ({P}) + max_new_tokens ({R}) exceeds the model's max_position_embeddings "
                         f"({max_positions})")
    prompts, pmask = left_pad([prompt_token_ids[i] for i, _ in rows], pad_id, width=P)
    return BatchLayout(rows=rows, prompt_ids=prompt_ids, prompts=prompts, prompt_mask=pmask, new_tokens=R,
                       seed=0 if spec.seed is None else int(spec.seed), namespace=namespace)
