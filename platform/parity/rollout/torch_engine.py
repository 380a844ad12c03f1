"""The built-in torch rollout engine: batched sampling with a KV cache over an HF Qwen3 / Qwen3-MoE model.

Readable in one file on purpose. The decode loop runs the HF modules' own weights through a small forward
of our own (so the KV cache, its low-precision format and the sampling are ours and visible):

    prefill:  all prompt tokens at once, K/V written to the cache (through the KV codec)
    decode:   one token a step for every row, attending over the cache
    sample:   logits / T -> log_softmax (the log-prob we return, pi_inf) -> top-p -> inverse-CDF draw

Randomness is per row: row r of prompt p draws from a generator seeded by (spec.seed, prompt id, sample
index), so a batch is identical however prompts are sharded over workers.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from parity.rollout.base import SamplingSpec
from parity.types import RolloutBatch


def _row_seed(seed: int, prompt_id: int, sample: int) -> int:
    h = hashlib.blake2b(f"{seed}:{prompt_id}:{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def layout_batch(prompt_token_ids: list[list[int]], spec: SamplingSpec, prompt_ids: list[int] | None,
                 pad_id: int, max_pos: int) -> tuple[list[tuple[int, int]], list[int], torch.Tensor, torch.Tensor,
                                                     torch.Tensor]:
    """The batch layout both decode paths share: rows (prompt index, sample), the prompt ids, left-padded
    prompts [B, P] and their mask (CPU), and each row's uniforms [B, R] (float64, CPU) drawn from a
    generator seeded by (spec.seed, prompt id, sample), so a row's samples do not depend on the batch."""
    prompt_ids = list(range(len(prompt_token_ids))) if prompt_ids is None else list(prompt_ids)
    if not prompt_token_ids or min(len(p) for p in prompt_token_ids) == 0:
        raise ValueError("every prompt needs at least one token")
    rows = [(i, j) for i in range(len(prompt_token_ids)) for j in range(spec.n)]
    B, P, R = len(rows), max(spec.pad_prompts_to, max(len(p) for p in prompt_token_ids)), spec.max_new_tokens
    if P + R > max_pos:
        raise ValueError(f"prompt ({P}) + max_new_tokens ({R}) exceeds the model's max_position_embeddings ({max_pos})")
    prompts = torch.full((B, P), pad_id, dtype=torch.long)
    pmask = torch.zeros((B, P), dtype=torch.bool)
    for r, (i, _) in enumerate(rows):
        toks = prompt_token_ids[i]
        prompts[r, P - len(toks):] = torch.tensor(toks)
        pmask[r, P - len(toks):] = True
    seed = 0 if spec.seed is None else spec.seed
    uniforms = torch.stack([torch.rand(R, generator=torch.Generator().manual_seed(_row_seed(seed, prompt_ids[i], j)),
                                       dtype=torch.float64) for i, j in rows])
    return rows, prompt_ids, prompts, pmask, uniforms


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TorchEngine:
    name = "torch"
    fast_decode = True  # CUDA only: parity.rollout.cuda_decode (static KV cache, CUDA graphs); False = plain loop

    def __init__(self, model_dir: str | Path, precision: Any = None, device: str = "cpu",
                 dtype: torch.dtype = torch.bfloat16, pad_token_id: int | None = None,
                 eos_token_id: int | None = None, capture_routing: bool = False) -> None:
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(self.device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        cfg = self.model.config
        self.pad_id = cfg.pad_token_id if pad_token_id is None else pad_token_id
        self.eos_id = cfg.eos_token_id if eos_token_id is None else eos_token_id
        self.n_kv, self.head_dim = cfg.num_key_value_heads, cfg.head_dim
        self.vocab_size = cfg.vocab_size
        self.precision = precision
        self.dtype_name = {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))
        self.linear_path, self.kv_codec, self.quantized = self.dtype_name, None, False
        if precision is not None:
            self._apply_precision(precision)
        self.recorder = None
        if capture_routing:
            from parity.moe.capture import RoutingRecorder  # MoE only: hooks on the routers
            self.recorder = RoutingRecorder(self.model)

    def _apply_precision(self, precision: Any) -> None:
        if precision.weights != "bf16" or precision.activations != "bf16":
            from parity.precision.apply import quantize_model_
            info = quantize_model_(self.model, precision)
            self.linear_path, self.quantized = str(info.get("path", info)), True
        if precision.kv_cache != "bf16":
            from parity.precision.apply import kv_codec_for_model
            self.kv_codec = kv_codec_for_model(self.model, precision)

    def describe(self) -> dict:
        p = self.precision
        return {"engine": self.name, "device": str(self.device), "dtype": self.dtype_name, "linear_path": self.linear_path,
                "weights": getattr(p, "weights", "bf16"), "activations": getattr(p, "activations", "bf16"),
                "kv_cache": getattr(p, "kv_cache", "bf16")}

    # ---- the forward: embeddings -> layers (attention over the cache, MLP) -> norm ----

    def _layer(self, layer: torch.nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               cache: tuple[torch.Tensor, torch.Tensor], start: int, mask: torch.Tensor) -> torch.Tensor:
        attn, (B, T, _) = layer.self_attn, h.shape
        x = layer.input_layernorm(h)
        q = attn.q_norm(attn.q_proj(x).view(B, T, -1, self.head_dim)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(x).view(B, T, -1, self.head_dim)).transpose(1, 2)
        v = attn.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if self.kv_codec is not None:  # the cache holds what the low-precision format can represent
            k, v = self.kv_codec.roundtrip(k), self.kv_codec.roundtrip(v)
        ck, cv = cache
        ck[:, :, start:start + T], cv[:, :, start:start + T] = k, v
        out = F.scaled_dot_product_attention(q, ck[:, :, :start + T], cv[:, :, :start + T], attn_mask=mask,
                                             scale=attn.scaling, enable_gqa=True)
        h = h + attn.o_proj(out.transpose(1, 2).reshape(B, T, -1))
        mlp_out = layer.mlp(layer.post_attention_layernorm(h))
        if isinstance(mlp_out, tuple):  # some MoE blocks also return router logits
            mlp_out = mlp_out[0]
        return h + mlp_out

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, caches: list, start: int,
                 mask: torch.Tensor) -> torch.Tensor:
        inner = self.model.model
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h, pos)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for layer, cache in zip(inner.layers, caches):
            h = self._layer(layer, h, cos, sin, cache, start, mask)
        return self.model.lm_head(inner.norm(h[:, -1])).float()

    # ---- sampling ----

    @staticmethod
    def _sample(logp: torch.Tensor, top_p: float, u: torch.Tensor, greedy: bool) -> torch.Tensor:
        if greedy:
            return logp.argmax(-1)
        probs = logp.exp()
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        if top_p < 1.0:  # keep the smallest prefix whose mass reaches top_p (always the top token)
            keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
            sorted_p = sorted_p * keep
        cdf = sorted_p.cumsum(-1)
        target = (u * cdf[:, -1]).unsqueeze(-1)
        idx = torch.searchsorted(cdf, target).clamp_max(cdf.shape[-1] - 1)
        return order.gather(-1, idx).squeeze(-1)

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], spec: SamplingSpec,
                 prompt_ids: list[int] | None = None) -> RolloutBatch:
        # ---- dispatch to the CUDA fast path (same inputs and RolloutBatch; see cuda_decode's docstring) ----
        if self.fast_decode and self.device.type == "cuda":
            from parity.rollout.cuda_decode import fast_generate, supports
            if supports(self):
                return fast_generate(self, prompt_token_ids, spec, prompt_ids)
        # ---- the plain loop ----
        dev, R = self.device, spec.max_new_tokens
        rows, prompt_ids, prompts, pmask, uniforms = layout_batch(
            prompt_token_ids, spec, prompt_ids, self.pad_id, self.model.config.max_position_embeddings)
        B, P = prompts.shape
        prompts, pmask, uniforms = prompts.to(dev), pmask.to(dev), uniforms.to(dev)
        greedy = spec.temperature == 0.0
        temp = 1.0 if greedy else spec.temperature

        dtype = self.model.lm_head.weight.dtype if self.model.lm_head.weight.is_floating_point() else torch.bfloat16
        caches = [(torch.zeros(B, self.n_kv, P + R, self.head_dim, dtype=dtype, device=dev),
                   torch.zeros(B, self.n_kv, P + R, self.head_dim, dtype=dtype, device=dev))
                  for _ in self.model.model.layers]
        key_ok = torch.cat([pmask, torch.ones(B, R, dtype=torch.bool, device=dev)], 1)
        q_idx = torch.arange(P, device=dev)
        causal = q_idx[:, None] >= torch.arange(P + R, device=dev)[None, :]
        # a left-pad query attends to itself so its (unused) output stays finite
        mask = (causal[None] & key_ok[:, None, :]) | torch.eye(P, P + R, dtype=torch.bool, device=dev)[None]
        pos = (pmask.long().cumsum(-1) - 1).clamp_min(0)
        plen = pmask.sum(-1)

        responses = torch.full((B, R), self.pad_id, dtype=torch.long, device=dev)
        rmask = torch.zeros((B, R), dtype=torch.bool, device=dev)
        logps = torch.zeros((B, R), dtype=torch.float32, device=dev)
        K = spec.topk_logprobs
        topk_ids = torch.zeros((B, R, K), dtype=torch.int32, device=dev) if K else None
        topk_lp = torch.zeros((B, R, K), dtype=torch.float32, device=dev) if K else None
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        routing = [] if self.recorder is not None else None
        if self.recorder is not None:
            self.recorder.start()

        logits = self._forward(prompts, pos, caches, 0, mask[:, None, :, :P])
        if self.recorder is not None:  # token t is generated by the forward at input position P-1+t
            routing.append(self.recorder.pop()[:, -1])  # [B, n_layers, top_k]
        for t in range(R):
            logp = torch.log_softmax(logits / temp, dim=-1)
            tok = self._sample(logp, spec.top_p, uniforms[:, t], greedy)
            live = ~done
            responses[:, t] = torch.where(live, tok, self.pad_id)
            rmask[:, t] = live
            logps[:, t] = torch.where(live, logp.gather(-1, tok[:, None]).squeeze(-1), 0.0)
            if K:
                v, ix = logp.topk(K, dim=-1)
                topk_lp[:, t], topk_ids[:, t] = v * live[:, None], ix.int() * live[:, None]
            done = done | (live & (tok == self.eos_id))
            if bool(done.all()) or t == R - 1:
                break
            step_mask = (torch.arange(P + R, device=dev)[None, :] <= P + t) & key_ok
            logits = self._forward(responses[:, t:t + 1], (plen + t)[:, None], caches, P + t,
                                   step_mask[:, None, None, :P + t + 1])
            if self.recorder is not None:
                routing.append(self.recorder.pop()[:, 0])
        if self.recorder is not None:
            self.recorder.stop()
        truncated = ~done
        batch = RolloutBatch(
            prompts=prompts.cpu(), prompt_mask=pmask.cpu(), responses=responses.cpu(), response_mask=rmask.cpu(),
            rollout_logprobs=logps.cpu(), rewards=torch.zeros(B, dtype=torch.float32), truncated=truncated.cpu(),
            group_ids=torch.tensor([i for i, _ in rows], dtype=torch.long),
            prompt_ids=torch.tensor([prompt_ids[i] for i, _ in rows], dtype=torch.long),
            topk_ids=None if topk_ids is None else topk_ids.cpu(),
            topk_logprobs=None if topk_lp is None else topk_lp.cpu(),
            meta={"engine": self.name, **self.describe()},
        )
        if routing is not None:
            from parity.moe.codec import RoutingBatch
            batch.routed_experts = RoutingBatch.from_steps([r.cpu() for r in routing], batch.response_lengths().tolist(),
                                                           num_experts=self.model.config.num_experts)
        return batch

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
        t0 = time.perf_counter()
        if self.quantized:
            from parity.precision.apply import load_weights_
            load_weights_(self.model, ((k, v.to(self.device)) for k, v in named_tensors))
        else:
            params = dict(self.model.named_parameters())
            for name, tensor in named_tensors:
                if name not in params:
                    raise KeyError(f"weight sync: engine model has no parameter {name!r}")
                params[name].copy_(tensor.to(self.device, params[name].dtype))
        return time.perf_counter() - t0

    def close(self) -> None:
        self.model = None  # type: ignore[assignment]
