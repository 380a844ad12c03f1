"""The torch engine's fast decode path: a static KV cache and one CUDA graph per decode step.

TorchEngine.generate dispatches here on CUDA (see `supports`) through the CudaDecoder it owns
(`engine.cuda_decoder`), which holds the compiled functions, the static cache and the captured graphs; the batch
layout (rows, left padding, seeds, masks, positions) is the plain loop's, from parity.core.layout. What differs
from the plain loop, and why:

- The KV cache is one preallocated [B, n_kv, S, D] pair per layer (S = prompt + new tokens rounded up to
  `_S_ALIGN`). A decode step attends with a mask over the cache's first L slots, L = the filled prefix rounded
  up to `_L_BUCKET`, so all steps with the same L have the same shapes and the whole step (28 layers, sampling,
  bookkeeping) is captured once per L as a CUDA graph and replayed: the plain loop spends its time launching
  ~800 small kernels a step, not computing, and attending over all S slots read up to twice the K/V needed.
- All per-step state lives on the device (step counter, write slot, positions, done flags); a replay reads the
  token the previous replay sampled: the host replays and, every `_DONE_CHECK` steps, checks for finished rows.
- A layer's decode is pure-tensor functions (rollout/decode_layers.py: HF Qwen3's arithmetic, QuantLinear's forward
  for quantized projections): the pre-attention and the o_proj + MLP halves compiled once by Inductor on CUDA and
  shared by all layers and all attended lengths (the graph alone still replays ~45 tiny kernels a layer; fused
  element-wise work nearly halves the step, docs/PERFORMANCE.md), the attention between them uncompiled (with a
  per-L compile each new L cost seconds; `_ATTENTION_PER_L`). A compile failure falls back to the same functions uncompiled
  (`engine.cuda_decoder.compile_error`); `engine.cuda_decoder.compile = False` turns compilation off. With a
  bf16 cache the pre-attention function also writes k and v into the cache (`_pre_attention_write`: one kernel
  with the rotary instead of two index_copy_ after it); a low-precision cache's codec roundtrip stays eager
  inside the graph, with the writes after it.
- q/k/v and gate/up, which read the same input, run as one product each from stacked weight copies (refreshed
  from the modules at every call): at batch 64 every product is latency-bound, so five products a layer cost
  less than seven, and the INT8 path quantizes each input once. Projections of different formats stay apart.
- A simulated product (W4A4 and other mixed formats: both sides fake-quantized, a float32 product) multiplies by
  its float32 weight computed once a call (`decode_weights._Prepared`, refreshed like the stacks): the same numbers,
  40 fewer kernels a decode step for the 8-layer Countdown model.
- Decode attention is grouped-query attention as two batched matmuls over the cache, softmax in float32.
- INT8 W8A8 on the Triton path: before the first capture, each decode product's tile configuration is timed
  with the weights coming from memory and pinned (int8_triton.tune_decode): the compiled layers launch the
  measured best (docs/PERFORMANCE.md, "INT8 W8A8 decode at batch 64").
- Sampling with top_p = 1 draws by inverse CDF in vocabulary order (the same distribution and uniforms, no [B, V]
  sort; in two Triton launches wherever Triton is installed, rollout/sampler_kernel.py; PARITY_FUSED_SAMPLER=off:
  five passes). Greedy and top_p < 1 use TorchEngine.sample unchanged (bit-identical rules).
- A low-precision KV cache is stored packed (precision/kv_packed.py: 68 bytes a token-head for int4 against 256)
  and read by a Triton decode-attention kernel over the simulated cache's values (rollout/decode_attention.py;
  int4 per token-head in the rotated basis, rollout/int4_attention.py); `_PACKED_KV = False` keeps the simulated
  cache, the reference. `_FUSED_PRE` (off by default) makes a layer four launches: the q/k/v product, one kernel
  for norms, rotary, write and queries (rollout/pre_attention.py), the attention, o_proj to the next q/k/v product.
  `engine.kv_budget_bytes` caps the cache; a call with more rows runs in chunks that fit (rollout/kv_budget.py).
- With `engine.compact_tail` (rollout.compact_tail) a call's unfinished rows move to smaller states as most rows end
  (rollout/decode_state.py): the finished rows stop costing a product's rows.

The prefill (`CudaDecoder.prefill`) is TorchEngine.forward's arithmetic writing into the static cache, with the
stacked projections and, on CUDA with compilation on, the two halves of a layer compiled by Inductor (shapes
become dynamic after the first change of prompt length), faster than the modules' eager forward (figures:
docs/PERFORMANCE.md, "Compiled prefill"; `rollout.compile_prefill=false` keeps them eager, for a small model whose
prefill costs less than its compile). The last call's state and graphs are kept by the decoder and replayed
by later calls of the same shape; weights are updated in place by `update_weights`, which a replay sees.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from parity.core.fast_compile import raise_recompile_limit
from parity.core.layout import key_slots, layout_batch, positions, prefill_mask
from parity.core.profile import compile_seconds
from parity.core.sampling import SamplingSpec
from parity.precision.linear import QuantLinear
from parity.rollout import fused_step
from parity.rollout.decode_attention import fused_pre_attention_route as _fused_pre_attention_route
from parity.rollout.decode_layers import (  # noqa: F401  (tests and benchmarks import some here)
    _decode_attention,
    _linear,
    _o_proj_mlp,
    _o_proj_mlp_project,
    _post_attention,
    _pre_attention,
    _pre_attention_write,
    _prefill_post,
    _prefill_pre,
    _project,
    _project_qkv,
    _rms,
    _rope,
    plain_decode_attention,
)
from parity.rollout.decode_state import DecodeState, next_tail, scatter_rows
from parity.rollout.decode_weights import (  # noqa: F401  (tests import _Fused and _group here)
    _Fused,
    _group,
    _int8_triton_shapes,
    _layer_args,
    _lin_of,
)
from parity.rollout.sampler_kernel import fused_applies, fused_draw
from parity.rollout.sampling import _cdf_block, sample_inverse_cdf  # noqa: F401  (tests and benchmarks import them here)
from parity.types import RolloutBatch

_S_ALIGN = 64  # cache length granularity: prompts of nearby lengths reuse one captured graph
# A decode step attends over the cache's filled prefix rounded up to this many slots, not all S: one graph per prefix
# length, captured when first reached (S = 384, 128-token prompts: 192..384 slots a step, a quarter less a call)
_L_BUCKET = 64
_DONE_CHECK = 16  # host looks at the done flags every this many steps (each look is a sync)
_STACK = True  # q/k/v and gate/up as one product each (_Fused); False: one per module (benchmark A/B)
# The prompt forward: "compiled" = CudaDecoder.prefill's layer functions compiled by Inductor (shapes dynamic after
# the first change), "stacked" = the same functions eager, "modules" = the engine's own forward (benchmark A/B)
_PREFILL = "compiled"
# k and v written into the cache inside the compiled pre-attention function (one kernel with the rotary) instead
# of two index_copy_ after it; False: the separate writes (benchmark A/B)
_FUSED_CACHE_WRITE = True
# INT8 W8A8 on the int8_triton path: each decode product's tile configuration timed once, eagerly, with the
# weights coming from memory, and pinned (int8_triton.tune_decode), so the compiled layers launch the measured
# best; False: the compiled graph picks among the candidates itself when first built (benchmark A/B)
_PIN_INT8 = True
# A low-precision KV cache stored packed and read by the Triton decode-attention kernel on CUDA (see the module
# docstring); False: the simulated cache (bf16 values of the codec's roundtrip, the reference; benchmark A/B)
_PACKED_KV = True
# True (the default; PARITY_FUSED_PRE_ATTENTION=off for False): with a packed cache, the q/k norms, rotary, cache
# write and query preparation as one Triton kernel (rollout/pre_attention.py; a simulated cache's step the same
# norms and rotary, rollout/fused_step.py); False: the compiled function, the write kernel and the attention's own
# query launch. With it, _FUSED_RESIDUAL joins a layer's o_proj + MLP and the next one's norm and q/k/v product in
# one compiled function (False: two, the residual stored in the model dtype in between, as beside a simulated
# cache; an A/B, docs/INT4_DECODE.md)
_FUSED_PRE = _fused_pre_attention_route()
_FUSED_RESIDUAL = True
# How many calls' states (static cache, buffers, captured graphs, each with its KV cache) a decoder keeps, by shape:
# a run alternates its rollouts' shape and its held-out evaluations' (with one, every switch captures anew)
_KEEP_STATES = 2
# True: a simulated product's float32 weight (W4A4: codes x scales) computed once a call and kept (_Prepared), the
# same numbers; False: dequantized in every product of every step (benchmark A/B)
_PREPARE_SIMULATED = True
# True: a plain or simulated cache's attention, o_proj and MLP as one function compiled per attended length L
# (_post_attention); False: the attention uncompiled, o_proj + MLP compiled once for every L (benchmark A/B)
_ATTENTION_PER_L = False
# rollout.compact_tail (rollout/decode_state.py): tail states of at least _TAIL_MIN_ROWS rows and 1/_TAIL_SHARE of a
# run's rows (half, then a quarter), at most _TAIL_LEVELS a call; off by default (docs/PERFORMANCE.md)
_COMPACT_TAIL = False
_TAIL_MIN_ROWS, _TAIL_SHARE, _TAIL_LEVELS = 16, 4, 2


def supports(engine: Any) -> bool:
    """Dense Qwen3-style layers (q/k norms, SiLU-gated MLP, Linear or QuantLinear projections) without
    routing capture; MoE blocks route data-dependently (not capturable) and take the plain loop."""
    cfg = engine.model.config
    if engine.recorder is not None or getattr(cfg, "num_experts", 0) or getattr(cfg, "hidden_act", "") != "silu":
        return False
    lin = (torch.nn.Linear, QuantLinear)
    for layer in engine.model.model.layers:
        a, m = layer.self_attn, layer.mlp
        projs = [getattr(a, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        projs += [getattr(m, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(x, lin) for x in projs) or not hasattr(a, "q_norm") or not hasattr(a, "k_norm"):
            return False
    return True


def rope_tables(engine: Any, max_pos: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_pos, D] from the model's own rotary module (so scaling variants match the prefill)."""
    inner = engine.model.model
    pos = torch.arange(max_pos, device=engine.device)[None]
    probe = torch.zeros(1, max_pos, 1, dtype=dtype, device=engine.device)
    cos, sin = inner.rotary_emb(probe, pos)
    return cos[0].to(dtype), sin[0].to(dtype)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def attended_length(start: int, t: int, S: int) -> int:
    """Cache slots a decode step of response token t reads: slot start + t and all before it, rounded up to
    _L_BUCKET (so a few captured graphs serve a whole call), at most S."""
    return min(S, -(-(start + t + 1) // _L_BUCKET) * _L_BUCKET)


class CudaDecoder:
    """The fast decode path of one TorchEngine, owned by it (`engine.cuda_decoder`). It reads the engine's public
    surface (model, device, pad_id, eos_id, n_kv, head_dim, vocab_size, kv_codec, recorder, name, describe,
    forward, sample) and keeps its own state: the compiled layer functions, and the buffers and captured graphs
    of the last call's shape (`state`), which a later call of that shape reuses and replays."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.compile = True  # Inductor for the layer functions on CUDA; False: uncompiled (benchmark A/B)
        self.compile_error: str | None = None  # why compilation was given up (then `compile` is False)
        self.tail_error: str | None = None  # why the engine's compact_tail was turned off during a call
        # False: the fused pre-attention route is not taken whatever _FUSED_PRE says (a cohort's decoder: the
        # kernel reads one run's q/k norms, a cohort's rows carry several runs')
        self.fused_pre = True
        self.state: DecodeState | None = None  # the last call's
        self._kept: dict[tuple, DecodeState] = {}  # up to _KEEP_STATES calls' states by key, the last call's last
        self._decode_fns: tuple | None = None  # compiled layer_functions(True)
        self._prefill_fns: tuple | None = None  # compiled (_prefill_pre, _prefill_post)

    def supports(self) -> bool:
        return supports(self.engine)

    def reset(self) -> None:
        """Drop the static caches, buffers and graphs (the next call allocates and captures anew)."""
        self.state = None
        self._kept.clear()

    # ---- one call ----

    def generate(self, prompt_token_ids: list[list[int]], spec: SamplingSpec, prompt_ids: list[int] | None = None,
                 use_graphs: bool | None = None) -> RolloutBatch:
        """TorchEngine.generate on the static-cache path; same inputs, same RolloutBatch layout and meta."""
        eng = self.engine
        dev, R = eng.device, spec.max_new_tokens
        use_graphs = dev.type == "cuda" if use_graphs is None else use_graphs
        max_pos = eng.model.config.max_position_embeddings
        lay = layout_batch(prompt_token_ids, spec, prompt_ids, eng.pad_id, max_pos)
        B, P = lay.prompts.shape
        S = min(-(-(P + R) // _S_ALIGN) * _S_ALIGN, max_pos)
        w = eng.model.lm_head.weight
        dtype = w.dtype if w.is_floating_point() else torch.bfloat16
        if getattr(eng, "kv_budget_bytes", None):  # a capped KV cache: as many rows a call as fit, in chunks
            from parity.rollout.kv_budget import generate_in_chunks, rows_that_fit
            fit = rows_that_fit(eng, S, dtype, _PACKED_KV)
            if B > fit:
                return generate_in_chunks(eng, prompt_token_ids, spec, prompt_ids, fit, P,
                                          lambda _e, *a: self.generate(*a, use_graphs=use_graphs))
        st = self.run(lay.prompts, lay.prompt_mask, lay.uniforms(), spec, use_graphs)
        if st is None:  # compilation was given up during the call: the same call uncompiled
            return self.generate(prompt_token_ids, spec, prompt_ids, use_graphs)
        return lay.rollout_batch(st.responses, st.rmask, st.logps, ~st.done, st.topk_ids, st.topk_lp,
                                 meta=self.meta(st, use_graphs, use_graphs and self.compile))

    def replay(self, prompt_token_ids: list[list[int]], spec: SamplingSpec, responses: torch.Tensor,
               prompt_ids: list[int] | None = None, use_graphs: bool | None = None) -> RolloutBatch:
        """`generate` over given response tokens [B, R] instead of sampled ones (teacher-forced decoding on this
        path: its compiled layers, its cache layout and attention kernel); the batch's `rollout_logprobs` are the
        given tokens' log-probs step by step. With TorchEngine.replay (the plain loop) it scores one path's tokens
        under another path's arithmetic, e.g. the packed INT4 cache's tokens under the simulated cache."""
        eng = self.engine
        use_graphs = eng.device.type == "cuda" if use_graphs is None else use_graphs
        lay = layout_batch(prompt_token_ids, spec, prompt_ids, eng.pad_id, eng.model.config.max_position_embeddings)
        st = self.run(lay.prompts, lay.prompt_mask, lay.uniforms(), spec, use_graphs,
                      forced=lay.forced(responses, eng.pad_id))
        if st is None:  # compilation was given up during the call: the same call uncompiled
            return self.replay(prompt_token_ids, spec, responses, prompt_ids, use_graphs)
        return lay.rollout_batch(st.responses, st.rmask, st.logps, ~st.done, st.topk_ids, st.topk_lp,
                                 meta={**self.meta(st, use_graphs, use_graphs and self.compile), "replay": True})

    def meta(self, st: DecodeState, use_graphs: bool, compile_layers: bool) -> dict:
        """A batch's record of the engine and the route its call took."""
        from parity.rollout.decode_attention import kv_kernel_meta
        eng = self.engine
        fused = _FUSED_PRE and self.fused_pre and fused_step.applies(st.extras.get("packed"), eng.kv_codec,
                                                                     eng.head_dim, eng.device)
        return {"engine": eng.name, **eng.describe(),
                "decode_path": ("cuda_graph" if use_graphs else "static_cache_eager")
                + ("+tail" if getattr(eng, "compact_tail", _COMPACT_TAIL) else "")
                + ("+fused_sampler" if st.extras.get("fused_sampler") else "")
                + ("+inductor_layers" if compile_layers else "")
                + ("+eager_prefill" if compile_layers and st.extras.get("prefill_fns") == (_prefill_pre, _prefill_post)
                   else ""),
                "kv_cache_layout": ("packed" if "packed" in st.extras else
                                    "plain" if eng.kv_codec is None else "simulated"),
                **kv_kernel_meta(st.extras.get("packed"), fused,
                                 None if "packed" in st.extras or _ATTENTION_PER_L else st.caches[0][0]),
                **({"fused_pre_attention": True} if fused and "packed" not in st.extras else {}),
                **({"decode_tail_rows": st.extras["tail_rows"]} if st.extras.get("tail_rows") else {}),
                **({"decode_setup_s": st.extras["setup_s"]} if st.extras.get("setup_s") else {}),
                **({"decode_tail_error": self.tail_error} if self.tail_error else {})}

    def run(self, prompts: torch.Tensor, pmask: torch.Tensor, uniforms: torch.Tensor, spec: SamplingSpec,
            use_graphs: bool, forced: torch.Tensor | None = None) -> DecodeState | None:
        """Prefill and decode one batch (left-padded prompts [B, P], their mask, the rows' uniforms [B, R]) into a
        kept or new state, whose buffers then hold the responses; None when compilation or a tail state failed during
        the call (it is then off, and the caller runs the call again). `forced` [B, R]: these tokens instead of sampled
        ones (`replay`; a state and graphs of their own)."""
        eng = self.engine
        dev, R = eng.device, spec.max_new_tokens
        B, P = prompts.shape
        S = min(-(-(P + R) // _S_ALIGN) * _S_ALIGN, eng.model.config.max_position_embeddings)
        K = spec.topk_logprobs
        w = eng.model.lm_head.weight
        dtype = w.dtype if w.is_floating_point() else torch.bfloat16
        compile_layers = use_graphs and self.compile
        fused = fused_applies(spec, forced is not None, dev)  # the draw in two launches (rollout/sampler_kernel.py)
        key = (B, S, R, K, spec.temperature, spec.top_p, dtype, use_graphs, compile_layers, _PACKED_KV,
               getattr(eng, "kv_packed", None), forced is not None, fused)
        t0, c0 = time.perf_counter(), compile_seconds()
        fresh = key not in self._kept
        st = self._state_for(key, B, S, R, K, dtype, use_graphs, compile_layers)
        # this call's set-up (new state with INT8 tiles timed, prefill compile, captures): meta `decode_setup_s`
        setup = {"state": round(time.perf_counter() - t0, 3)} if fresh else {}
        if fresh and st.extras.get("int8_pinned"):  # where the integer products' tiles came from (table, timed)
            from parity.precision.int8_triton import PIN_SOURCE
            setup["int8_tiles"] = "+".join(sorted({PIN_SOURCE.get(k, "pinned") for k in st.extras["int8_pinned"]}))
        if forced is not None:  # a fixed buffer the captured steps read
            st.extras.setdefault("forced", torch.empty(B, R, dtype=torch.long, device=dev)).copy_(forced)
        st.extras["fused_sampler"] = fused

        prompts, pmask = prompts.to(dev), pmask.to(dev)
        st.uniforms.copy_(uniforms)
        st.key_ok.copy_(key_slots(pmask, R, S))
        st.plen.copy_(pmask.sum(-1))
        st.start.fill_(P)
        st.t.zero_()
        st.done.zero_()
        st.responses.fill_(eng.pad_id)  # what the plain loop leaves in steps after every row finished
        for x in (st.rmask, st.logps, st.topk_ids, st.topk_lp):
            if x is not None:
                x.zero_()
        t0 = time.perf_counter()
        st.logits.copy_(self.prefill(st, prompts, positions(pmask), prefill_mask(pmask)[:, None], compile_layers))
        if fresh:
            _sync(dev)
            setup["prefill"] = round(time.perf_counter() - t0, 3)
        captures, capture_s = 0, 0.0

        compact = bool(getattr(eng, "compact_tail", _COMPACT_TAIL))
        runs = int(getattr(eng, "runs", 1))
        tails: list[tuple[DecodeState, DecodeState, torch.Tensor, torch.Tensor]] = []
        cur = st  # the state decoding now: the call's, or a smaller one holding its unfinished rows
        steps = 0
        while steps < R:
            L = attended_length(P, steps, S)
            try:
                if not use_graphs:
                    self.step(cur, spec, L)
                elif L in cur.graphs:
                    cur.graphs[L].replay()
                else:  # first step over this many slots: it runs for real while its graph is captured
                    t0 = time.perf_counter()
                    cur.graphs[L] = self.capture(cur, spec, L)
                    _sync(dev)
                    captures, capture_s = captures + 1, capture_s + time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - the fallbacks below compute the same numbers another way
                if cur is not st:  # a tail state failed: the call again on the whole batch, the tail off
                    return self._give_up_tail(e)
                if not (use_graphs and L not in cur.graphs and compile_layers):
                    raise
                # a capture with compiled layers failed (Inductor missing or failing): the uncompiled step, same math
                self.compile, self.compile_error = False, f"{type(e).__name__}: {e}"[:500]
                self.reset()
                return None
            steps += 1
            if steps % _DONE_CHECK == 0 and steps < R:
                if bool(cur.done.all()):
                    break  # later steps would only write pad tokens, which the buffers already hold
                if compact and len(tails) < _TAIL_LEVELS:
                    try:
                        tail = next_tail(self, cur, runs, use_graphs, max(_TAIL_MIN_ROWS, B // runs // _TAIL_SHARE))
                    except Exception as e:  # noqa: BLE001 - the whole batch goes on without it
                        return self._give_up_tail(e)
                    if tail is not None:
                        tails.append(tail)
                        cur = tail[1]
        for parent, child, rows, live in reversed(tails):  # the unfinished rows' results back into the call's buffers
            scatter_rows(parent, child, rows, live)
        if tails:
            st.extras["tail_rows"] = [int(t[1].done.shape[0]) for t in tails]  # the call's record (meta)
        else:
            st.extras.pop("tail_rows", None)
        if captures:
            setup.update(captures=captures, capture=round(capture_s, 3))
        compiled = compile_seconds() - c0
        if compiled > 0.05:  # Dynamo and Inductor's part of the set-up (a late specialisation too)
            setup["compile"] = round(compiled, 3)
        st.extras["setup_s"] = setup
        return st

    def _give_up_tail(self, e: Exception) -> None:
        """A tail state failed: the engine's tail off (`tail_error`, in later batches' meta), the kept states dropped;
        None, so that the caller runs the call again on the whole batch."""
        self.engine.compact_tail = False
        self.tail_error = f"{type(e).__name__}: {e}"[:500]
        self.reset()
        return None

    def _state_for(self, key: tuple, B: int, S: int, R: int, K: int, dtype: torch.dtype, use_graphs: bool,
                   compile_layers: bool) -> DecodeState:
        """A kept call's state when `key` (shapes, sampling, route) matches, its stacked weights refreshed; else a
        new one, the least recently used kept state freed first when _KEEP_STATES are kept (a run alternates two
        shapes: its rollouts and its held-out evaluations)."""
        st = self._kept.pop(key, None)
        if st is not None:
            for f in st.extras["fused"] + st.extras["prepared"]:  # weights may have changed in place since the last call
                f.refresh()
            self._kept[key] = self.state = st
            return st
        self.state = None
        while len(self._kept) >= max(1, _KEEP_STATES):
            self._kept.pop(next(iter(self._kept)))
        st = self.new_state(key, B, S, R, K, dtype)
        st.extras["fns"] = self.layer_functions(compile_layers)
        st.extras["fused"], st.extras["prepared"] = [], []
        st.extras["layers"] = [_layer_args(layer, st.extras["fused"],
                                           st.extras["prepared"] if _PREPARE_SIMULATED else None, stack=_STACK)
                               for layer in self.engine.model.model.layers]
        if _PIN_INT8 and use_graphs:
            from parity.precision import int8_triton
            # a cohort's integer products are per run, on its B / runs rows (batched: one launch, each run's tiles)
            st.extras["int8_pinned"] = int8_triton.tune_decode(B // getattr(self.engine, "runs", 1),
                                                               _int8_triton_shapes(st.extras["layers"]),
                                                               self.engine.device)
        self._kept[key] = self.state = st
        return st

    def new_state(self, key: tuple, B: int, S: int, R: int, K: int, dtype: torch.dtype) -> DecodeState:
        eng = self.engine
        dev = eng.device
        cos, sin = rope_tables(eng, eng.model.config.max_position_embeddings, dtype)
        from parity.rollout.decode_attention import packed_cache_for
        packed = packed_cache_for(eng, B, S, dtype) if _PACKED_KV else None
        if packed is not None:  # the packed low-precision cache (one PackedLayer a layer)
            caches = packed.layers
        else:
            caches = [(torch.zeros(B, eng.n_kv, S, eng.head_dim, dtype=dtype, device=dev),
                       torch.zeros(B, eng.n_kv, S, eng.head_dim, dtype=dtype, device=dev))
                      for _ in eng.model.model.layers]
        st = DecodeState(
            key=key, caches=caches, cos=cos, sin=sin,
            t=torch.zeros(1, dtype=torch.long, device=dev), start=torch.zeros(1, dtype=torch.long, device=dev),
            plen=torch.zeros(B, dtype=torch.long, device=dev), key_ok=torch.zeros(B, S, dtype=torch.bool, device=dev),
            uniforms=torch.zeros(B, R, dtype=torch.float64, device=dev),
            logits=torch.zeros(B, eng.vocab_size, dtype=torch.float32, device=dev),
            tok=torch.zeros(B, dtype=torch.long, device=dev), done=torch.zeros(B, dtype=torch.bool, device=dev),
            responses=torch.zeros(B, R, dtype=torch.long, device=dev),
            rmask=torch.zeros(B, R, dtype=torch.bool, device=dev), logps=torch.zeros(B, R, dtype=torch.float32, device=dev),
            topk_ids=torch.zeros(B, R, K, dtype=torch.int32, device=dev) if K else None,
            topk_lp=torch.zeros(B, R, K, dtype=torch.float32, device=dev) if K else None,
        )
        if packed is not None:
            st.extras["packed"] = packed
            st.extras["slot0"] = torch.zeros(1, dtype=torch.long, device=dev)
        return st

    def layer_functions(self, want: bool) -> tuple:
        """The per-layer decode functions (pre-attention, post-attention, pre-attention with the cache write, o_proj +
        MLP for the packed cache, the q/k/v product for the fused pre-attention kernel, and the two joined across a
        layer boundary), compiled with Inductor when `want` (every layer has the same shapes, so each
        compiles once and serves all 28); plain functions otherwise."""
        fns = (_pre_attention, _post_attention, _pre_attention_write, _o_proj_mlp, _project_qkv, _o_proj_mlp_project)
        if not want:
            return fns
        if self._decode_fns is None:
            # one specialisation per attended length L, engine's weight formats (and compact_tail's row counts)
            raise_recompile_limit(256 if getattr(self.engine, "compact_tail", _COMPACT_TAIL) else 64)
            self._decode_fns = tuple(torch.compile(f, dynamic=False, fullgraph=True) for f in fns)
        return self._decode_fns

    # ---- the prompt forward ----

    def prefill(self, st: DecodeState, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                compile_layers: bool) -> torch.Tensor:
        """Prefill logits [B, V] by `_PREFILL`'s route; a failing compilation falls back to the same functions
        eager (recorded in `compile_error`)."""
        if _PREFILL == "modules":
            return self.engine.forward(ids, pos, st.caches, 0, mask)
        eager = (_prefill_pre, _prefill_post)
        fns = st.extras.get("prefill_fns")
        if fns is None:
            fns = eager
            # every cache layout takes the compiled halves (a simulated cache's codec roundtrip runs eagerly between
            # them): the packed and the simulated cache then differ in the cache and its attention alone
            if _PREFILL == "compiled" and compile_layers and getattr(self.engine, "compile_prefill", True):
                if self._prefill_fns is None:
                    self._prefill_fns = (torch.compile(_prefill_pre, fullgraph=True),
                                         torch.compile(_prefill_post, fullgraph=True))
                fns = self._prefill_fns
            st.extras["prefill_fns"] = fns
        try:
            return self._prefill(st, ids, pos, mask)
        except Exception as e:  # noqa: BLE001 - Inductor missing or failing: the eager functions are the same math
            if fns is eager:
                raise
            self.compile_error = f"prefill: {type(e).__name__}: {e}"[:500]
            st.extras["prefill_fns"] = eager
            return self._prefill(st, ids, pos, mask)

    def _prefill(self, st: DecodeState, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The prompt forward into the static cache with the decode's stacked projections (the INT8 path quantizes
        each input once, not three and two times), TorchEngine.forward's arithmetic: logits [B, V] float32 of
        the last prompt position."""
        eng = self.engine
        inner, D = eng.model.model, eng.head_dim
        pre_fn, post_fn = st.extras["prefill_fns"]
        T = ids.shape[1]
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h, pos)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        packed = st.extras.get("packed")
        for (pre, post), cache in zip(st.extras["layers"], st.caches):
            q, k, v = pre_fn(h, *pre, cos, sin, D)
            if packed is not None:  # packed cache: write the codes, attend over their dequantized values
                packed.write(cache, k, v, st.extras["slot0"])
                ck, cv = packed.values(cache, T)
            else:
                ck, cv = cache
                if eng.kv_codec is not None:
                    k, v = eng.kv_codec.roundtrip(k), eng.kv_codec.roundtrip(v)
                ck[:, :, :T], cv[:, :, :T] = k, v
                ck, cv = ck[:, :, :T], cv[:, :, :T]
            h = post_fn(h, q, ck, cv, mask, *post)
        return eng.model.lm_head(inner.norm(h[:, -1])).float()

    # ---- one decode step ----

    def decode_forward(self, st: DecodeState, tok: torch.Tensor, L: int) -> torch.Tensor:
        """One token per row at slot start + t, rope position plen + t, attending over cache slots [0, L) (L covers
        the slot): logits [B, V] float32."""
        eng = self.engine
        inner, D = eng.model.model, eng.head_dim
        pre_fn, post_fn, pre_write_fn, o_mlp_fn = st.extras["fns"][:4]
        pos = st.plen + st.t
        slot = st.start + st.t
        h = inner.embed_tokens(tok[:, None])  # [B, 1, hidden]
        fused_write = _FUSED_CACHE_WRITE and eng.kv_codec is None
        packed = st.extras.get("packed")
        # a simulated cache takes the same route's norms and rotary (rollout/fused_step.py)
        fused = _FUSED_PRE and self.fused_pre and fused_step.applies(packed, eng.kv_codec, D, tok.device)
        rotated = False
        if packed is not None:
            from parity.rollout.decode_attention import int4_rotated, packed_decode_attention
            rotated = int4_rotated(packed)
        layers = st.extras["layers"]
        if fused:  # q/k/v product, one kernel to the attention's inputs, attention, MLP
            h = fused_step.fused_layers(st, h, L, pos, slot, packed, rotated, eng.kv_codec, _FUSED_RESIDUAL)
            return eng.model.lm_head(inner.norm(h[:, -1])).float()
        cos, sin = st.cos[pos][:, None, :], st.sin[pos][:, None, :]  # [B, 1, D], broadcast over heads
        kmask = (torch.arange(L, device=tok.device)[None, :] <= slot) & st.key_ok[:, :L]
        for (pre, post), cache in zip(layers, st.caches):
            if packed is not None:  # packed cache: the write kernel, then the decode-attention kernel reading it
                q, k, v = pre_fn(h, *pre, cos, sin, D)
                packed.write(cache, k, v, slot)
                out = packed_decode_attention(q, packed, cache, st.key_ok, slot, L, post[0])
                h = o_mlp_fn(h, out[:, None], *post[1:])
                continue
            ck, cv = cache
            if fused_write:
                q = pre_write_fn(h, *pre, cos, sin, D, ck, cv, slot)
            else:
                q, k, v = pre_fn(h, *pre, cos, sin, D)
                if eng.kv_codec is not None:
                    # eager inside the graph: Dynamo cannot trace the codec's functools.cache'd Hadamard matrix
                    k, v = eng.kv_codec.roundtrip(k), eng.kv_codec.roundtrip(v)
                ck.index_copy_(2, slot, k[:, :, None].to(ck.dtype))
                cv.index_copy_(2, slot, v[:, :, None].to(cv.dtype))
            if _ATTENTION_PER_L:
                h = post_fn(h, q, ck[:, :, :L], cv[:, :, :L], kmask, *post)
                continue
            out = plain_decode_attention(q, ck, cv, st.key_ok, kmask, slot, L, post[0]).to(h.dtype)
            h = o_mlp_fn(h, out[:, None], *post[1:])  # compiled once for every L: the attention stays outside it
        return eng.model.lm_head(inner.norm(h[:, -1])).float()

    def sample_and_record(self, st: DecodeState, spec: SamplingSpec) -> None:
        """Draw token t from st.logits and write it, its log-prob and the done flags (all in place)."""
        eng = self.engine
        greedy = spec.temperature == 0.0
        temp = 1.0 if greedy else spec.temperature
        if st.extras.get("fused_sampler"):  # the same draw in two launches (rollout/sampler_kernel.py)
            tok, lp = fused_draw(st.logits, temp, st.uniforms.index_select(1, st.t).squeeze(1))
        else:
            logp = torch.log_softmax(st.logits / temp, dim=-1)
            if "forced" in st.extras:
                tok = st.extras["forced"].index_select(1, st.t).squeeze(1)
            elif greedy or spec.top_p < 1.0:
                tok = eng.sample(logp, spec.top_p, st.uniforms.index_select(1, st.t).squeeze(1), greedy)
            else:
                tok = sample_inverse_cdf(logp, st.uniforms.index_select(1, st.t).squeeze(1))
            lp = logp.gather(-1, tok[:, None]).squeeze(-1)
        live = ~st.done
        tok_out = torch.where(live, tok, eng.pad_id)
        st.responses.index_copy_(1, st.t, tok_out[:, None])
        st.rmask.index_copy_(1, st.t, live[:, None])
        st.logps.index_copy_(1, st.t, torch.where(live, lp, 0.0)[:, None])
        if st.topk_ids is not None:
            v, ix = logp.topk(spec.topk_logprobs, dim=-1)
            st.topk_lp.index_copy_(1, st.t, (v * live[:, None])[:, None])
            st.topk_ids.index_copy_(1, st.t, (ix.int() * live[:, None])[:, None])
        st.done.logical_or_(live & (tok == eng.eos_id))
        st.tok.copy_(tok_out)

    def step(self, st: DecodeState, spec: SamplingSpec, L: int) -> None:
        """Sample token t, then run the forward that gives the logits of token t + 1, then t += 1."""
        self.sample_and_record(st, spec)
        st.logits.copy_(self.decode_forward(st, st.tok, L))
        st.t.add_(1)

    def capture(self, st: DecodeState, spec: SamplingSpec, L: int) -> Any:
        """Record one decode step over L cache slots as a CUDA graph. The warm-up runs on a side stream as CUDA
        graphs require; it is the current step for real (lazy caches such as the Hadamard matrix, and the compiled
        functions for this L, get built there, outside capture), so after it t has advanced by one."""
        dev = self.engine.device
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            self.step(st, spec, L)
        torch.cuda.current_stream(dev).wait_stream(side)
        if st.pool is None:
            st.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=st.pool):
            self.step(st, spec, L)  # recorded, not executed: t does not move
        return graph
