"""Sampling and teacher-forced scoring with a plain Hugging Face causal LM, for validation.

`ModelSampler` gives any HF model (BF16, or quantized in place with QuantLinear) the Engine's
`generate`, without a KV cache: every step re-runs the whole left-padded sequence. That is slow for
long responses and fine for held-out validation on small batches; the rollout engines are the fast
path. Draws are per row from seeded generators, so results do not depend on batch composition; rows, left
padding and seeds are parity.core.layout's (the engines' layout, seeds in a namespace of their own).
"""

from __future__ import annotations

import torch
from torch import nn

from parity.core.layout import Responses, layout_batch, positions
from parity.core.sampling import SamplingSpec
from parity.types import RolloutBatch


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
    pos = positions(attention_mask)
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
        lay = layout_batch(prompt_token_ids, spec, prompt_ids, self.pad_id, namespace="validate")
        prompts, pmask, uniforms = lay.prompts, lay.prompt_mask, lay.uniforms()
        b, r_max = lay.size, spec.max_new_tokens
        greedy = spec.temperature == 0.0
        temp = 1.0 if greedy else spec.temperature
        out = Responses.empty(b, r_max, spec.topk_logprobs, self.pad_id)
        for t in range(r_max):
            ids = torch.cat([prompts, out.tokens[:, :t]], 1)
            mask = torch.cat([pmask, out.mask[:, :t]], 1)
            logp = full_logprobs(self.model, ids, mask, temp)[:, -1]
            if greedy:
                tok = logp.argmax(-1)
            else:
                cdf = logp.double().exp().cumsum(-1)
                tok = torch.searchsorted(cdf, (uniforms[:, t] * cdf[:, -1]).unsqueeze(-1)).squeeze(-1)
                tok = tok.clamp_max(logp.shape[-1] - 1)
            out.record(t, tok, logp, self.pad_id, self.eos_id)
            if bool(out.done.all()):
                break
        return lay.batch_of(out, meta={"engine": self.name})
