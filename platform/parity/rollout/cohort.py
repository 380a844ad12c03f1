"""A cohort: the runs of one rollout format decoded in one engine call.

A study runs many arms that share a rollout format (the nine W4A4 + INT4 KV arms of a seed differ only in their
correction), and on one GPU their decodes are many small kernels each (docs/PERFORMANCE.md, "Sixteen rollouts on
one GPU": four processes of 512 rows decoded 2.71x the tokens of sixteen of 128). A cohort decodes N runs' calls
as one batch: the runs' rows stacked (rows grouped by run, run i's B rows at i * B) and every weight stacked over
the runs ([N, ...]), so that a projection is one batched product for all runs (rollout/decode_layers.py,
`cohort_linear`; the integer and FP8 products run per run, their kernels having no batched form here), a norm one
kernel with each row's run's weight, and attention (no weights) one call over all rows.

`CohortEngine` holds N TorchEngines of one model shape and one precision, each with its own weights, and presents
their stacked weights as one model of the TorchEngine surface (`model.model.layers[i].self_attn.q_proj`, ...):
TorchEngine's own forward runs over it (the plain loop), and the CUDA decode path's decoder runs over it unchanged
(static cache, CUDA graphs, compiled layer functions, packed KV cache), its layer functions taking a weight with a
leading run dimension as a cohort's. `generate` takes one call per run and gives each run the RolloutBatch its own
engine gives for that call, up to the rounding of a batched product against a single one:
tests/test_cohort.py checks tokens and log-probs against each engine's own `generate`, plain loop and the decode
path's logic run eagerly, for plain float32, simulated W4A4 + INT4 KV and INT8 W8A8 engines.

`sync()` copies the engines' weights into the stacks in place (after their `update_weights`), so the decode path's
kept states and captured graphs see them, as a single engine's do.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from parity.core.layout import BatchLayout, Responses, layout_batch, left_pad, positions, prefill_mask
from parity.precision.linear import QuantLinear
from parity.rollout.decode_layers import _linear, _rms
from parity.rollout.torch_engine import TorchEngine
from parity.types import RolloutBatch


class _Stacked:
    """One tensor attribute of every run's module, stacked over the runs ([N, ...]); `sync` copies it again."""

    def __init__(self, mods: list, attr: str) -> None:
        self.mods, self.attr = mods, attr
        self.value = torch.stack([getattr(m, attr) for m in mods])

    def sync(self) -> None:
        torch.stack([getattr(m, self.attr) for m in self.mods], out=self.value)


class StackedLinear:
    """A projection of every run: weight [N, out, in] (scales [N, out, 1], bias [N, out]); called like the
    module on rows grouped by run, and read by the decode path through `decode_lin`."""

    def __init__(self, mods: list) -> None:
        first = mods[0]
        if not isinstance(first, torch.nn.Linear | QuantLinear):
            raise TypeError(f"cohort: a projection of type {type(first).__name__} has no stacked form")
        self.parts = [_Stacked(mods, "weight")]
        self.quant = isinstance(first, QuantLinear)
        self.kind = (first.weights, first.activations, first.path) if self.quant else None
        if self.quant:
            self.parts.append(_Stacked(mods, "weight_scale"))
        self.bias = _Stacked(mods, "bias") if first.bias is not None else None
        self.in_features, self.out_features = first.in_features, first.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.parts[0].value

    def decode_lin(self) -> tuple:
        return (self.parts[0].value, self.parts[1].value if self.quant else None,
                None if self.bias is None else self.bias.value, self.kind)

    def sync(self) -> None:
        for p in [*self.parts, *([self.bias] if self.bias is not None else [])]:
            p.sync()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.decode_lin())


class _StackedTensor:
    """A module of every run whose state is one tensor, `weight`, stacked over the runs."""

    def __init__(self, mods: list) -> None:
        self.part = _Stacked(mods, "weight")

    @property
    def weight(self) -> torch.Tensor:
        return self.part.value

    def sync(self) -> None:
        self.part.sync()


class StackedNorm(_StackedTensor):
    """An RMSNorm of every run: weight [N, d] (decode_layers._rms takes it as a cohort's)."""

    def __init__(self, mods: list) -> None:
        super().__init__(mods)
        self.variance_epsilon = mods[0].variance_epsilon

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _rms(x, self.part.value, self.variance_epsilon)


class StackedEmbedding(_StackedTensor):
    """The token embeddings of every run, [N, V, d]: row r of ids [N * B, T] looks up its run's table."""

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        N = self.part.value.shape[0]
        run = torch.arange(N, device=ids.device).repeat_interleave(ids.shape[0] // N)
        return self.part.value[run[:, None], ids]


class _MLP(SimpleNamespace):
    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # Qwen3MLP: down(silu(gate(x)) * up(x))
        return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def _stacked_model(models: list) -> SimpleNamespace:
    """The runs' models as one model of stacked weights, with the attribute paths the engine and the decode path
    read."""
    inners = [m.model for m in models]
    layers = []
    for mods in zip(*(m.layers for m in inners), strict=True):
        att, mlp = [m.self_attn for m in mods], [m.mlp for m in mods]
        layers.append(SimpleNamespace(
            input_layernorm=StackedNorm([m.input_layernorm for m in mods]),
            post_attention_layernorm=StackedNorm([m.post_attention_layernorm for m in mods]),
            self_attn=SimpleNamespace(**{n: StackedLinear([getattr(a, n) for a in att])
                                         for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
                                      q_norm=StackedNorm([a.q_norm for a in att]),
                                      k_norm=StackedNorm([a.k_norm for a in att]), scaling=att[0].scaling),
            mlp=_MLP(**{n: StackedLinear([getattr(m, n) for m in mlp]) for n in ("gate_proj", "up_proj", "down_proj")})))
    inner = SimpleNamespace(layers=layers, embed_tokens=StackedEmbedding([m.embed_tokens for m in inners]),
                            norm=StackedNorm([m.norm for m in inners]), rotary_emb=inners[0].rotary_emb)
    return SimpleNamespace(config=models[0].config, model=inner, lm_head=StackedLinear([m.lm_head for m in models]))


def _syncables(model: SimpleNamespace) -> list:
    inner = model.model
    out = [inner.embed_tokens, inner.norm, model.lm_head]
    for layer in inner.layers:
        a, m = layer.self_attn, layer.mlp
        out += [layer.input_layernorm, layer.post_attention_layernorm, a.q_proj, a.k_proj, a.v_proj, a.o_proj,
                a.q_norm, a.k_norm, m.gate_proj, m.up_proj, m.down_proj]
    return out


class CohortEngine:
    """N TorchEngines of one model shape and one precision decoded together (see the module doc)."""

    name = "torch-cohort"
    # the engine surface the plain loop and the decode path read, TorchEngine's own arithmetic over stacked weights
    _layer = TorchEngine._layer
    forward = TorchEngine.forward
    _decode_plain = TorchEngine._decode_plain  # the plain loop; the cohort's prompt forward is one per row
    sample = staticmethod(TorchEngine.sample)

    def __init__(self, engines: list[Any]) -> None:
        if not engines:
            raise ValueError("cohort: at least one engine")
        e0 = engines[0]
        for i, e in enumerate(engines[1:], 1):
            for attr in ("n_kv", "head_dim", "vocab_size", "pad_id", "eos_id", "dtype_name", "linear_path", "device"):
                if getattr(e, attr) != getattr(e0, attr):
                    raise ValueError(f"cohort: engine {i} differs from engine 0 in {attr} "
                                     f"({getattr(e, attr)!r} against {getattr(e0, attr)!r}); a cohort is one format")
            if e.describe() != e0.describe():
                raise ValueError(f"cohort: engine {i} runs {e.describe()} against engine 0's {e0.describe()}")
        if any(e.recorder is not None for e in engines):
            raise ValueError("cohort: routing capture (MoE replay) is not supported")
        self.engines = engines
        for attr in ("device", "pad_id", "eos_id", "n_kv", "head_dim", "vocab_size", "kv_codec", "precision"):
            setattr(self, attr, getattr(e0, attr))
        self.recorder = None
        self.kv_packed = getattr(e0, "kv_packed", None)
        self.compact_tail = bool(getattr(e0, "compact_tail", False))
        self.compile_prefill = bool(getattr(e0, "compile_prefill", True))
        self.model = _stacked_model([e.model for e in engines])
        self._parts = _syncables(self.model)
        from parity.rollout.cuda_decode import CudaDecoder
        self.cuda_decoder = CudaDecoder(self)
        self.cuda_decoder.fused_pre = False  # the fused pre-attention kernel reads one run's q/k norms

    @property
    def runs(self) -> int:
        return len(self.engines)

    def describe(self) -> dict:
        return {**self.engines[0].describe(), "cohort": self.runs}

    def sync(self) -> None:
        """Copy every run's weights into the stacks, in place (after the engines' `update_weights`)."""
        for p in self._parts:
            p.sync()

    def _layouts(self, calls: list[tuple]) -> list[BatchLayout]:
        if len(calls) != self.runs:
            raise ValueError(f"cohort of {self.runs} runs: got {len(calls)} calls (one per run, in engine order)")
        specs = [c[1] for c in calls]
        for i, s in enumerate(specs[1:], 1):
            for f in ("temperature", "top_p", "max_new_tokens", "topk_logprobs"):
                if getattr(s, f) != getattr(specs[0], f):
                    raise ValueError(f"cohort: run {i}'s sampling differs from run 0's in {f} "
                                     f"({getattr(s, f)!r} against {getattr(specs[0], f)!r})")
        max_pos = self.model.config.max_position_embeddings
        lays = [layout_batch(c[0], c[1], c[2] if len(c) > 2 else None, self.pad_id, max_pos) for c in calls]
        if len({lay.size for lay in lays}) != 1:
            raise ValueError(f"cohort: every run's call must have the same number of rows, got {[lay.size for lay in lays]}")
        return lays

    @torch.no_grad()
    def generate(self, calls: list[tuple], fast: bool | None = None, use_graphs: bool | None = None
                 ) -> list[RolloutBatch]:
        """calls[i] = (prompt_token_ids, spec[, prompt_ids]) of run i, in engine order; run i's RolloutBatch, as its
        engine's `generate` gives it, for each. `fast`: the decode path (default: on CUDA), else the plain loop;
        `use_graphs` as the decode path's (default: on CUDA)."""
        lays = self._layouts(calls)
        spec, N = calls[0][1], self.runs
        P = max(lay.width for lay in lays)
        # the runs' prompts left-padded to the widest (rope positions count real tokens only)
        rows = [lay.prompts[r, lay.prompt_mask[r]].tolist() for lay in lays for r in range(lay.size)]
        prompts, pmask = left_pad(rows, self.pad_id, width=P)
        uniforms = torch.cat([lay.uniforms() for lay in lays])
        fast = self.device.type == "cuda" if fast is None else fast
        if fast:
            dec = self.cuda_decoder
            graphs = self.device.type == "cuda" if use_graphs is None else use_graphs
            st = dec.run(prompts, pmask, uniforms.to(self.device), spec, graphs)
            if st is None:  # compilation was given up during the call: the same call uncompiled
                st = dec.run(prompts, pmask, uniforms.to(self.device), spec, graphs)
            out = Responses(tokens=st.responses, mask=st.rmask, logprobs=st.logps, topk_ids=st.topk_ids,
                            topk_logprobs=st.topk_lp, done=st.done)
            meta = dec.meta(st, graphs, graphs and dec.compile)
        else:
            prompts, pmask = prompts.to(self.device), pmask.to(self.device)
            out, _ = self._decode_plain(prompts, pmask, uniforms.to(self.device), spec, lambda caches: self.forward(
                prompts, positions(pmask), caches, 0, prefill_mask(pmask)[:, None]))
            meta = {"engine": self.name, **self.describe()}
        B = out.tokens.shape[0] // N
        batches = []
        for i, lay in enumerate(lays):
            part = slice(i * B, (i + 1) * B)
            mine = Responses(tokens=out.tokens[part], mask=out.mask[part], logprobs=out.logprobs[part],
                             topk_ids=None if out.topk_ids is None else out.topk_ids[part],
                             topk_logprobs=None if out.topk_logprobs is None else out.topk_logprobs[part],
                             done=out.done[part])
            batches.append(lay.batch_of(mine, meta={**meta, "cohort_run": i}))
        return batches

