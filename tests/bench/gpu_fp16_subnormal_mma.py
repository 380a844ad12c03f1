"""fp16 tensor-core products with subnormal operands against normal ones (the INT4 attention's V codes could enter
its products as subnormal fp16, 2^-24 x byte, instead of 1024 + byte; docs/PERFORMANCE.md, "The output rotation in
butterflies"). Two measures on the same shapes and values' counts: cuBLAS on 8192 x 8192 (throughput) and a chain of
4,096 dependent 16 x 64 x 32 Triton dots a program, 528 one-warp programs (latency, as in the attention's loop).

    python3 tests/bench/gpu_fp16_subnormal_mma.py [--out FILE]          (needs a CUDA device and triton)
"""

from __future__ import annotations

import argparse
import json

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs
    triton = None

if triton is not None:
    @triton.jit
    def _chain(a_ptr, b_ptr, o_ptr, N: tl.constexpr):
        r = tl.arange(0, 16)
        k = tl.arange(0, 64)
        c = tl.arange(0, 32)
        a = tl.load(a_ptr + r[:, None] * 64 + k[None, :])
        b = tl.load(b_ptr + k[:, None] * 32 + c[None, :])
        acc = tl.zeros([16, 32], tl.float32)
        for _ in range(N):
            acc = tl.dot(a, b, acc * 0.999)
        tl.store(o_ptr + tl.program_id(0) * 512 + r[:, None] * 32 + c[None, :], acc)


def median_us(fn, n: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(n):
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) * 1e3)
    return sorted(ts)[n // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if triton is None or not torch.cuda.is_available():
        print(f"{__file__}: needs a CUDA device; nothing launched on this machine")
        return
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.rand(8192, 8192, device="cuda", generator=g).half()
    codes = torch.randint(0, 256, (8192, 8192), device="cuda", generator=g, dtype=torch.int16)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__, "us": {}}
    for name, b in (("normal (1024 + byte)", (codes + 1024).half()), ("subnormal (2^-24 byte)", codes.view(torch.float16))):
        o = torch.empty(528 * 512, device="cuda")
        a16, b16 = x[:16, :64].contiguous(), b[:64, :32].contiguous()
        res["us"][name] = {"cublas_8192": round(median_us(lambda b=b: x @ b), 1),
                           "dependent_dot_chain": round(median_us(
                               lambda a16=a16, b16=b16, o=o: _chain[(528,)](a16, b16, o, N=4096, num_warps=1)), 1)}
        print(name, res["us"][name], flush=True)
    n, s = res["us"]["normal (1024 + byte)"], res["us"]["subnormal (2^-24 byte)"]
    res["subnormal_over_normal"] = {k: round(s[k] / n[k], 3) for k in n}
    print("subnormal / normal:", res["subnormal_over_normal"])
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
