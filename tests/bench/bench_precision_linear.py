"""QuantLinear forward time against a BF16 nn.Linear of the same shape, measured alternately in one run.

Prints one JSON line per shape: milliseconds per forward for bf16 and every quantized path available
on the device, and each path's ratio to bf16 (< 1 = faster). On CUDA the int8 path is torch._int_mm
(cuBLASLt) and fp8 is torch._scaled_mm with row-wise scales; on CPU _int_mm (oneDNN) and the CPU
_scaled_mm. The quantized forward includes the dynamic per-token activation quantization.
Run: `.venv/bin/python tests/bench/bench_precision_linear.py` (CPU: small shapes; CUDA: LLM shapes).
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn


def _timer(device: torch.device):
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()
    return sync


def bench(m: int, k: int, n: int, device: torch.device, reps: int, rounds: int) -> dict:
    from parity.precision.linear import QuantLinear

    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16).requires_grad_(False)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    layers: dict = {"bf16": lin, "fp32": copy.deepcopy(lin).float()}
    for w, a in (("int8", "int8"), ("fp8", "fp8"), ("int8", "bf16")):
        q = QuantLinear.from_linear(lin, w, a)
        layers[q.path] = q
    from parity.precision.int8_gemm import cpu_int_mm_exact

    if device.type == "cpu" and cpu_int_mm_exact():  # both exact int8 routes on CPU (torch._int_mm where it is exact)
        real = QuantLinear.from_linear(lin, "int8", "int8")
        real.path = "int8_mm_cpu"
        layers["int8_mm_cpu"] = real
    xs = {name: x.float() if name == "fp32" else x for name in layers}
    sync = _timer(device)
    times: dict[str, list[float]] = {name: [] for name in layers}
    with torch.no_grad():
        for name, layer in layers.items():  # warm-up (kernel selection, oneDNN primitive cache)
            layer(xs[name])
        for _ in range(rounds):  # alternate so foreign load hits every path alike
            for name, layer in layers.items():
                sync()
                t0 = time.perf_counter()
                for _ in range(reps):
                    layer(xs[name])
                sync()
                times[name].append((time.perf_counter() - t0) / reps * 1e3)
    ms = {name: statistics.median(v) for name, v in times.items()}
    return {"device": str(device), "m": m, "k": k, "n": n, "ms": {k_: round(v, 4) for k_, v in ms.items()},
            "ratio_vs_bf16": {k_: round(v / ms["bf16"], 3) for k_, v in ms.items() if k_ != "bf16"}}


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        shapes, reps, rounds = [(256, 4096, 4096), (4096, 4096, 4096), (4096, 4096, 12288), (32, 4096, 4096)], 50, 5
    else:
        shapes, reps, rounds = [(64, 192, 512), (512, 512, 512)], 20, 5
    for s in shapes:
        print(json.dumps(bench(*s, device=device, reps=reps, rounds=rounds)), flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "platform"))
    main()
