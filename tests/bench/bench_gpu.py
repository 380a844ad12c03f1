"""One-run GPU benchmark of the numerical core on the Qwen3-0.6B shape, random bf16 weights.

    PYTHONUNBUFFERED=1 python3 tests/bench/bench_gpu.py --out $OUT/bench_gpu.json

(in an image without the project venv: PYTHONPATH=platform:<omegaconf/hydra/antlr4 site dir>; docs/PERFORMANCE.md).
Sections, each timed with CUDA synchronisation around the region, each failure reported not fatal:
  ceilings      device-to-device copy bandwidth, bf16 8192^3 matmul rate
  rollout       batch 64, 128-token prompts, 256 sampled tokens (no EOS: min_new_tokens / random weights):
                HF generate, TorchEngine plain loop, TorchEngine fast path BF16 (and, A/B, attending over the
                whole cache; q/k/v and gate/up unstacked), INT8 W8A8 (A/B: unstacked; cuBLASLt instead of
                the fused Triton kernel), INT8 W8A8 + INT4 KV; per-projection latency at M = 64
  kv            the packed KV cache (tests/bench/gpu_bench_kv.py): BF16, W8A8, W8A8 + INT4 KV, W8A8 + FP8 KV,
                BF16 + INT4 KV (packed) and W8A8 + INT4 KV simulated: tokens/s at batch 64 and at the largest batch
                whose cache fits in BF16's bytes at batch 64, KV bytes a step, fraction of the roof counting KV;
                the decode attention alone per format (kv_attention)
  check         fast path == plain loop in float32 (greedy and top-p: same tokens, log-probs to rounding);
                BF16 fast-path log-probs vs a teacher-forced HF forward (and the plain loop's, for scale)
  sync          update_weights seconds: BF16 -> BF16 engine, BF16 -> INT8 W8A8 engine
  trainer       parity Trainer.step at batch 8 x 1024 (128 prompt + 896 response tokens): tokens/s, MFU, peak
                memory; plain GRPO vs score centering (top-K 128); Triton head kernels vs eager head ops;
                activation checkpointing; eager vs compiled decoder layers (trainer.compile_layers)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from types import SimpleNamespace

import torch
from gpu_bench_common import (
    BATCH,
    OUT_PATH,
    P_TOKENS,
    R_TOKENS,
    RESULTS,
    SHAPE,
    build_model_dir,
    cold_sets,
    dump,
    graph_us,
    prompts,
    section,
    sync,
    timed,
    top_kernels,
)
from gpu_bench_kv import attention_us, kv_rows
from gpu_bench_trainer import trainer


@section("ceilings")
def ceilings() -> None:
    x = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    y = torch.empty_like(x)
    y.copy_(x)
    t, _ = timed(lambda: y.copy_(x), 10)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    a @ b
    tm, _ = timed(lambda: a @ b, 10)
    RESULTS["ceilings"] = {"copy_TBps": 2 * x.numel() * 2 / t / 1e12, "bf16_matmul_TFLOPs": 2 * 8192**3 / tm / 1e12}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step must read: every matrix once (the embedding table is gathered, not read)."""
    total = 0
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if "embed_tokens" in name and not model.config.tie_word_embeddings:
            continue
        total += t.numel() * t.element_size()
    return total


@section("rollout")
def rollout(d: str, reps: int, anchors: bool = True, sweep: bool = True) -> None:
    from transformers import AutoModelForCausalLM

    from parity.core.sampling import SamplingSpec
    from parity.rollout.torch_engine import TorchEngine
    out: dict = {}
    RESULTS["rollout"] = out
    spec = SamplingSpec(temperature=1.0, top_p=1.0, max_new_tokens=R_TOKENS, n=1, seed=0)
    ps = prompts(BATCH)
    n_tok = BATCH * R_TOKENS

    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
    out["weight_bytes"] = weight_bytes(hf)
    if not anchors:  # --skip anchors: the fast paths and their A/Bs only
        del hf
        return _fast_rollout(d, reps, out, spec, ps, n_tok, None, sweep=sweep)
    ids = torch.tensor(ps, device="cuda")
    am = torch.ones_like(ids)

    def hf_gen(new: int, hf: torch.nn.Module = hf) -> torch.Tensor:
        return hf.generate(input_ids=ids, attention_mask=am, do_sample=True, top_k=0, top_p=1.0,
                           max_new_tokens=new, min_new_tokens=new, pad_token_id=SHAPE["pad_token_id"])
    hf_gen(4)
    t, seq = timed(lambda f=hf_gen: f(R_TOKENS))
    assert seq.shape[1] == P_TOKENS + R_TOKENS, seq.shape
    out["hf_generate_tok_s"] = n_tok / t
    del hf, hf_gen

    eng = TorchEngine(d, device="cuda", dtype=torch.bfloat16)
    eng.fast_decode = False
    eng.generate(ps[:4], SamplingSpec(max_new_tokens=4, seed=0))
    t, plain = timed(lambda: eng.generate(ps, spec))
    out["torch_plain_tok_s"] = n_tok / t
    eng.fast_decode = True
    eng.cuda_decoder.compile = False
    eng.generate(ps, spec)
    t, _ = timed(lambda: eng.generate(ps, spec), reps)
    out["torch_fast_bf16_graph_only_tok_s"] = n_tok / t
    eng.cuda_decoder.compile = True
    _fast_rollout(d, reps, out, spec, ps, n_tok, eng, plain, sweep=sweep)


def _fast_rollout(d: str, reps: int, out: dict, spec, ps: list, n_tok: int, eng, plain=None,
                  sweep: bool = True) -> None:
    """The fast path's figures and A/Bs (BF16, INT8 W8A8, INT8 + INT4 KV) into `out`."""
    from parity.rollout.torch_engine import TorchEngine
    anchors = eng is not None
    if eng is None:
        eng = TorchEngine(d, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    b0 = eng.generate(ps, spec)  # allocates the static cache, compiles the layer functions, captures the graph
    sync()
    out["fast_first_call_s"] = time.perf_counter() - t0
    out["decode_path"] = b0.meta.get("decode_path")
    out["compile_error"] = eng.cuda_decoder.compile_error
    t, fast = timed(lambda: eng.generate(ps, spec), reps)
    assert int(fast.response_mask.sum()) == n_tok, "EOS cut some rows short: token count would be wrong"
    out["torch_fast_bf16_tok_s"] = n_tok / t
    if anchors:
        out["fast_over_hf"] = out["torch_fast_bf16_tok_s"] / out["hf_generate_tok_s"]
    roof = 4.3e12 / out["weight_bytes"] * BATCH
    if "ceilings" in RESULTS:
        roof = RESULTS["ceilings"]["copy_TBps"] * 1e12 / out["weight_bytes"] * BATCH
    out["roof_tok_s"] = roof
    out["fast_bf16_of_roof"] = out["torch_fast_bf16_tok_s"] / roof
    # a step also reads K and V over its attended slots (bf16, every layer): mean over this call's steps
    from parity.rollout.cuda_decode import attended_length
    S = -(-(P_TOKENS + R_TOKENS) // 64) * 64
    kv_per_slot = 2 * SHAPE["num_hidden_layers"] * BATCH * SHAPE["num_key_value_heads"] * SHAPE["head_dim"] * 2
    out["kv_bytes_per_step_mean"] = kv_per_slot * sum(attended_length(P_TOKENS, t, S) for t in range(R_TOKENS)) / R_TOKENS
    roof_kv = roof * out["weight_bytes"] / (out["weight_bytes"] + out["kv_bytes_per_step_mean"])
    out["roof_with_kv_tok_s"] = roof_kv
    out["fast_bf16_of_roof_with_kv"] = out["torch_fast_bf16_tok_s"] / roof_kv
    out["decode_step_profile"] = profile_decode_step(eng)
    if plain is not None:
        logprob_check(eng, fast, plain)
    RESULTS["_engines"] = {"bf16": eng}
    dump()

    if anchors:
        # A/B in the same run: every step attending over all S cache slots (the previous design)
        import parity.rollout.cuda_decode as cd
        bucket, cd._L_BUCKET = cd._L_BUCKET, 1 << 30
        eng.cuda_decoder.reset()
        eng.generate(ps, spec)
        t, _ = timed(lambda: eng.generate(ps, spec), reps)
        out["torch_fast_bf16_full_cache_attention_tok_s"] = n_tok / t
        out["prefix_attention_speedup"] = (out["torch_fast_bf16_tok_s"]
                                           / out["torch_fast_bf16_full_cache_attention_tok_s"])
        cd._L_BUCKET = bucket
        eng.cuda_decoder.reset()
        dump()
        # A/B: q/k/v and gate/up as separate products (the previous design)
        out["torch_fast_bf16_unstacked_tok_s"] = _decode_tok_s(eng, ps, spec, reps, stack=False)
        out["stacking_speedup_bf16"] = out["torch_fast_bf16_tok_s"] / out["torch_fast_bf16_unstacked_tok_s"]
        dump()

    for label, prec in [("int8_w8a8", SimpleNamespace(weights="int8", activations="int8", kv_cache="bf16")),
                        ("int8_w8a8_int4kv", SimpleNamespace(weights="int8", activations="int8",
                                                             kv_cache="int4_per_token_head"))]:
        q = TorchEngine(d, precision=prec, device="cuda", dtype=torch.bfloat16)
        out[f"{label}_linear_path"] = q.linear_path
        q.generate(ps, spec)
        t, b = timed(lambda q=q: q.generate(ps, spec), reps)
        out[f"torch_fast_{label}_tok_s"] = n_tok / t
        out[f"{label}_over_bf16"] = out[f"torch_fast_{label}_tok_s"] / out["torch_fast_bf16_tok_s"]
        out[f"{label}_mean_abs_dlogp_vs_bf16_forward"] = teacher_forced_gap(eng.model, b)[0]
        RESULTS["_engines"][label] = q
        dump()
        if label == "int8_w8a8":  # A/Bs of the INT8 path in the same run
            out["int8_w8a8_decode_step_profile"] = profile_decode_step(q)
            for e, name in ((eng, "bf16"), (q, "int8_w8a8")):
                for mode in ("modules", "stacked", "compiled"):
                    out[f"prefill_ms_{name}_{mode}"] = fast_prefill_ms(e, ps, spec, mode)
                out[f"prefill_{name}_top_kernels_modules"] = fast_prefill_ms(e, ps, spec, "modules", kernels=True)
                out[f"prefill_{name}_top_kernels_stacked"] = fast_prefill_ms(e, ps, spec, "stacked", kernels=True)
            if q.linear_path == "int8_triton":
                out["prefill_ms_int8_w8a8_cublas_modules"] = fast_prefill_ms(q, ps, spec, "modules", path="int8_mm_cuda")
            dump()
            for e, name in ((eng, "bf16"), (q, "int8_w8a8")):  # A/B: k/v cache writes as separate kernels
                out[f"torch_fast_{name}_separate_cache_writes_tok_s"] = _decode_tok_s(e, ps, spec, reps,
                                                                                    fused_write=False)
            out["fused_cache_write_speedup_bf16"] = (out["torch_fast_bf16_tok_s"]
                                                     / out["torch_fast_bf16_separate_cache_writes_tok_s"])
            out["int8_over_bf16_separate_cache_writes"] = (out["torch_fast_int8_w8a8_separate_cache_writes_tok_s"]
                                                           / out["torch_fast_bf16_separate_cache_writes_tok_s"])
            dump()
            import parity.rollout.cuda_decode as cd
            for mode in ("modules",):  # decode tokens/s with the modules' eager prefill (the earlier route, A/B)
                cd._PREFILL, keep = mode, cd._PREFILL
                try:
                    for e, name in ((eng, "bf16"), (q, "int8_w8a8")):
                        out[f"torch_fast_{name}_prefill_{mode}_tok_s"] = _decode_tok_s(e, ps, spec, reps)
                finally:
                    cd._PREFILL = keep
                out[f"int8_over_bf16_prefill_{mode}"] = (out[f"torch_fast_int8_w8a8_prefill_{mode}_tok_s"]
                                                         / out[f"torch_fast_bf16_prefill_{mode}_tok_s"])
                dump()
            if anchors:
                out["int8_w8a8_unstacked_tok_s"] = _decode_tok_s(q, ps, spec, reps, stack=False)
            if q.linear_path == "int8_triton":
                out["int8_w8a8_unpinned_tok_s"] = _unpinned_tok_s(q, ps, spec, reps)
                out["int8_w8a8_unpinned_over_bf16"] = out["int8_w8a8_unpinned_tok_s"] / out["torch_fast_bf16_tok_s"]
                out["int8_w8a8_cublas_tok_s"] = _decode_tok_s(q, ps, spec, reps, path="int8_mm_cuda")
                out["int8_w8a8_cublas_over_bf16"] = out["int8_w8a8_cublas_tok_s"] / out["torch_fast_bf16_tok_s"]
            dump()
    out["projection_latency_us"] = projection_latency()
    dump()
    if sweep:
        out["int8_kernel_sweep_us"] = int8_kernel_sweep()
    from parity.precision import int8_triton
    out["int8_triton_configs"] = int8_triton.chosen_configs()
    out["int8_triton_unusable_reason"] = int8_triton.unusable_reason
    dump()


def _unpinned_tok_s(eng, ps: list[list[int]], spec, reps: int) -> float:
    """A/B: INT8 decode tokens/s with the compiled graph choosing its own tile configurations (compiled afresh,
    no pinned tiles); the pinned ones are restored after."""
    import parity.rollout.cuda_decode as cd
    from parity.precision import int8_triton as it
    pinned = dict(it._PINNED)
    cd._PIN_INT8 = False
    it._PINNED.clear()
    torch._dynamo.reset()
    try:
        return _decode_tok_s(eng, ps, spec, reps)
    finally:
        cd._PIN_INT8 = True
        it._PINNED.update(pinned)
        torch._dynamo.reset()


@contextlib.contextmanager
def _quant_path(eng, path: str | None):
    """Every QuantLinear of the engine on `path` (None: unchanged) inside the block, restored after."""
    from parity.precision.linear import QuantLinear
    quant = [m for m in eng.model.modules() if isinstance(m, QuantLinear)]
    paths = [m.path for m in quant]
    for m in quant:
        m.path = path or m.path
    try:
        yield
    finally:
        for m, p in zip(quant, paths):
            m.path = p


def _decode_tok_s(eng, ps: list[list[int]], spec, reps: int, stack: bool = True, path: str | None = None,
                  fused_write: bool = True) -> float:
    """Fast-path tokens/s with q/k/v and gate/up stacked or not, k/v written into the cache inside the compiled
    pre-attention function or after it, and (INT8) another QuantLinear path; the engine is left as it was."""
    import parity.rollout.cuda_decode as cd
    cd._STACK = stack
    keep, cd._FUSED_CACHE_WRITE = cd._FUSED_CACHE_WRITE, fused_write
    try:
        with _quant_path(eng, path):
            eng.cuda_decoder.reset()
            eng.generate(ps, spec)
            t, _ = timed(lambda: eng.generate(ps, spec), reps)
    finally:
        cd._STACK = True
        cd._FUSED_CACHE_WRITE = keep
        eng.cuda_decoder.reset()
    return BATCH * R_TOKENS / t


def fast_prefill_ms(eng, ps: list[list[int]], spec, mode: str, path: str | None = None,
                    kernels: bool = False) -> float | list[str]:
    """Milliseconds of the fast path's prompt forward into its static cache by route `mode` (cuda_decode's
    _PREFILL: modules / stacked / compiled), median of 5 after a warm-up; kernels=True: its top kernels."""
    import parity.rollout.cuda_decode as cd
    from parity.core.layout import layout_batch
    if eng.cuda_decoder.state is None:
        eng.generate(ps, spec)
    st = eng.cuda_decoder.state
    lay = layout_batch(ps, spec, None, eng.pad_id, eng.model.config.max_position_embeddings)
    ids, pmask = lay.prompts, lay.prompt_mask
    ids, pmask = ids.cuda(), pmask.cuda()
    P = ids.shape[1]
    i = torch.arange(P, device="cuda")
    mask = ((i[:, None] >= i[None, :])[None] & pmask[:, None, :])[:, None]
    pos = (pmask.long().cumsum(-1) - 1).clamp_min(0)
    keep, cd._PREFILL = cd._PREFILL, mode
    st.extras.pop("prefill_fns", None)
    try:
        with _quant_path(eng, path), torch.no_grad():
            def run():
                return eng.cuda_decoder.prefill(st, ids, pos, mask, True)
            run()
            if kernels:
                return top_kernels(run, 10)
            t, _ = timed(run, 5)
    finally:
        cd._PREFILL = keep
        st.extras.pop("prefill_fns", None)
    return t * 1e3


def projection_latency() -> dict:
    """Microseconds per decode product at M = 64 rows for the 0.6B shape's stacked and single projections:
    BF16 GEMM; INT8 as quantize + cuBLASLt _int_mm + rescale; INT8 as quantize + the fused Triton kernel. Each
    compiled like the decode layers and timed as a CUDA graph of 50 calls (median of 5 replays), rotating weight
    sets of 200 MB or more together (cold_sets) so the weights are not served from L2."""
    from parity.precision import int8_triton
    from parity.precision.formats import quantize_rowwise
    from parity.precision.linear import quant_linear_forward
    res: dict = {}
    paths = ["int8_mm_cuda"] + (["int8_triton"] if int8_triton.usable() else [])
    for name, (n, k) in {"qkv_stacked": (4096, 1024), "q": (2048, 1024), "o": (1024, 2048),
                         "gate_up_stacked": (6144, 1024), "down": (1024, 3072)}.items():
        x = torch.randn(BATCH, k, device="cuda", dtype=torch.bfloat16)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(cold_sets(n * k))]
        qs = [quantize_rowwise(w, "int8") for w in ws]
        variants = {"bf16": [(lambda w=w, x=x: torch.nn.functional.linear(x, w)) for w in ws]}
        for p in paths:
            f = torch.compile(lambda x, wq, s, p=p: quant_linear_forward(x, wq, s, None, "int8", "int8", p),
                              dynamic=False, fullgraph=True)
            variants[p] = [(lambda f=f, q=q, x=x: f(x, *q)) for q in qs]
        res[f"{name}_{n}x{k}"] = row = {v: graph_us(calls) for v, calls in variants.items()}
        print(f"projection {name} {n}x{k}: {row}", flush=True)
    return res


def _sweep_shape(n: int, k: int) -> dict:
    import triton

    from parity.precision import int8_triton as it
    x = torch.randn(BATCH, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = it.quant_rows(x)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(cold_sets(n * k))]
    qs = [it.quantize_int8_rowwise(w) for w in ws]
    ref = it._reference(xq, qs[0][0], xs, qs[0][1], torch.bfloat16)
    row = {"bf16": graph_us([(lambda w=w: torch.nn.functional.linear(x, w)) for w in ws]),
           "autotuned_op": graph_us([(lambda q=q: it.w8a8_mm(xq, q[0], xs, q[1], torch.bfloat16)) for q in qs])}
    for c in it._prune(it._CONFIGS, {"M_KEY": BATCH, "K": k}):
        kw = dict(c.kwargs)
        label = "m{BLOCK_M}n{BLOCK_N}k{BLOCK_K}".format(**kw) + f"_st{c.num_stages}w{c.num_warps}"
        y = torch.empty(BATCH, n, device="cuda", dtype=torch.bfloat16)
        grid = (triton.cdiv(n, kw["BLOCK_N"]), triton.cdiv(BATCH, kw["BLOCK_M"]))

        def launch(q, y=y, grid=grid, kw=kw, c=c):
            it._w8a8_kernel[grid](xq, q[0], xs, q[1], y, BATCH, n, k, xq.stride(0), q[0].stride(0),
                                  y.stride(0), BATCH, num_stages=c.num_stages, num_warps=c.num_warps, **kw)
        try:
            launch(qs[0])
            sync()
            row[label] = graph_us([(lambda q=q, f=launch: f(q)) for q in qs]) if torch.equal(y, ref) else "MISMATCH"
        except Exception as e:  # noqa: BLE001 - one failing configuration must not hide the others
            row[label] = f"{type(e).__name__}: {e}"[:120]
    return row


def int8_kernel_sweep() -> dict:
    """Microseconds of the Triton W8A8 product alone (activations already quantized) at M = 64 for every decode
    tile configuration, against the BF16 GEMM: CUDA graph of 50 calls rotating weight sets of >= 200 MB
    (cold_sets), median of 5 replays; each configuration first checked bit-identical to torch._int_mm + rescale
    (else 'MISMATCH')."""
    from parity.precision import int8_triton as it
    if not it.usable():
        return {"skipped": it.unusable_reason}
    res: dict = {}
    for name, (n, k) in {"qkv_stacked": (4096, 1024), "o": (1024, 2048), "gate_up_stacked": (6144, 1024),
                         "down": (1024, 3072)}.items():
        res[f"{name}_{n}x{k}"] = row = _sweep_shape(n, k)
        print(f"int8 sweep {name} {n}x{k}: {row}", flush=True)
    return res


def profile_decode_step(eng) -> dict:
    """Kernels of 4 replays of one captured decode step (CUPTI records the kernels inside a graph): device time
    per step against wall time per replay tells launch gaps from kernel time. (Before the pinned-tile runs of
    2026-11-30 the step's functions ran eagerly for this, which launched the same kernels without the graph.)"""
    from parity.rollout.cuda_decode import attended_length
    st = eng.cuda_decoder.state
    L = attended_length(P_TOKENS, 100, st.key_ok.shape[1])  # steps 100..103 (they share one L)
    st.t.fill_(100)
    t_replay, _ = timed(lambda: [st.graphs[L].replay() for _ in range(4)], 3)
    st.t.fill_(100)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            st.graphs[L].replay()
        sync()
    ev = prof.key_averages()
    total = sum(e.device_time_total for e in ev) / 1e3 / 4
    rows = sorted(ev, key=lambda e: -e.device_time_total)[:12]
    return {"attended_slots": L, "replay_ms_per_step": t_replay * 1e3 / 4, "kernel_ms_per_step": total,
            "kernels_per_step": sum(e.count for e in ev) / 4,
            "top": [f"{e.device_time_total / 4e3:7.3f} ms x{e.count // 4:<4} {e.key[:80]}" for e in rows]}


def teacher_forced_gap(model: torch.nn.Module, b, temperature: float = 1.0) -> tuple[float, float]:
    """mean and max |rollout log-prob - log-prob of a full forward of `model` on the same tokens|."""
    diffs = []
    P = b.prompts.shape[1]
    with torch.no_grad():
        for rows in torch.arange(b.batch_size).split(8):
            mb = b.select(rows)
            am = mb.attention_mask.cuda()
            logits = model(input_ids=mb.input_ids.cuda(), attention_mask=am,
                           position_ids=(am.long().cumsum(-1) - 1).clamp_min(0)).logits[:, P - 1:-1].float()
            ref = torch.log_softmax(logits / temperature, -1).gather(-1, mb.responses.cuda()[..., None])[..., 0]
            m = mb.response_mask.cuda()
            diffs.append((mb.rollout_logprobs.cuda() - ref)[m].abs())
    d = torch.cat(diffs)
    return float(d.mean()), float(d.max())


def logprob_check(eng, fast, plain) -> None:
    out = RESULTS.setdefault("check", {})
    out["bf16_fast_vs_forward_mean_abs"], out["bf16_fast_vs_forward_max_abs"] = teacher_forced_gap(eng.model, fast)
    out["bf16_plain_vs_forward_mean_abs"], out["bf16_plain_vs_forward_max_abs"] = teacher_forced_gap(eng.model, plain)


@section("check")
def check_fp32(d: str) -> None:
    """Graph replay vs the plain loop in float32: the sampling rules are the same for greedy and top-p."""
    from parity.core.sampling import SamplingSpec
    from parity.rollout.torch_engine import TorchEngine
    out = RESULTS.setdefault("check", {})
    eng = TorchEngine(d, device="cuda", dtype=torch.float32)
    ps = prompts(16, seed=1)
    for label, spec in [("greedy", SamplingSpec(temperature=0.0, max_new_tokens=32, seed=3)),
                        ("top_p", SamplingSpec(temperature=1.0, top_p=0.9, max_new_tokens=32, n=2, seed=4,
                                               topk_logprobs=8))]:
        eng.fast_decode = False
        a = eng.generate(ps, spec)
        eng.fast_decode = True
        eng.generate(ps, spec)  # capture
        b = eng.generate(ps, spec)  # replay of the captured graph
        out[f"fp32_{label}_tokens_equal_frac"] = float((a.responses == b.responses).float().mean())
        out[f"fp32_{label}_max_abs_dlogp"] = float((a.rollout_logprobs - b.rollout_logprobs).abs().max())
        t_ = 1.0 if spec.temperature == 0 else spec.temperature
        if label == "top_p":  # tokens diverge on near-ties of a near-uniform random model: check each path
            out["fp32_fast_vs_forward_max_abs"] = teacher_forced_gap(eng.model, b, t_)[1]
            out["fp32_plain_vs_forward_max_abs"] = teacher_forced_gap(eng.model, a, t_)[1]
    del eng


@section("sync")
def weight_sync() -> None:
    out: dict = {}
    RESULTS["sync"] = out
    engines = RESULTS.get("_engines", {})
    src = engines["bf16"].model
    named = [(n, p.detach().clone()) for n, p in src.named_parameters()]  # the trainer's BF16 stream
    for label, eng in engines.items():
        eng.update_weights(iter(named))
        t, _ = timed(lambda eng=eng: eng.update_weights(iter(named)), 3)
        out[f"bf16_to_{label}_s"] = t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench_gpu.json")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip", default="", help="comma-separated sections to skip: rollout,kv,check,sync,trainer,compile,"
                   "interleaved, anchors (HF generate, the plain loop and the older-design A/Bs), sweep (INT8 tile sweep)")
    p.add_argument("--trainer-modes", default="", help="comma-separated trainer variants to run (default: all), "
                   "e.g. grpo_compiled,grpo_compiled_cudagraphs")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(f"{__file__}: needs a CUDA device (see docs/PERFORMANCE.md); nothing measured on this machine")
        return
    OUT_PATH[0] = args.out
    skip = set(filter(None, args.skip.split(",")))
    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["torch"] = torch.__version__
    t0 = time.perf_counter()
    ceilings()
    d = build_model_dir()
    print(f"model built and saved in {time.perf_counter() - t0:.1f}s", flush=True)
    if "rollout" not in skip:
        rollout(d, args.reps, "anchors" not in skip, "sweep" not in skip)
    if "check" not in skip:
        check_fp32(d)
    if "sync" not in skip and "_engines" in RESULTS:
        weight_sync()
    RESULTS.pop("_engines", None)
    torch.cuda.empty_cache()
    if "kv" not in skip:
        kv_rows(d, args.reps)
        attention_us()
    if "trainer" not in skip:
        trainer(d, "compile" not in skip, set(filter(None, args.trainer_modes.split(","))) or None,
                "interleaved" not in skip)
    RESULTS["total_s"] = time.perf_counter() - t0
    dump()
    print(json.dumps(RESULTS, default=str))


if __name__ == "__main__":
    main()
