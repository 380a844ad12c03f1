"""What the GPU benchmark sections share (tests/bench/bench_gpu.py, gpu_bench_trainer.py): the 0.6B shape, the
results dictionary written after every section, CUDA-synchronised timing, profiler summaries."""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable

import torch

R_TOKENS, P_TOKENS, BATCH = 256, 128, 64
SHAPE = dict(vocab_size=151_936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
             tie_word_embeddings=True, rope_theta=1_000_000.0, eos_token_id=151_645, pad_token_id=151_643,
             bos_token_id=151_643)
RESULTS: dict = {}
OUT_PATH = ["bench_gpu.json"]
KERNEL_TOTAL_MS = [0.0]  # device time of the kernels in the last top_kernels() call


def dump() -> None:
    """Written after every section, so a run cut off by a time limit still leaves its figures."""
    with open(OUT_PATH[0], "w") as f:
        json.dump({k: v for k, v in RESULTS.items() if not k.startswith("_")}, f, indent=1, default=str)


def sync() -> None:
    torch.cuda.synchronize()


def timed(fn: Callable[[], object], reps: int = 1) -> tuple[float, object]:
    """Median seconds of `reps` runs (after the caller's warm-up) and the last result."""
    times, out = [], None
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def section(name: str):
    def deco(fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                fn(*a, **k)
            except Exception as e:  # noqa: BLE001 - one broken section must not hide the others
                RESULTS.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            print(f"[{name}] {time.perf_counter() - t0:.1f}s {json.dumps(RESULTS.get(name, {}), default=str)}", flush=True)
            dump()
        return run
    return deco


def graph_us(calls: list) -> float:
    """Microseconds per call: a CUDA graph of max(50, len(calls)) calls cycling through `calls` (each at least
    once: rotated weight sets all take part), median of 5 replays."""
    for c in calls:
        c()
    sync()
    n = max(50, len(calls))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n):
            calls[i % len(calls)]()
    g.replay()
    t, _ = timed(g.replay, 5)
    return round(t / n * 1e6, 2)


def cold_sets(int8_bytes: int) -> int:
    """Weight sets to rotate so that one cycle of the int8 copies moves >= 200 MB, four times the H200's 50 MB
    L2 (the compiled-prefill runs of 2026-11-29 rotated 8 sets: 32 MB of int8 weights stayed in L2 and flattered the
    INT8 products; docs/PERFORMANCE.md)."""
    return max(8, -(-200_000_000 // int8_bytes))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n random prompts of P_TOKENS ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 151_000, (n, P_TOKENS), generator=g).tolist()


def top_kernels(fn: Callable[[], object], n: int = 12) -> list[str]:
    """The n CUDA kernels with the most device time in one call of fn (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    ev = prof.key_averages()
    KERNEL_TOTAL_MS[0] = sum(e.device_time_total for e in ev) / 1e3
    rows = sorted(ev, key=lambda e: -e.device_time_total)[:n]
    return [f"{e.device_time_total / 1e3:8.1f} ms x{e.count:<5} {e.key[:90]}" for e in rows]


def host_profile(fn: Callable[[], object], n: int = 15) -> list[str]:
    """Where the host spends one call of fn: the n operators with the most self CPU time (torch.profiler),
    and the wall time of the profiled call."""
    from torch.profiler import ProfilerActivity, profile
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
        sync()
    wall = time.perf_counter() - t0
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:n]
    return [f"profiled wall {wall * 1e3:.1f} ms"] + [
        f"{e.self_cpu_time_total / 1e3:8.2f} ms x{e.count:<5} {e.key[:80]}" for e in rows]


def build_model_dir() -> str:
    from transformers import Qwen3Config, Qwen3ForCausalLM
    d = tempfile.mkdtemp(prefix="qwen3_06b_")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(Qwen3Config(**SHAPE)).to(torch.bfloat16)
    model.save_pretrained(d)
    return d
