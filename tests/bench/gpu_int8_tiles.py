"""Which W8A8 decode product design is fastest at M = 64 on the device, with the weights streamed from HBM as in
a real decode step (not served from L2): a device-machine experiment, one call.

    python3 tests/bench/gpu_int8_tiles.py --out $OUT/tiles.json

Every variant is checked bit-identical to torch._int_mm + rescale on its first weight set, then timed as a CUDA
graph cycling through enough weight sets that they cannot stay in the 50 MB L2 (>= 200 MB a cycle), median of
5 replays (gpu_bench_common.graph_us). Variants per shape (qkv 4096x1024, o 1024x2048, gate_up 6144x1024, down 1024x3072):
  bf16        cuBLAS through F.linear (the BF16 engine's product)
  tuned       parity::w8a8_mm as the engine calls it (Triton autotuner's pick)
  A...        int8_triton._w8a8_kernel, tokens on the MMA's M side, at each tile configuration
  T...        weights on the MMA's M side (tile [BLOCK_N weights x 64 tokens])
  S...        split-K in two launches: int32 partial sums per K slice, then one pass that adds them and rescales
Last, the four products of 28 layers in decode order with each shape's fastest int8 variant against bf16.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, "platform")
from gpu_bench_common import cold_sets, graph_us  # noqa: E402  (this script's folder is on the path when run as a script)

from parity.precision import int8_triton as it  # noqa: E402

M = 64
SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}


@triton.jit
def _w8a8_t_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    m_ok = rm < M
    wp = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    xp = x_ptr + rm.to(tl.int64)[None, :] * stride_xm + rk[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        w = tl.load(wp, mask=n_ok[:, None] & k_ok[None, :], other=0)
        x = tl.load(xp, mask=k_ok[:, None] & m_ok[None, :], other=0)
        acc = tl.dot(w, x, acc, out_dtype=tl.int32)
        wp += BLOCK_K
        xp += BLOCK_K
    xs = tl.load(xs_ptr + rm, mask=m_ok, other=0.0)
    ws = tl.load(ws_ptr + rn, mask=n_ok, other=0.0)
    y = acc.to(tl.float32) * xs[None, :]
    y = y * ws[:, None]
    yp = y_ptr + rm.to(tl.int64)[None, :] * stride_ym + rn[:, None]
    tl.store(yp, y.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _splitk_partial_kernel(x_ptr, w_ptr, p_ptr, M, N, K, K_SLICE, stride_xm, stride_wn,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    s = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    k_lo = s * K_SLICE
    xp = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + (k_lo + rk)[None, :]
    wp = w_ptr + rn.to(tl.int64)[None, :] * stride_wn + (k_lo + rk)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K_SLICE, BLOCK_K):
        k_ok = (k_lo + k0 + rk) < K
        a = tl.load(xp, mask=m_ok[:, None] & k_ok[None, :], other=0)
        b = tl.load(wp, mask=k_ok[:, None] & n_ok[None, :], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        xp += BLOCK_K
        wp += BLOCK_K
    pp = p_ptr + (s * M + rm.to(tl.int64))[:, None] * N + rn[None, :]
    tl.store(pp, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _splitk_reduce_kernel(p_ptr, xs_ptr, ws_ptr, y_ptr, M, N, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.load(p_ptr + offs, mask=ok, other=0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(p_ptr + s * M * N + offs, mask=ok, other=0)
    m = offs // N
    n = offs % N
    y = acc.to(tl.float32) * tl.load(xs_ptr + m, mask=ok, other=0.0)
    y = y * tl.load(ws_ptr + n, mask=ok, other=0.0)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=ok)


def variants(n: int, k: int, xq, xs, y):
    """(label, launch(wq, ws)) for every int8 design and tile configuration at this shape."""
    out = []
    for bn, bk, w, st in itertools.product((16, 32, 64, 128), (128, 256, 512), (4, 8), (2, 3, 4)):
        if bk > k or n // bn < 8:
            continue

        def a(wq, ws, bn=bn, bk=bk, w=w, st=st):
            it._w8a8_kernel[(triton.cdiv(n, bn), 1)](xq, wq, xs, ws, y, M, n, k, k, k, n, M, BLOCK_M=64,
                                                     BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
        out.append((f"A_n{bn}k{bk}w{w}s{st}", a))
    for bn, bk, w, st in itertools.product((16, 32, 64, 128), (128, 256, 512), (4, 8), (2, 3, 4)):
        if bk > k or n // bn < 8:
            continue

        def t(wq, ws, bn=bn, bk=bk, w=w, st=st):
            _w8a8_t_kernel[(triton.cdiv(n, bn), 1)](xq, wq, xs, ws, y, M, n, k, k, k, n, BLOCK_N=bn, BLOCK_M=64,
                                                    BLOCK_K=bk, num_warps=w, num_stages=st)
        out.append((f"T_n{bn}k{bk}w{w}s{st}", t))
    for bn, splits, bk in itertools.product((16, 32, 64), (2, 4, 8), (128, 256)):
        ks = k // splits
        if ks % bk or ks < bk:
            continue
        part = torch.empty(splits, M, n, dtype=torch.int32, device="cuda")

        def s(wq, ws, bn=bn, splits=splits, bk=bk, ks=ks, part=part):
            _splitk_partial_kernel[(triton.cdiv(n, bn), splits)](xq, wq, part, M, n, k, ks, k, k, BLOCK_M=64,
                                                                 BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=3)
            _splitk_reduce_kernel[(triton.cdiv(M * n, 1024),)](part, xs, ws, y, M, n, SPLITS=splits, BLOCK=1024)
        out.append((f"S_n{bn}x{splits}k{bk}", s))
    return out


def sweep(n: int, k: int) -> tuple[dict, dict]:
    x = torch.randn(M, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = it.quant_rows(x)
    sets = cold_sets(n * k)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(sets)]
    qs = [it.quantize_int8_rowwise(w) for w in ws]
    ref = it._reference(xq, qs[0][0], xs, qs[0][1], torch.bfloat16)
    row = {"bf16": graph_us([(lambda w=w: torch.nn.functional.linear(x, w)) for w in ws]),
           "tuned": graph_us([(lambda q=q: it.w8a8_mm(xq, q[0], xs, q[1], torch.bfloat16)) for q in qs])}
    del ws
    y = torch.empty(M, n, device="cuda", dtype=torch.bfloat16)
    fns = {}
    for label, fn in variants(n, k, xq, xs, y):
        try:
            y.fill_(float("nan"))
            fn(*qs[0])
            torch.cuda.synchronize()
            if not torch.equal(y, ref):
                row[label] = "MISMATCH"
                continue
            row[label] = graph_us([(lambda q=q, fn=fn: fn(*q)) for q in qs])
            fns[label] = fn
        except Exception as e:  # noqa: BLE001 - one failing configuration must not hide the others
            row[label] = f"{type(e).__name__}: {e}"[:100]
    return row, {"x": x, "xq": xq, "xs": xs, "y": y, "fns": fns}


def layer_sequence(best: dict, keep: dict) -> dict:
    """The four products of 28 layers in decode order, fresh weights per layer: bf16 against each shape's
    fastest int8 variant, and against the tuned op."""
    res = {}
    layers = 28
    w16 = {s: [torch.randn(*SHAPES[s], device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
           for s in SHAPES}
    q8 = {s: [it.quantize_int8_rowwise(w) for w in w16[s]] for s in SHAPES}
    bf = []
    for i in range(layers):
        for s in SHAPES:
            bf.append(lambda w=w16[s][i], x=keep[s]["x"]: torch.nn.functional.linear(x, w))
    res["bf16_ms"] = graph_us(bf) * len(bf) / 1e3
    del w16
    for name, pick in (("best", lambda s: keep[s]["fns"][best[s]]),
                       ("tuned", lambda s: (lambda wq, ws, s=s: it.w8a8_mm(keep[s]["xq"], wq, keep[s]["xs"], ws,
                                                                         torch.bfloat16)))):
        calls = []
        for i in range(layers):
            for s in SHAPES:
                calls.append(lambda f=pick(s), q=q8[s][i]: f(*q))
        res[f"int8_{name}_ms"] = graph_us(calls) * len(calls) / 1e3
    res["int8_best_over_bf16_speed"] = res["bf16_ms"] / res["int8_best_ms"]
    res["int8_tuned_over_bf16_speed"] = res["bf16_ms"] / res["int8_tuned_ms"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tiles.json")
    args = ap.parse_args()
    assert it.usable(), it.unusable_reason
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    best, keep = {}, {}
    for s, (n, k) in SHAPES.items():
        row, keep[s] = sweep(n, k)
        timed = {lab: v for lab, v in row.items() if isinstance(v, float) and lab not in ("bf16", "tuned")}
        best[s] = min(timed, key=timed.get)
        top = sorted(timed, key=timed.get)[:6]
        for fam in "ATS":
            fam_t = {lab: v for lab, v in timed.items() if lab.startswith(fam + "_")}
            if fam_t:
                b = min(fam_t, key=fam_t.get)
                print(f"{s:8s} best {fam}: {b} {fam_t[b]} us", flush=True)
        print(f"{s:8s} {n}x{k}: bf16 {row['bf16']} us, tuned {row['tuned']} us, top {[(t, timed[t]) for t in top]}",
              flush=True)
        out[f"{s}_{n}x{k}"] = row
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    out["best"] = best
    out["layer_sequence"] = seq = layer_sequence(best, keep)
    print("layer sequence:", json.dumps(seq), flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
