"""The trainer section of tests/bench/bench_gpu.py: parity Trainer.step at batch 8 x 1024 on the 0.6B shape
(tokens/s, MFU, peak memory, GPU-busy fraction, host profile; GRPO vs score centering; eager, compiled and
CUDA-graph-replayed layers; head kernels and activation checkpointing A/Bs)."""

from __future__ import annotations

import gc
import statistics
import time

import torch
from gpu_bench_common import (
    KERNEL_TOTAL_MS,
    RESULTS,
    SHAPE,
    dump,
    host_profile,
    section,
    sync,
    timed,
    top_kernels,
)


def make_train_batch(topk: int):
    from parity.types import RolloutBatch
    g = torch.Generator().manual_seed(0)
    B, P, R, V = 8, 128, 896, SHAPE["vocab_size"]
    kw = {}
    if topk:
        base = torch.randint(0, V, (B, R, 1), generator=g)
        kw["topk_ids"] = ((base + torch.arange(topk)) % V).int()
        p = torch.softmax(torch.randn(B, R, topk, generator=g), -1) * 0.5
        kw["topk_logprobs"] = p.sort(-1, descending=True).values.log()
    return RolloutBatch(
        prompts=torch.randint(0, V, (B, P), generator=g), prompt_mask=torch.ones(B, P, dtype=torch.bool),
        responses=torch.randint(0, V, (B, R), generator=g), response_mask=torch.ones(B, R, dtype=torch.bool),
        rollout_logprobs=torch.full((B, R), -11.93), rewards=torch.randn(B, generator=g),
        truncated=torch.zeros(B, dtype=torch.bool), group_ids=torch.arange(B) // 4, prompt_ids=torch.arange(B) // 4,
        **kw)


def train_flops_per_step(B: int = 8, P: int = 128, R: int = 896) -> float:
    """Matmul FLOPs of forward + backward actually executed: 6 x params x tokens for the layers, the LM head
    on response tokens only (the chunked log-prob head), causal attention 6 x S x (H D) per token per layer."""
    h, i, L, nh, nkv, hd, V = (SHAPE[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                  "num_attention_heads", "num_key_value_heads", "head_dim",
                                                  "vocab_size"))
    per_layer = h * nh * hd * 2 + h * nkv * hd * 2 + 3 * h * i
    S = P + R
    return 6 * per_layer * L * B * S + 6 * V * h * B * R + 6 * S * nh * hd * L * B * S


@section("trainer")
def trainer(d: str, compile_layers: bool, only: set | None = None, interleave: bool = True) -> None:
    import parity.algorithms.logprobs as lp
    out: dict = {}
    RESULTS["trainer"] = out
    peak = RESULTS.get("ceilings", {}).get("bf16_matmul_TFLOPs", 790.0) * 1e12
    flops = train_flops_per_step()
    out["flops_per_step"] = flops
    # (label, correction, top-K, trainer.compile_layers, activation checkpointing, Triton head kernels)
    modes = [("grpo", "none", 0, False, False, True),
             ("score_centering", "score_centering", 128, False, False, True),
             ("grpo_eager_head", "none", 0, False, False, False),  # A/B: the head's block work in eager torch ops
             ("grpo_checkpointing", "none", 0, False, True, True)]
    if compile_layers:
        modes += [("grpo_compiled", "none", 0, True, False, True),
                  ("score_centering_compiled", "score_centering", 128, True, False, True),
                  ("grpo_compiled_eager_head", "none", 0, True, False, False),
                  # trainer.compile_mode=reduce-overhead: the compiled layers replayed as CUDA graphs
                  ("grpo_compiled_cudagraphs", "none", 0, "reduce-overhead", False, True),
                  ("score_centering_compiled_cudagraphs", "score_centering", 128, "reduce-overhead", False, True)]
    if only:
        modes = [m for m in modes if m[0] in only]
    for label, corr, topk, comp, ckpt, head in modes:
        lp.HEAD_KERNELS = head
        tr = _trainer(d, corr, topk, comp, ckpt)
        batch = make_train_batch(topk)
        t0 = time.perf_counter()
        out[f"{label}_first_loss"] = tr.step(batch)["train/loss"]  # same weights and batch: compare across modes
        tr.step(batch)
        sync()
        warm = time.perf_counter() - t0
        torch.cuda.reset_peak_memory_stats()
        t, m = timed(lambda tr=tr, batch=batch: tr.step(batch), 5)
        if label in ("grpo", "grpo_compiled", "score_centering_compiled", "grpo_compiled_cudagraphs",
                     "score_centering_compiled_cudagraphs"):
            out[f"{label}_top_kernels"] = top_kernels(lambda tr=tr, batch=batch: tr.step(batch))
            # device time of the step's kernels against its wall time (unprofiled median): < 1 = the GPU waits
            out[f"{label}_kernel_s"] = KERNEL_TOTAL_MS[0] / 1e3
            out[f"{label}_gpu_busy"] = KERNEL_TOTAL_MS[0] / 1e3 / t
        if label in ("grpo_compiled", "grpo_compiled_cudagraphs"):
            out[f"{label}_host_top"] = host_profile(lambda tr=tr, batch=batch: tr.step(batch))
        out[f"{label}_step_s"] = t
        out[f"{label}_warmup_s"] = warm
        out[f"{label}_tok_s"] = 8 * 1024 / t
        out[f"{label}_mfu"] = flops / t / peak
        out[f"{label}_peak_GiB"] = torch.cuda.max_memory_allocated() / 2**30
        out[f"{label}_loss"] = m.get("train/loss")
        del tr
        # Dynamo's cache holds the compiled layers' modules (and so the whole model, ~2.4 GB of fp32 weights):
        # without a reset every compiled mode after the first carried the previous model in its peak memory
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()
        dump()
    lp.HEAD_KERNELS = True
    for comp in ([False, True] if compile_layers else [False]) if interleave else []:
        interleaved_sc_ab(d, comp, out)
        dump()
    for suffix in ("", "_compiled", "_compiled_cudagraphs"):
        if f"score_centering{suffix}_step_s" in out:
            out[f"sc_time_ratio{suffix}"] = out[f"score_centering{suffix}_step_s"] / out[f"grpo{suffix}_step_s"]
            out[f"sc_mem_ratio{suffix}"] = out[f"score_centering{suffix}_peak_GiB"] / out[f"grpo{suffix}_peak_GiB"]
        if f"grpo{suffix}_eager_head_step_s" in out:
            out[f"head_kernels_speedup{suffix}"] = out[f"grpo{suffix}_eager_head_step_s"] / out[f"grpo{suffix}_step_s"]


def _trainer(d: str, corr: str, topk: int, comp: bool | str, ckpt: bool = False):
    """A CUDA Trainer on fresh fp32 weights from `d`: correction `corr`, top-K `topk`; comp False = eager layers,
    True = compiled, a string = compiled with that trainer.compile_mode; ckpt = activation checkpointing."""
    from transformers import AutoModelForCausalLM

    from parity.config import load_config
    from parity.training.trainer import build_trainer
    cfg = load_config(["trainer.micro_batch_size=8", "model.dtype=bfloat16", "trainer.device=cuda",
                       "algorithm.policy_loss=reinforce", f"algorithm.correction.name={corr}",
                       f"rollout.topk_logprobs={topk}", f"trainer.gradient_checkpointing={str(ckpt).lower()}",
                       f"trainer.compile_layers={str(bool(comp)).lower()}",
                       f"trainer.compile_mode={comp if isinstance(comp, str) else 'default'}"])
    return build_trainer(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32), cfg, torch.device("cuda"))


def interleaved_sc_ab(d: str, comp: bool, out: dict, rounds: int = 9) -> None:
    """Score centering's step time against plain GRPO with both trainers resident and their steps alternated
    (GRPO, SC, GRPO, SC, ...): clock or neighbour drift during the run hits both alike, which the sequential
    modes above cannot promise (their two ratios differed by more than the 1.15x goal's margin between runs).
    Reports the ratio of medians and the median of the per-round ratios."""
    suffix = "_compiled" if comp else ""
    pair = {"grpo": (_trainer(d, "none", 0, comp), make_train_batch(0)),
            "sc": (_trainer(d, "score_centering", 128, comp), make_train_batch(128))}
    for tr, batch in pair.values():
        tr.step(batch)
        tr.step(batch)
    times: dict = {"grpo": [], "sc": []}
    for _ in range(rounds):
        for name, (tr, batch) in pair.items():
            t, _ = timed(lambda tr=tr, batch=batch: tr.step(batch))
            times[name].append(t)
    ratios = [s / g for s, g in zip(times["sc"], times["grpo"])]
    out[f"interleaved{suffix}_grpo_step_s"] = statistics.median(times["grpo"])
    out[f"interleaved{suffix}_sc_step_s"] = statistics.median(times["sc"])
    peak = RESULTS.get("ceilings", {}).get("bf16_matmul_TFLOPs", 790.0) * 1e12
    out[f"interleaved{suffix}_grpo_mfu"] = train_flops_per_step() / statistics.median(times["grpo"]) / peak
    out[f"interleaved{suffix}_sc_time_ratio"] = statistics.median(times["sc"]) / statistics.median(times["grpo"])
    out[f"interleaved{suffix}_sc_time_ratio_per_round"] = sorted(round(r, 4) for r in ratios)
    print(f"interleaved score centering / GRPO{suffix}: {out[f'interleaved{suffix}_sc_time_ratio']:.3f} "
          f"(rounds {min(ratios):.3f}..{max(ratios):.3f})", flush=True)
    del pair
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
