"""What reading the INT4 cache alone costs at the decode shape: the ceiling under the INT4 attention kernel's GB/s.

    PYTHONPATH=$PWD/platform:$PWD:$PWD/tests/bench PYTHONUNBUFFERED=1 python3 tests/bench/gpu_read_ceiling.py \\
        --out $OUT/read_ceiling.json

The INT4 attention's goal is 2 TB/s at L = 256 (batch 64 x 8 KV heads: 17.8 MB of codes and scale words a launch,
8.91 us). This times, the same way as tests/bench/gpu_int4_decode_variants.py (a CUDA graph of 56 launches cycling 28
layers' caches, 20 replays between CUDA events, the median), at L = 128 to 1024:
- `int4_attention`: the pinned rotated INT4 kernel (int4_attention.CONFIG);
- `read_same_layout_w{warps}_b{block}`: a Triton kernel that only reads what the attention reads, in the cache's own
  layout and grid (one program per row and KV head, the first L slots of K and V codes and of their scale words),
  folds it (xor) into one word a program and stores it: no query, no softmax, no products;
- `read_flat_b{block}`: the same number of bytes as one contiguous buffer, read by 8 programs an SM;
each fitted as a fixed time a launch plus a streaming rate (fixed_and_streaming). Every read kernel's stored words
are checked against the xor of the same words computed on the host first, so that a timing is of a kernel that read every
byte. Prints the attention's time at L = 256 over the best read's, and whether that read itself reaches 2 TB/s.
Needs torch and triton only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl
from gpu_bench_common import BATCH, SHAPE
from gpu_int4_decode_variants import event_us, fixed_and_streaming, timing_inputs

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
LENGTHS = (128, 192, 256, 384, 512, 768, 1024)
READS = ((1, 64), (2, 64), (4, 64), (4, 128), (8, 128))  # (num_warps, slots a loop step) of read_same_layout


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _read_rows(kc_ptr, vc_ptr, ks_ptr, vs_ptr, out_ptr, L, S, W: tl.constexpr, BLOCK: tl.constexpr):
    """One program per (row, KV head): the first L slots' code words (W int32 a slot) and scale words of K and V."""
    pid = tl.program_id(0).to(tl.int64)
    n0 = tl.arange(0, BLOCK)
    w = tl.arange(0, W)
    acc = tl.zeros([BLOCK, W], dtype=tl.int32)
    sacc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, L, BLOCK):
        n = start + n0
        ok = n < L
        at = (pid * S + n)[:, None] * W + w[None, :]
        acc ^= tl.load(kc_ptr + at, mask=ok[:, None], other=0) ^ tl.load(vc_ptr + at, mask=ok[:, None], other=0)
        sacc ^= tl.load(ks_ptr + pid * S + n, mask=ok, other=0) ^ tl.load(vs_ptr + pid * S + n, mask=ok, other=0)
    tl.store(out_ptr + pid, tl.reduce(tl.reduce(acc, 1, _xor) ^ sacc, 0, _xor))


@triton.jit
def _read_flat(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    """A grid-stride read of N int32 words, folded (xor) into one word a program."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(pid * BLOCK, N, step):
        i = start + tl.arange(0, BLOCK)
        acc ^= tl.load(x_ptr + i, mask=i < N, other=0)
    tl.store(out_ptr + pid, tl.reduce(acc, 0, _xor))


def words(t: torch.Tensor) -> torch.Tensor:
    """A cache tensor's bytes as int32 words (its last dimension a multiple of 4 bytes)."""
    return t.contiguous().view(torch.uint8).view(torch.int32)


def fold(x: torch.Tensor, dims: int) -> torch.Tensor:
    """The xor of int32 words over the last `dims` dimensions (on the host: numpy's bitwise_xor.reduce)."""
    a = x.cpu().numpy()
    for _ in range(dims):
        a = np.bitwise_xor.reduce(a, axis=-1)
    return torch.from_numpy(np.ascontiguousarray(a))


def same_layout_call(c, L: int, S: int, warps: int, block: int, out: torch.Tensor):
    kc, vc = words(c.k), words(c.v)
    ks, vs = words(c.k_scale.unsqueeze(-1)).squeeze(-1), words(c.v_scale.unsqueeze(-1)).squeeze(-1)
    W, rows = kc.shape[-1], kc.shape[0] * kc.shape[1]
    return lambda: _read_rows[(rows,)](kc, vc, ks, vs, out, L, S, W=W, BLOCK=block, num_warps=warps)


def check_same_layout(c, L: int, S: int, warps: int, block: int) -> None:
    out = torch.empty(c.k.shape[0] * c.k.shape[1], dtype=torch.int32, device=c.k.device)
    same_layout_call(c, L, S, warps, block, out)()
    every = torch.cat([words(t if t.dim() == 4 else t.unsqueeze(-1))[:, :, :L] for t in (c.k, c.v, c.k_scale, c.v_scale)],
                      dim=-1)
    if not torch.equal(out.cpu(), fold(every, 2).flatten()):
        raise AssertionError(f"read_same_layout w{warps} b{block} at L = {L}: the stored words differ from the host's xor")


def main() -> None:
    from parity.rollout import decode_attention as da
    from parity.rollout import int4_attention as ia
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "read_ceiling.json"))
    a = p.parse_args()
    B, n_kv, S = BATCH, SHAPE["num_key_value_heads"], max(LENGTHS)
    dev, q, qs, key_ok, scale, kv, int4, fp8 = timing_inputs(S, seed=3)
    del kv, fp8
    torch.cuda.empty_cache()
    slot_bytes = 2 * B * n_kv * int4.codec.bytes_per_token_head()
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                 "shape": {"batch": B, "kv_heads": n_kv, "head_dim": SHAPE["head_dim"], "layers": len(int4.layers)},
                 "bytes_at_L256": 256 * slot_bytes, "config": dict(ia.CONFIG),
                 "method": "CUDA graph of 56 launches cycling 28 layers' caches, 20 replays, median us a launch; "
                           "fit: fixed us + bytes / streaming rate", "kernels": {}}
    out = torch.empty(B * n_kv, dtype=torch.int32, device=dev)
    flat_out = torch.empty(8 * torch.cuda.get_device_properties(dev).multi_processor_count, dtype=torch.int32,
                           device=dev)
    for warps, block in READS:
        for L in (1, 77, 256, S):
            check_same_layout(int4.layers[0], L, S, warps, block)
    flat = {L: [torch.randint(-2**31, 2**31 - 1, (int(L * slot_bytes) // 4,), dtype=torch.int32, device=dev)
                for _ in int4.layers] for L in LENGTHS}
    for block in (1024, 4096):
        x = flat[256][0]
        _read_flat[(flat_out.numel(),)](x, flat_out, x.numel(), BLOCK=block, num_warps=4)
        if int(fold(flat_out, 1)) != int(fold(x, 1)):
            raise AssertionError(f"read_flat b{block}: the folded words differ from the host's xor")
    kernels = {
        "int4_attention": lambda c, L, st: (lambda: ia.int4_attention(
            qs, c.k, c.v, c.k_scale, c.v_scale, key_ok, st, L, scale, True, torch.bfloat16, da._workspace(int4), {})),
        **{f"read_same_layout_w{w}_b{b}": (lambda c, L, st, w=w, b=b: same_layout_call(c, L, S, w, b, out))
           for w, b in READS}}
    for name, make in kernels.items():
        us_at = {L: event_us([make(c, L, torch.tensor([L - 1], device=dev)) for c in int4.layers]) for L in LENGTHS}
        res["kernels"][name] = fixed_and_streaming(us_at, slot_bytes)
        print(f"{name:28s} {res['kernels'][name]}", flush=True)
    for block in (1024, 4096):
        us_at = {L: event_us([(lambda x=x, b=block: _read_flat[(flat_out.numel(),)](
            x, flat_out, x.numel(), BLOCK=b, num_warps=4)) for x in flat[L]]) for L in LENGTHS}
        res["kernels"][f"read_flat_b{block}"] = fixed_and_streaming(us_at, slot_bytes)
        print(f"{'read_flat_b' + str(block):28s} {res['kernels'][f'read_flat_b{block}']}", flush=True)
    reads = {k: v for k, v in res["kernels"].items() if k.startswith("read_same_layout")}
    best = min(reads, key=lambda k: reads[k]["us"]["256"])
    att, rd = res["kernels"]["int4_attention"]["us"]["256"], reads[best]["us"]["256"]
    res["summary"] = {
        "attention_us_L256": att, "attention_GBps_L256": round(256 * slot_bytes / att / 1e3, 1),
        "best_read": best, "read_us_L256": rd, "read_GBps_L256": round(256 * slot_bytes / rd / 1e3, 1),
        "attention_over_read": round(att / rd, 3), "read_reaches_2TBps_at_L256": rd <= 256 * slot_bytes / 2e6}
    print(json.dumps(res["summary"]), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
