"""Rollout throughput of vLLM vs the torch engine vs HF `generate` on the same model, batch and lengths, and
seconds per weight sync (vLLM BF16/FP32 reload, vLLM W8A8 INT8 requantize, INT8 rebuild, torch engine),
printed as ratios from one run. Engines alternate over the rounds; the median round is reported.

Run: `OMP_NUM_THREADS=1 .venv/bin/python tests/bench/bench_vllm_rollout.py` (env: BENCH_PROMPTS=32,
BENCH_N=4, BENCH_TOKENS=64, BENCH_ROUNDS=3). Prints one JSON line."""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _spec(tokens: int, n: int):
    from parity.rollout.base import SamplingSpec

    return SamplingSpec(temperature=1.0, max_new_tokens=tokens, n=n, seed=0)


def _engine_rate(engine, prompts: list[list[int]], tokens: int, n: int) -> float:
    t0 = time.perf_counter()
    b = engine.generate(prompts, _spec(tokens, n))
    return int(b.response_mask.sum()) / (time.perf_counter() - t0)


def _hf_rate(model, prompts: list[list[int]], tokens: int, n: int, pad_id: int, eos_id: int) -> float:
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):], am[i, P - len(p):] = torch.tensor(p), 1
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=am, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=tokens, num_return_sequences=n, pad_token_id=pad_id, eos_token_id=eos_id)
    dt = time.perf_counter() - t0
    resp = out[:, P:]
    # tokens up to and including the first EOS, as the engines count them
    is_eos = (resp == eos_id).int()
    after = (is_eos.cumsum(-1) - is_eos) > 0
    return int((~after).sum()) / dt


def _sync_seconds(engine, model, reps: int) -> float:
    times = [engine.update_weights((k, v.detach().to(torch.bfloat16)) for k, v in model.named_parameters())
             for _ in range(reps)]
    return statistics.median(times)


def main() -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoModelForCausalLM

    from parity.config import load_config
    from parity.models.prepare import prepare_model
    from parity.rollout import build_engine, compute_dtype

    n_prompts, n = int(os.environ.get("BENCH_PROMPTS", 32)), int(os.environ.get("BENCH_N", 4))
    tokens, rounds = int(os.environ.get("BENCH_TOKENS", 64)), int(os.environ.get("BENCH_ROUNDS", 3))
    out = os.environ.get("PARITY_OUTPUTS") or tempfile.mkdtemp(prefix="bench_vllm_")
    base = [f"outputs_dir={out}", "model.warm_start.steps=30", "model.warm_start.eval_problems=16",
            f"rollout.max_new_tokens={tokens}", f"rollout.n={n}"]
    cfg = load_config([*base, "rollout.name=vllm"])
    model_dir = prepare_model(cfg)["model_dir"]
    dtype = compute_dtype(cfg, torch.device("cpu"))
    prompts = [[5 + (i * 7 + j) % 60 for j in range(6 + i % 5)] for i in range(n_prompts)]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    pad_id, eos_id = int(hf.config.pad_token_id), int(hf.config.eos_token_id)

    t0 = time.perf_counter()
    vllm = build_engine(cfg, model_dir)
    vllm_init = time.perf_counter() - t0
    torch_engine = build_engine(load_config([*base, "rollout.name=torch"]), model_dir)
    rates: dict[str, list[float]] = {"vllm": [], "torch_engine": [], "hf_generate": []}
    _engine_rate(vllm, prompts[:4], 8, 1)  # warm-up both engines
    _engine_rate(torch_engine, prompts[:4], 8, 1)
    for _ in range(rounds):
        rates["vllm"].append(_engine_rate(vllm, prompts, tokens, n))
        rates["torch_engine"].append(_engine_rate(torch_engine, prompts, tokens, n))
        rates["hf_generate"].append(_hf_rate(hf, prompts, tokens, n, pad_id, eos_id))
    med = {k: statistics.median(v) for k, v in rates.items()}
    sync = {"vllm_reload_s": _sync_seconds(vllm, hf.float(), 3), "torch_engine_s": _sync_seconds(torch_engine, hf, 3)}
    vllm.close()
    torch_engine.close()

    int8_cfg = load_config([*base, "rollout.name=vllm", "rollout.precision.weights=int8",
                            "rollout.precision.activations=int8"])
    t0 = time.perf_counter()
    int8 = build_engine(int8_cfg, model_dir)
    int8_init = time.perf_counter() - t0
    int8_rate = statistics.median(_engine_rate(int8, prompts, tokens, n) for _ in range(rounds))
    sync["vllm_int8_requantize_s"] = _sync_seconds(int8, hf.float(), 3)
    int8.sync_route = "rebuild"
    sync["vllm_int8_rebuild_s"] = _sync_seconds(int8, hf.float(), 1)
    int8.close()

    return {
        "batch": f"{n_prompts} prompts x {n} x {tokens} tokens", "dtype": str(dtype).replace("torch.", ""),
        "tokens_per_s": {k: round(v, 1) for k, v in med.items()}, "vllm_int8_tokens_per_s": round(int8_rate, 1),
        "vllm_vs_torch_engine": round(med["vllm"] / med["torch_engine"], 3),
        "vllm_vs_hf_generate": round(med["vllm"] / med["hf_generate"], 3),
        "torch_engine_vs_hf_generate": round(med["torch_engine"] / med["hf_generate"], 3),
        "vllm_int8_vs_vllm": round(int8_rate / med["vllm"], 3),
        "sync_s": {k: round(v, 4) for k, v in sync.items()},
        "int8_rebuild_vs_requantize": round(sync["vllm_int8_rebuild_s"] / sync["vllm_int8_requantize_s"], 1),
        "init_s": {"vllm": round(vllm_init, 1), "vllm_int8_with_export": round(int8_init, 1)},
        "rounds": {k: [round(x, 1) for x in v] for k, v in rates.items()},
    }


if __name__ == "__main__":  # vLLM may spawn processes: keep the entry point guarded
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))
    print(json.dumps(main()))
