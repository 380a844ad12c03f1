"""Sampling and teacher-forced scoring with a plain Hugging Face causal LM, for validation.

`ModelSampler` gives any HF model (BF16, or quantized in place with QuantLinear) the Engine's
`generate`, without a KV cache: every step re-runs the whole left-padded sequence. That is slow for
long responses and fine for held-out validation on small batches; the rollout engines are the fast
path. Draws are per row from seeded generators, so results do not depend on batch composition.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from parity.rollout.base import SamplingSpec
from parity.types import RolloutBatch


def _row_seed(seed: int, prompt_id: int, sample: int) -> int:
    h = hashlib.blake2b(f"validate:{seed}:{prompt_id}:{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    if not prompts or min(len(p) for p in prompts) == 0:
        raise ValueError("validation needs at least one prompt, each with at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.bool)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[r, width - len(p):] = True
    return ids, mask


def _device(model: nn.Module) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


@torch.no_grad()
def full_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) in float32 for every position of a (left- or right-) padded batch,
    positions counted over real tokens only: [B, T, V]; row t predicts token t + 1."""
    dev = _device(model)
    pos = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    out = model(input_ids=input_ids.to(dev), attention_mask=attention_mask.to(dev).long(),
                position_ids=pos.to(dev), use_cache=False)
    return torch.log_softmax(out.logits.float() / temperature, dim=-1).cpu()


def response_logprobs(model: nn.Module, batch: RolloutBatch, temperature: float = 1.0) -> torch.Tensor:
    """Teacher-forced full distributions over the response positions of `batch`: [B, R, V]."""
    logp = full_logprobs(model, batch.input_ids, batch.attention_mask, temperature)
    p = batch.prompts.shape[1]
    return logp[:, p - 1:p - 1 + batch.responses.shape[1]]


class ModelSampler:
    """Engine.generate for an HF causal LM (no KV cache). temperature 0 = greedy."""

    name = "hf_model"

    def __init__(self, model: nn.Module, pad_token_id: int, eos_token_id: int | None) -> None:
        self.model, self.pad_id, self.eos_id = model.eval(), int(pad_token_id), eos_token_id

    def describe(self) -> dict:
        from parity.precision.apply import describe_model_precision
        from parity.precision.linear import QuantLinear

        q = next((m for m in self.model.modules() if isinstance(m, QuantLinear)), None)
        return {"engine": self.name, "weights": q.weights if q else "bf16", "activations": q.activations if q else "bf16",
                "kv_cache": "bf16", "paths": describe_model_precision(self.model) or {"bf16": 0}}

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], spec: SamplingSpec,
                 prompt_ids: list[int] | None = None) -> RolloutBatch:
        if spec.top_p < 1.0:
            raise ValueError("ModelSampler samples the full distribution; top_p < 1 is the engines' job")
        pids = list(range(len(prompt_token_ids))) if prompt_ids is None else list(prompt_ids)
        rows = [(i, j) for i in range(len(prompt_token_ids)) for j in range(spec.n)]
        prompts, pmask = left_pad([prompt_token_ids[i] for i, _ in rows], self.pad_id)
        b, r_max = len(rows), spec.max_new_tokens
        greedy = spec.temperature == 0.0
        temp = 1.0 if greedy else spec.temperature
        seed = 0 if spec.seed is None else spec.seed
        uniforms = torch.stack([torch.rand(r_max, generator=torch.Generator().manual_seed(_row_seed(seed, pids[i], j)),
                                           dtype=torch.float64) for i, j in rows])
        responses = torch.full((b, r_max), self.pad_id, dtype=torch.long)
        rmask = torch.zeros((b, r_max), dtype=torch.bool)
        logps = torch.zeros((b, r_max), dtype=torch.float32)
        k = spec.topk_logprobs
        topk_ids = torch.zeros((b, r_max, k), dtype=torch.int32) if k else None
        topk_lp = torch.zeros((b, r_max, k), dtype=torch.float32) if k else None
        done = torch.zeros(b, dtype=torch.bool)
        for t in range(r_max):
            ids = torch.cat([prompts, responses[:, :t]], 1)
            mask = torch.cat([pmask, rmask[:, :t]], 1)
            logp = full_logprobs(self.model, ids, mask, temp)[:, -1]
            if greedy:
                tok = logp.argmax(-1)
            else:
                cdf = logp.double().exp().cumsum(-1)
                tok = torch.searchsorted(cdf, (uniforms[:, t] * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
                tok = tok.clamp_max(logp.shape[-1] - 1)
            live = ~done
            responses[:, t] = torch.where(live, tok, self.pad_id)
            rmask[:, t] = live
            logps[:, t] = torch.where(live, logp.gather(-1, tok[:, None]).squeeze(-1), 0.0)
            if k:
                v, ix = logp.topk(k, dim=-1)
                topk_lp[:, t], topk_ids[:, t] = v * live[:, None], ix.int() * live[:, None]
            if self.eos_id is not None:
                done = done | (live & (tok == self.eos_id))
            if bool(done.all()):
                break
        return RolloutBatch(prompts=prompts, prompt_mask=pmask, responses=responses, response_mask=rmask,
                            rollout_logprobs=logps, rewards=torch.zeros(b), truncated=~done,
                            group_ids=torch.tensor([i for i, _ in rows]),
                            prompt_ids=torch.tensor([pids[i] for i, _ in rows]),
                            topk_ids=topk_ids, topk_logprobs=topk_lp, meta={"engine": self.name})
