"""A cohort: the runs of one rollout format decoded in one engine call.

A study runs many arms that share a rollout format (the nine W4A4 + INT4 KV arms of a seed differ only in their
correction), and on one GPU their decodes are many small kernels each (docs/PERFORMANCE.md, "Sixteen rollouts on
one GPU": four processes of 512 rows decoded 2.71x the tokens of sixteen of 128). A cohort decodes N runs' calls as
one batch: the runs' rows stacked (rows grouped by run, run i's B rows at i * B), every weight stacked over the
runs ([N, ...]), so that a projection is one batched product for all runs, a norm one kernel with each row's
run's weight, and attention (no weights) one call over all rows.

`CohortEngine` is that arithmetic on the plain loop (any device, no CUDA graphs): N TorchEngines of one model
shape and one precision, each with its own weights, and `generate` taking one call per run. Each run's rows keep
their own sampling (their seeds, their uniforms) and come back as that run's RolloutBatch, with the numbers the
run's own engine gives for the same call up to the rounding of a batched product against a single one (and of a
prompt padded to the cohort's widest prompt): tests/test_cohort.py checks tokens and log-probs against each
engine's own `generate` for plain, simulated W4A4 + INT4 KV and INT8 W8A8 engines. Quantized products whose
kernels have no batched form here (the integer and FP8 paths) run once per run on its rows.

What the arithmetic follows: TorchEngine._layer and TorchEngine.forward (HF Qwen3's order of operations: float32
RMS normalisation cast back before the weight, q/k norms before the rotary, the KV codec's roundtrip before the
cache write, SDPA with grouped-query attention).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import rotate_half

from parity.core.layout import BatchLayout, Responses, key_slots, layout_batch, left_pad, positions, prefill_mask
from parity.core.sampling import SamplingSpec
from parity.precision.formats import fake_quantize
from parity.precision.linear import QuantLinear, is_simulated, quant_linear_forward, simulated_weight
from parity.types import RolloutBatch

def _stacked_lin(mods: list[torch.nn.Module]) -> tuple:
    """One projection of every run as (weight [N, out, in], scale [N, out, 1] | None, bias [N, out] | None, kind):
    kind None for nn.Linear, ("batched", activations) for a simulated product (weight: the float32 w_hat), else
    QuantLinear's (weights, activations, path), computed per run."""
    first = mods[0]
    if isinstance(first, torch.nn.Linear):
        bias = torch.stack([m.bias for m in mods]) if first.bias is not None else None
        return torch.stack([m.weight for m in mods]), None, bias, None
    if not isinstance(first, QuantLinear):
        raise TypeError(f"cohort: a projection of type {type(first).__name__} has no stacked form")
    bias = torch.stack([m.bias for m in mods]) if first.bias is not None else None
    if is_simulated(first.path, first.weights, first.activations):
        w_hat = torch.stack([simulated_weight(m.weight, m.weight_scale, m.weights) for m in mods])
        return w_hat, None, bias, ("batched", first.activations)
    return (torch.stack([m.weight for m in mods]), torch.stack([m.weight_scale for m in mods]), bias,
            (first.weights, first.activations, first.path))


def cohort_linear(x: torch.Tensor, lin: tuple, runs: int) -> torch.Tensor:
    """x [N * B, ..., in] (rows grouped by run) -> [N * B, ..., out], each run's rows through its own weight."""
    w, scale, bias, kind = lin
    lead, k = x.shape[:-1], x.shape[-1]
    xs = x.reshape(runs, -1, k)  # [N, B * ..., in]
    if kind is None:
        y = torch.bmm(xs, w.transpose(1, 2))
    elif kind[0] == "batched":
        y = torch.bmm(fake_quantize(xs.float(), kind[1]), w.transpose(1, 2)).to(x.dtype)
    else:
        y = torch.stack([quant_linear_forward(xs[i], w[i], scale[i], None, *kind) for i in range(runs)])
    if bias is not None:
        y = y + bias[:, None, :].to(y.dtype)
    return y.reshape(*lead, y.shape[-1])


def cohort_rms(x: torch.Tensor, w: torch.Tensor, eps: float, runs: int) -> torch.Tensor:
    """HF Qwen3RMSNorm on rows grouped by run, x [N * B, ..., d] with run i's weight w[i] [d]: float32
    normalisation, cast back, then the weight."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    wr = w.reshape(runs, *(1,) * (x.dim() - 1), x.shape[-1])  # [N, 1, ..., d]
    return (wr * xf.to(x.dtype).reshape(runs, -1, *x.shape[1:])).reshape(x.shape)


@dataclass
class _Layer:
    ln: torch.Tensor
    eps: float
    q: tuple
    k: tuple
    v: tuple
    qn: torch.Tensor
    kn: torch.Tensor
    eps_qk: float
    o: tuple
    ln_post: torch.Tensor
    eps_post: float
    gate: tuple
    up: tuple
    down: tuple
    scale: float


class CohortEngine:
    """N TorchEngines of one model shape and one precision decoded together (see the module doc). `refresh()`
    restacks the weights from the engines after their `update_weights`."""

    name = "torch-cohort"

    def __init__(self, engines: list[Any]) -> None:
        if not engines:
            raise ValueError("cohort: at least one engine")
        e0 = engines[0]
        for i, e in enumerate(engines[1:], 1):
            for attr in ("n_kv", "head_dim", "vocab_size", "pad_id", "eos_id", "dtype_name", "linear_path"):
                if getattr(e, attr) != getattr(e0, attr):
                    raise ValueError(f"cohort: engine {i} differs from engine 0 in {attr} "
                                     f"({getattr(e, attr)!r} against {getattr(e0, attr)!r}); a cohort is one format")
            if e.describe() != e0.describe():
                raise ValueError(f"cohort: engine {i} runs {e.describe()} against engine 0's {e0.describe()}")
        if any(getattr(e, "recorder", None) is not None for e in engines):
            raise ValueError("cohort: routing capture (MoE replay) is not supported")
        self.engines = engines
        self.device = e0.device
        self.kv_codec = e0.kv_codec
        self.refresh()

    @property
    def runs(self) -> int:
        return len(self.engines)

    def refresh(self) -> None:
        """Stack every run's weights (a copy: call after the engines' weights change)."""
        models = [e.model for e in self.engines]
        inners = [m.model for m in models]
        self.embed = torch.stack([m.embed_tokens.weight for m in inners])
        self.norm = torch.stack([m.norm.weight for m in inners])
        self.norm_eps = inners[0].norm.variance_epsilon
        self.lm_head = _stacked_lin([m.lm_head for m in models])
        self.rotary = inners[0].rotary_emb
        self.layers = []
        for layer_mods in zip(*(m.layers for m in inners), strict=True):
            att = [m.self_attn for m in layer_mods]
            mlp = [m.mlp for m in layer_mods]
            self.layers.append(_Layer(
                ln=torch.stack([m.input_layernorm.weight for m in layer_mods]),
                eps=layer_mods[0].input_layernorm.variance_epsilon,
                q=_stacked_lin([a.q_proj for a in att]), k=_stacked_lin([a.k_proj for a in att]),
                v=_stacked_lin([a.v_proj for a in att]),
                qn=torch.stack([a.q_norm.weight for a in att]), kn=torch.stack([a.k_norm.weight for a in att]),
                eps_qk=att[0].q_norm.variance_epsilon, o=_stacked_lin([a.o_proj for a in att]),
                ln_post=torch.stack([m.post_attention_layernorm.weight for m in layer_mods]),
                eps_post=layer_mods[0].post_attention_layernorm.variance_epsilon,
                gate=_stacked_lin([m.gate_proj for m in mlp]), up=_stacked_lin([m.up_proj for m in mlp]),
                down=_stacked_lin([m.down_proj for m in mlp]), scale=att[0].scaling))

    # ---- the forward over all runs' rows ----

    def _layer(self, L: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               cache: tuple[torch.Tensor, torch.Tensor], start: int, mask: torch.Tensor) -> torch.Tensor:
        N, (NB, T, _), D = self.runs, h.shape, self.engines[0].head_dim
        x = cohort_rms(h, L.ln, L.eps, N)
        q = cohort_rms(cohort_linear(x, L.q, N).view(NB, T, -1, D), L.qn, L.eps_qk, N).transpose(1, 2)
        k = cohort_rms(cohort_linear(x, L.k, N).view(NB, T, -1, D), L.kn, L.eps_qk, N).transpose(1, 2)
        v = cohort_linear(x, L.v, N).view(NB, T, -1, D).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.kv_codec is not None:
            k, v = self.kv_codec.roundtrip(k), self.kv_codec.roundtrip(v)
        ck, cv = cache
        ck[:, :, start:start + T], cv[:, :, start:start + T] = k, v
        out = F.scaled_dot_product_attention(q, ck[:, :, :start + T], cv[:, :, :start + T], attn_mask=mask,
                                             scale=L.scale, enable_gqa=True)
        h = h + cohort_linear(out.transpose(1, 2).reshape(NB, T, -1), L.o, N)
        y = cohort_rms(h, L.ln_post, L.eps_post, N)
        return h + cohort_linear(F.silu(cohort_linear(y, L.gate, N)) * cohort_linear(y, L.up, N), L.down, N)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, caches: list, start: int,
                mask: torch.Tensor) -> torch.Tensor:
        """Logits [N * B, V] float32 of the last position of `ids` [N * B, T] (rows grouped by run)."""
        N, NB = self.runs, ids.shape[0]
        run_of_row = torch.arange(N, device=ids.device).repeat_interleave(NB // N)
        h = self.embed[run_of_row[:, None], ids]
        cos, sin = self.rotary(h, pos)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for L, cache in zip(self.layers, caches, strict=True):
            h = self._layer(L, h, cos, sin, cache, start, mask)
        return cohort_linear(cohort_rms(h[:, -1], self.norm, self.norm_eps, N), self.lm_head, N).float()

    # ---- one call per run, decoded together ----

    def _layouts(self, calls: list[tuple]) -> list[BatchLayout]:
        if len(calls) != self.runs:
            raise ValueError(f"cohort of {self.runs} runs: got {len(calls)} calls (one per run, in engine order)")
        specs = [c[1] for c in calls]
        for i, s in enumerate(specs[1:], 1):
            for f in ("temperature", "top_p", "max_new_tokens", "topk_logprobs"):
                if getattr(s, f) != getattr(specs[0], f):
                    raise ValueError(f"cohort: run {i}'s sampling differs from run 0's in {f} "
                                     f"({getattr(s, f)!r} against {getattr(specs[0], f)!r})")
        e0 = self.engines[0]
        lays = [layout_batch(c[0], c[1], c[2] if len(c) > 2 else None, e0.pad_id,
                             e0.model.config.max_position_embeddings) for c in calls]
        sizes = {lay.size for lay in lays}
        if len(sizes) != 1:
            raise ValueError(f"cohort: every run's call must have the same number of rows, got {[lay.size for lay in lays]}")
        return lays

    @torch.no_grad()
    def generate(self, calls: list[tuple[list[list[int]], SamplingSpec] | tuple[list[list[int]], SamplingSpec,
                                                                                    list[int] | None]]
                 ) -> list[RolloutBatch]:
        """calls[i] = (prompt_token_ids, spec[, prompt_ids]) of run i; run i's RolloutBatch, as its engine's
        `generate` would give it, for each."""
        lays = self._layouts(calls)
        spec, dev, N = calls[0][1], self.device, self.runs
        R, P = spec.max_new_tokens, max(lay.width for lay in lays)
        # the runs' prompts left-padded to the widest (positions count real tokens, so padding moves nothing)
        rows = [lay.prompts[r, lay.prompt_mask[r]].tolist() for lay in lays for r in range(lay.size)]
        prompts, pmask = left_pad(rows, self.engines[0].pad_id, width=P)
        prompts, pmask = prompts.to(dev), pmask.to(dev)
        uniforms = torch.cat([lay.uniforms() for lay in lays]).to(dev)
        NB = prompts.shape[0]
        greedy = spec.temperature == 0.0
        temp = 1.0 if greedy else spec.temperature
        e0 = self.engines[0]
        dtype = self.embed.dtype if self.embed.is_floating_point() else torch.bfloat16
        caches = [(torch.zeros(NB, e0.n_kv, P + R, e0.head_dim, dtype=dtype, device=dev),
                   torch.zeros(NB, e0.n_kv, P + R, e0.head_dim, dtype=dtype, device=dev)) for _ in self.layers]
        key_ok = key_slots(pmask, R)
        plen = pmask.sum(-1)
        out = Responses.empty(NB, R, spec.topk_logprobs, e0.pad_id, dev)
        logits = self.forward(prompts, positions(pmask), caches, 0, prefill_mask(pmask)[:, None])
        for t in range(R):
            logp = torch.log_softmax(logits / temp, dim=-1)
            tok = e0.sample(logp, spec.top_p, uniforms[:, t], greedy)
            out.record(t, tok, logp, e0.pad_id, e0.eos_id)
            if bool(out.done.all()) or t == R - 1:
                break
            step_mask = (torch.arange(P + R, device=dev)[None, :] <= P + t) & key_ok
            logits = self.forward(out.tokens[:, t:t + 1], (plen + t)[:, None], caches, P + t,
                                  step_mask[:, None, None, :P + t + 1])
        B = NB // N
        batches = []
        for i, (lay, eng) in enumerate(zip(lays, self.engines, strict=True)):
            part = slice(i * B, (i + 1) * B)
            mine = Responses(tokens=out.tokens[part], mask=out.mask[part], logprobs=out.logprobs[part],
                             topk_ids=None if out.topk_ids is None else out.topk_ids[part],
                             topk_logprobs=None if out.topk_logprobs is None else out.topk_logprobs[part],
                             done=out.done[part])
            batches.append(lay.batch_of(mine, meta={"engine": eng.name, **eng.describe(), "cohort": N}))
        return batches
