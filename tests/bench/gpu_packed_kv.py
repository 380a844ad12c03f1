"""One device run for the packed KV cache: its CUDA tests, then the benchmark rows, one JSON.

    PYTHONPATH=$PWD/platform:$PWD/tests/bench PYTHONUNBUFFERED=1 python3 tests/bench/gpu_packed_kv.py --out $OUT/packed_kv.json

1. `python -m pytest -q tests/test_kv_packed_cuda.py` (pytest-xdist workers when installed; time-boxed), its
   exit status and the end of its output under "cuda_tests";
2. the copy and matmul ceilings, the Qwen3-0.6B-shaped model, the rows of gpu_bench_kv.py (BF16, W8A8, W8A8 + INT4
   KV, W8A8 + FP8 KV, BF16 + INT4 KV, W8A8 + INT4 KV simulated; batch 64 and the largest batch in BF16's KV bytes)
   and the decode attention alone per format.
Needs torch, transformers, triton and pytest only. Every section writes the JSON as it finishes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from gpu_bench_common import OUT_PATH, RESULTS, build_model_dir, dump

ROOT = Path(__file__).resolve().parents[2]


def cuda_tests(timeout: int, workers: int) -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kv_packed_cuda.py"]
    try:
        import xdist  # noqa: F401
        cmd += ["-n", str(workers)]
    except ImportError:
        pass
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "platform"), str(ROOT),
                                                        os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        text, rc = proc.communicate(timeout=timeout)[0], proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the workers too
        text, rc = proc.communicate()[0] + f"\n[timed out after {timeout} s]", "timeout"
    RESULTS["cuda_tests"] = {"cmd": " ".join(cmd), "rc": rc, "seconds": time.perf_counter() - t0,
                             "tail": text[-8000:]}
    print(text[-3000:], flush=True)
    dump()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "packed_kv.json"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--test-timeout", type=int, default=240)
    p.add_argument("--workers", type=int, default=8)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(f"{__file__}: needs a CUDA device; nothing measured on this machine")
        return
    OUT_PATH[0] = args.out
    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["torch"] = torch.__version__
    t0 = time.perf_counter()
    if not args.skip_tests:
        cuda_tests(args.test_timeout, args.workers)
    from bench_gpu import ceilings
    from gpu_bench_kv import attention_us, kv_rows
    ceilings()
    d = build_model_dir()
    kv_rows(d, args.reps)
    attention_us()
    RESULTS["total_s"] = time.perf_counter() - t0
    dump()
    print(json.dumps({k: v for k, v in RESULTS.items() if k not in ("kv", "cuda_tests")}, default=str)[:3000])
    print(f"cuda tests: rc={RESULTS.get('cuda_tests', {}).get('rc')}")
    print(f"{'row':28s} {'tok/s b64':>10s} {'x bf16':>7s} {'KV B/step':>10s} {'KV x bf16':>9s} {'of roof':>7s} "
          f"{'max B':>6s} {'tok/s maxB':>10s} {'x bf16':>7s}")
    for label, r in RESULTS.get("kv", {}).get("summary", {}).items():
        row = RESULTS["kv"][label]

        def f(v, fmt):
            return format(v, fmt) if isinstance(v, (int, float)) else "-"
        print(f"{label:28s} {f(r['tok_s_b64'], '10.0f')} {f(r['over_bf16_b64'], '7.3f')} "
              f"{f(row.get('kv_bytes_per_step_b64'), '10.3g')} {f(r['kv_bytes_per_step_over_bf16'], '9.3f')} "
              f"{f(r['of_roof_with_kv_b64'], '7.3f')} {f(r['max_batch_in_budget'], '6d')} "
              f"{f(r['tok_s_max_batch'], '10.0f')} {f(r['over_bf16_b64_at_max_batch'], '7.3f')}")
    print(f"total {RESULTS['total_s']:.0f} s; JSON in {args.out}")


if __name__ == "__main__":
    main()
