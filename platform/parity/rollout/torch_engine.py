"""The built-in torch rollout engine: batched sampling with a KV cache over an HF Qwen3 / Qwen3-MoE model.

Readable in one file on purpose. The decode loop runs the HF modules' own weights through a small forward
of our own (so the KV cache, its low-precision format and the sampling are ours and visible):

    prefill:  all prompt tokens at once, K/V written to the cache (through the KV codec)
    decode:   one token a step for every row, attending over the cache
    sample:   logits / T -> log_softmax (the log-prob we return, pi_inf) -> top-p -> inverse-CDF draw

Randomness is per row: row r of prompt p draws from a generator seeded by (spec.seed, prompt id, sample
index), so a batch is identical however prompts are sharded over workers (the rows, left padding, seeds, masks
and positions are parity.core.layout's, shared with the CUDA decode path and the validation sampler): bit for bit
in float32 on any CPU; in bfloat16, where oneDNN picks a matmul kernel by the row count (AVX512 CPUs without native
bf16), a row's values can differ by a bf16 rounding between batch sizes, which can flip a sampled token.
On CUDA, `generate` hands dense models to the fast path the engine owns (`cuda_decoder`, rollout/cuda_decode.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers.models.qwen3.modeling_qwen3 import rotate_half  # the model's own rope helper

from parity.config.schema import PrecisionConfig
from parity.core.layout import Responses, key_slots, layout_batch, positions, prefill_mask
from parity.core.sampling import SamplingSpec
from parity.cpu_lanes import in_lane, run_in_lanes
from parity.moe.capture import RoutingRecorder
from parity.moe.codec import RoutingBatch
from parity.precision.apply import kv_codec_for_model, load_weights_, quantize_model_
from parity.rollout.cuda_decode import CudaDecoder
from parity.types import RolloutBatch


class TorchEngine:
    name = "torch"
    PREFILL_CHUNK = 4  # shared prefill: distinct prompts per prompt forward (a fixed shape; see _prefill)
    fast_decode = True  # CUDA only: self.cuda_decoder (static KV cache, CUDA graphs); False = plain loop
    def __init__(self, model_dir: str | Path, precision: PrecisionConfig | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.bfloat16, pad_token_id: int | None = None,
                 eos_token_id: int | None = None, capture_routing: bool = False, share_prefill: bool = True,
                 cpu_lanes: int = 1, compact_tail: bool = False, compile_prefill: bool = True) -> None:
        self.device = torch.device(device)
        # plain loop on the CPU: the prompts sharded over this many threads (parity.cpu_lanes), as over Ray rollout
        # workers; the batch equals one call's on one thread bit for bit
        self.cpu_lanes = int(cpu_lanes)
        # plain loop: one prompt forward per distinct prompt, copied to its rows (rollout.shared_prefill, on by
        # default; see _prefill)
        self.share_prefill = share_prefill
        # the decode path: a call's unfinished rows move to a smaller state once most rows have ended
        # (rollout.compact_tail; parity.rollout.cuda_decode, _COMPACT_TAIL)
        self.compact_tail = bool(compact_tail)
        # the decode path's prompt forward compiled with its layers, or eager (rollout.compile_prefill)
        self.compile_prefill = bool(compile_prefill)
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
            self.recorder = RoutingRecorder(self.model)
        self.cuda_decoder = CudaDecoder(self)  # allocates nothing until a CUDA call takes the fast path

    def _apply_precision(self, precision: PrecisionConfig) -> None:
        if precision.weights != "bf16" or precision.activations != "bf16":
            info = quantize_model_(self.model, precision)
            self.linear_path, self.quantized = str(info.get("path", info)), True
        if precision.kv_cache != "bf16":
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
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
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

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, caches: list, start: int,
                mask: torch.Tensor) -> torch.Tensor:
        """Logits [B, V] float32 of the last position of `ids` [B, T] at rope positions `pos`, writing its K/V
        into `caches` (one (k, v) [B, n_kv, S, D] pair per layer) at slots start..start + T - 1."""
        inner = self.model.model
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h, pos)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for layer, cache in zip(inner.layers, caches):
            h = self._layer(layer, h, cos, sin, cache, start, mask)
        return self.model.lm_head(inner.norm(h[:, -1])).float()

    # ---- sampling ----

    @staticmethod
    def sample(logp: torch.Tensor, top_p: float, u: torch.Tensor, greedy: bool) -> torch.Tensor:
        """Token per row: argmax if greedy, else the inverse-CDF draw of uniform `u` over the probabilities in
        descending order, cut to the top-p nucleus."""
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

    def _prefill(self, lay: Any, prompts: torch.Tensor, pmask: torch.Tensor, caches: list) -> torch.Tensor:
        """The prompt forward, writing slots 0..P-1 of every row's cache; logits [B, V] of the last prompt token.
        The rollout.n rows of a prompt share it: with `share_prefill` each distinct prompt runs once, in forwards of
        PREFILL_CHUNK prompts (a fixed shape, so a prompt's numbers do not depend on how many others share the call: a
        batch is the same however its prompts are sharded over lanes or rollout workers; with one forward of all the
        distinct prompts a long prompt's log-probs moved by 1e-7 between a call of 2 prompts and of 1), and its
        cache slots and logits are copied to its rows. Up to rounding the numbers of a forward per row (a product of P rows and one of n x P may take
        different kernels): bit for bit on the default step's short prompts, within 1e-5 elsewhere
        (tests/test_foundation_engine.py, tests/test_cpu_lanes.py)."""
        src = torch.tensor([i for i, _ in lay.rows], device=prompts.device)
        n_distinct = len(lay.prompt_ids)
        if not self.share_prefill or n_distinct == lay.size or self.recorder is not None:
            return self.forward(prompts, positions(pmask), caches, 0, prefill_mask(pmask)[:, None])
        first = torch.zeros(n_distinct, dtype=torch.long, device=prompts.device).scatter_reduce(
            0, src, torch.arange(lay.size, device=prompts.device), reduce="amin", include_self=False)
        P, (_, n_kv, _, D) = prompts.shape[1], caches[0][0].shape
        small = [(torch.empty(n_distinct, n_kv, P, D, dtype=k.dtype, device=k.device),
                  torch.empty(n_distinct, n_kv, P, D, dtype=v.dtype, device=v.device)) for k, v in caches]
        # the distinct prompts in forwards of PREFILL_CHUNK prompts each (the last one filled up with copies of its
        # last prompt): every forward has the same shape whichever prompts share the call
        C = self.PREFILL_CHUNK
        order = first.tolist()
        logits_parts = []
        for c in range(0, n_distinct, C):
            idx = order[c:c + C]
            n_real = len(idx)
            idx = idx + [idx[-1]] * (C - n_real)
            pm = pmask[idx]
            part = [(torch.empty(C, n_kv, P, D, dtype=sk.dtype, device=sk.device),
                     torch.empty(C, n_kv, P, D, dtype=sv.dtype, device=sv.device)) for sk, sv in small]
            logits_parts.append(self.forward(prompts[idx], positions(pm), part, 0, prefill_mask(pm)[:, None])[:n_real])
            for (sk, sv), (pk, pv) in zip(small, part):
                sk[c:c + n_real], sv[c:c + n_real] = pk[:n_real], pv[:n_real]
        logits = torch.cat(logits_parts)
        for (ck, cv), (sk, sv) in zip(caches, small):
            ck[:, :, :P] = sk.index_select(0, src)
            cv[:, :, :P] = sv.index_select(0, src)
        return logits.index_select(0, src)

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], spec: SamplingSpec,
                 prompt_ids: list[int] | None = None) -> RolloutBatch:
        # ---- dispatch to the CUDA fast path (same inputs and RolloutBatch; see cuda_decode's docstring) ----
        if self.fast_decode and self.device.type == "cuda" and self.cuda_decoder.supports():
            return self.cuda_decoder.generate(prompt_token_ids, spec, prompt_ids)
        lanes = min(self.cpu_lanes, torch.get_num_threads(), len(prompt_token_ids))
        if self.device.type == "cpu" and lanes > 1 and self.recorder is None and not in_lane():
            return self._generate_in_lanes(prompt_token_ids, spec, prompt_ids, lanes)
        return self._generate_plain(prompt_token_ids, spec, prompt_ids)

    def _generate_in_lanes(self, prompt_token_ids: list[list[int]], spec: SamplingSpec, prompt_ids: list[int] | None,
                           lanes: int) -> RolloutBatch:
        """The prompts in contiguous shards, one lane each, every shard left-padded to the call's longest prompt, the
        shards' batches concatenated (each row's randomness is its own: the rows are those of one call)."""
        from parity.rollout.sharding import global_spec, merge_batches, shard_prompts  # pure: no Ray

        ids = list(range(len(prompt_token_ids))) if prompt_ids is None else list(prompt_ids)
        shared = global_spec(spec, prompt_token_ids)
        shards = shard_prompts(len(prompt_token_ids), lanes)
        parts = run_in_lanes(lambda sh: (sh.start, self._generate_plain(prompt_token_ids[sh.start:sh.stop], shared,
                                                                        ids[sh.start:sh.stop])), shards)
        return merge_batches(parts, self.pad_id)

    @torch.no_grad()  # also in a lane's thread (grad mode is per thread)
    def _generate_plain(self, prompt_token_ids: list[list[int]], spec: SamplingSpec,
                        prompt_ids: list[int] | None) -> RolloutBatch:
        dev = self.device
        lay = layout_batch(prompt_token_ids, spec, prompt_ids, self.pad_id, self.model.config.max_position_embeddings)
        prompts, pmask, uniforms = lay.prompts.to(dev), lay.prompt_mask.to(dev), lay.uniforms().to(dev)
        out, routing = self._decode_plain(prompts, pmask, uniforms, spec,
                                          lambda caches: self._prefill(lay, prompts, pmask, caches))
        batch = lay.batch_of(out, meta={"engine": self.name, **self.describe()})
        if routing is not None:
            batch.routed_experts = RoutingBatch.from_steps([r.cpu() for r in routing], batch.response_lengths().tolist(),
                                                           num_experts=self.model.config.num_experts)
        return batch

    @torch.no_grad()
    def replay(self, prompt_token_ids: list[list[int]], spec: SamplingSpec, responses: torch.Tensor,
               prompt_ids: list[int] | None = None) -> RolloutBatch:
        """The plain loop over given response tokens [B, R] instead of sampled ones (teacher-forced decoding): the
        batch a plain-loop call of these inputs would give had it drawn `responses`, its `rollout_logprobs` their
        log-probs step by step through the simulated cache (every K/V through the codec's round trip). Scores
        another decode path's tokens (the CUDA path's packed INT4 cache) against the same format decoded the
        reference way, position for position, so that one early difference does not decide every later token."""
        dev = self.device
        lay = layout_batch(prompt_token_ids, spec, prompt_ids, self.pad_id, self.model.config.max_position_embeddings)
        forced = lay.forced(responses, self.pad_id).to(dev)
        prompts, pmask, uniforms = lay.prompts.to(dev), lay.prompt_mask.to(dev), lay.uniforms().to(dev)
        out, _ = self._decode_plain(prompts, pmask, uniforms, spec,
                                    lambda caches: self._prefill(lay, prompts, pmask, caches), forced=forced)
        return lay.batch_of(out, meta={"engine": self.name, **self.describe(), "decode_path": "plain loop (replay)"})

    def _decode_plain(self, prompts: torch.Tensor, pmask: torch.Tensor, uniforms: torch.Tensor, spec: SamplingSpec,
                      prefill: Any, forced: torch.Tensor | None = None) -> tuple[Responses, list | None]:
        """The plain loop on a laid-out batch (device tensors: left-padded prompts [B, P], their mask, the rows'
        uniforms [B, R]): `prefill(caches)` fills the caches' prompt slots and gives the last prompt position's
        logits, then one forward a sampled token (`forced` [B, R]: that token instead, see `replay`). The
        responses, and the routed experts of every position when the engine records routing (else None)."""
        dev, R, (B, P) = self.device, spec.max_new_tokens, prompts.shape
        greedy = spec.temperature == 0.0
        temp = 1.0 if greedy else spec.temperature

        dtype = self.model.lm_head.weight.dtype if self.model.lm_head.weight.is_floating_point() else torch.bfloat16
        caches = [(torch.zeros(B, self.n_kv, P + R, self.head_dim, dtype=dtype, device=dev),
                   torch.zeros(B, self.n_kv, P + R, self.head_dim, dtype=dtype, device=dev))
                  for _ in self.model.model.layers]
        key_ok = key_slots(pmask, R)  # [B, P + R]
        plen = pmask.sum(-1)

        out = Responses.empty(B, R, spec.topk_logprobs, self.pad_id, dev)
        routing = [] if self.recorder is not None else None
        if self.recorder is not None:
            self.recorder.start()

        logits = prefill(caches)
        if self.recorder is not None:  # token t is generated by the forward at input position P-1+t
            routing.append(self.recorder.pop()[:, -1])  # [B, n_layers, top_k]
        for t in range(R):
            logp = torch.log_softmax(logits / temp, dim=-1)
            tok = self.sample(logp, spec.top_p, uniforms[:, t], greedy) if forced is None else forced[:, t]
            out.record(t, tok, logp, self.pad_id, self.eos_id)
            if bool(out.done.all()) or t == R - 1:
                break
            step_mask = (torch.arange(P + R, device=dev)[None, :] <= P + t) & key_ok
            logits = self.forward(out.tokens[:, t:t + 1], (plen + t)[:, None], caches, P + t,
                                  step_mask[:, None, None, :P + t + 1])
            if self.recorder is not None:
                routing.append(self.recorder.pop()[:, 0])
        if self.recorder is not None:
            self.recorder.stop()
        return out, routing

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
        t0 = time.perf_counter()
        if self.quantized:
            load_weights_(self.model, ((k, v.to(self.device)) for k, v in named_tensors))
        else:
            params = dict(self.model.named_parameters())
            for name, tensor in named_tensors:
                if name not in params:
                    raise KeyError(f"weight sync: engine model has no parameter {name!r}")
                params[name].copy_(tensor.to(self.device, params[name].dtype))
        return time.perf_counter() - t0

    def close(self) -> None:
        self.cuda_decoder.reset()
        self.model = None  # type: ignore[assignment]
