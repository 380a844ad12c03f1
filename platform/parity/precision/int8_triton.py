"""W8A8 INT8 matrix product with the rescale fused in, as one Triton kernel, and the per-token INT8 quantization
of the activations as another (CUDA; QuantLinear's `int8_triton` path).

    y[m, n] = bf16( float32(sum_k xq[m, k] * wq[n, k]) * xs[m] * ws[n] )

xq int8 [M, K] (per-token codes), wq int8 [N, K] (per-channel codes), xs float32 [M, 1], ws float32 [N, 1].
The int32 accumulator is exact on every path and the epilogue multiplies in the same order as the torch path
(`acc.float() * xs * ws.t()`, then one round-to-nearest-even cast), so the output is bit-identical to
`torch._int_mm` followed by the eager rescale; `usable()` checks exactly that on the device before the path is
chosen. The same kernel serves integer codes of other widths (W4A4: QuantLinear's `int_codes_triton`), and
`w8a8_bmm` runs a batch of such products in one launch (a cohort's runs, each with its own weight).

Why: at decode batch 64 the projections are latency-bound. cuBLASLt's int8 GEMM plus a separate rescale kernel
took longer per projection than the bf16 GEMM, so INT8 decode ran slower than BF16 although it reads half the
weight bytes (docs/PERFORMANCE.md, "INT8 W8A8 decode at batch 64"). One launch that streams the int8 weights
once, tiled so that every SM has a slice of N, and writes bf16 directly removes the extra kernel and the int32
round trip through memory. In the eager prefill (thousands of rows) the same two things cost more: torch's
quantization makes seven passes over a float32 copy of the activations and the rescale four over the int32
product; here the quantization is one pass (`quant_rows`: IEEE divisions and round-half-even, the codes and
scales of quantize_int8_rowwise exactly) and the rescale none.

Registered as a torch custom op (`parity::w8a8_mm`, through torch.library.triton_op) so that the decode layers
compiled with Inductor call it inside their graph. Importable without Triton: `usable()` is False then.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

from parity.precision.formats import INT8_QMAX, quantize_int8_rowwise
from parity.precision.int8_gemm import int8_gemm

try:  # Triton kernels resolve names from module globals: import here
    import triton
    import triton.language as tl
except ImportError:  # CPU installs
    triton = None
if not hasattr(torch.library, "triton_op"):  # torch < 2.6: no way to call the kernels inside a compiled graph
    triton = None

# torch on CUDA divides by a Python scalar as a product with the float32 reciprocal: float32(1) / float32(127)
_INV_QMAX = float(torch.tensor(1.0, dtype=torch.float32) / INT8_QMAX)
# why usable() said no (None while it has not, or said yes), for reports
unusable_reason: str | None = None


# The W8A8 kernel's tiles, (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps).
# Decode (few rows, many columns): tiles narrow in N so that a 1024-column product still spreads over 32-64
# SMs, and deep in K so that a K-loop of 1-12 steps keeps the slice's loads in flight at once (the best such
# tile beats cuBLAS's bf16 product with the weights coming from memory: docs/PERFORMANCE.md's tile table).
# Split-K tiles, which add int32 partial sums with atomics, were slower there (same page) and are not kept.
# Prefill (M in the thousands): the usual square tensor-core tiles.
TILES = [(64, 16, 256, 4, 4), (64, 32, 256, 4, 4), (64, 64, 256, 4, 4), (32, 32, 256, 4, 4), (16, 32, 256, 4, 4),
         (64, 16, 512, 3, 4), (64, 32, 512, 3, 4), (64, 64, 512, 2, 4), (64, 16, 1024, 2, 4), (64, 32, 1024, 1, 4),
         (64, 16, 256, 4, 8), (64, 32, 256, 4, 8), (64, 64, 128, 4, 4),
         (128, 128, 128, 4, 8), (128, 256, 128, 3, 8), (256, 128, 128, 3, 8), (128, 128, 64, 5, 4)]


def candidates(m_key: int, k: int) -> list[tuple[int, int, int, int, int]]:
    """The tiles tried for a product of `m_key` rows (its autotune key) and depth `k`: decode-sized products the
    narrow tiles only, prefill-sized ones the wide tiles only; no tile deeper than K rounded up to a power of two."""
    small = m_key <= 256
    depth = 1 << max(int(k) - 1, 0).bit_length()
    keep = [t for t in TILES if (t[0] <= 64 and t[1] <= 128) == small and t[2] <= max(depth, 64)]
    return keep or list(TILES)


if triton is not None:
    @triton.jit
    def _w8a8_tile(x_ptr, w_ptr, xs_ptr, ws_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, pid_m, pid_n,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        xp = x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
        wp = w_ptr + rn.to(tl.int64)[None, :] * stride_wn + rk[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + rk) < K
            a = tl.load(xp, mask=m_ok[:, None] & k_ok[None, :], other=0)
            b = tl.load(wp, mask=k_ok[:, None] & n_ok[None, :], other=0)
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
            xp += BLOCK_K
            wp += BLOCK_K
        xs = tl.load(xs_ptr + rm, mask=m_ok, other=0.0)
        ws = tl.load(ws_ptr + rn, mask=n_ok, other=0.0)
        y = acc.to(tl.float32) * xs[:, None]
        y = y * ws[None, :]
        yp = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
        tl.store(yp, y.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _w8a8_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, M_KEY,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        _w8a8_tile(x_ptr, w_ptr, xs_ptr, ws_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   tl.program_id(1), tl.program_id(0), BLOCK_M, BLOCK_N, BLOCK_K)

    @triton.jit
    def _w8a8_bmm_kernel(x_ptr, w_ptr, xs_ptr, ws_ptr, y_ptr, M, N, K, stride_xb, stride_xm, stride_wb, stride_wn,
                         stride_yb, stride_ym, M_KEY, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
        """One product of a batch (grid axis 2): the runs of a cohort, each its own codes, scales and weight."""
        b = tl.program_id(2).to(tl.int64)
        _w8a8_tile(x_ptr + b * stride_xb, w_ptr + b * stride_wb, xs_ptr + b * M, ws_ptr + b * N,
                   y_ptr + b * stride_yb, M, N, K, stride_xm, stride_wn, stride_ym,
                   tl.program_id(1), tl.program_id(0), BLOCK_M, BLOCK_N, BLOCK_K)

    @triton.jit
    def _quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, inv_qmax, BLOCK: tl.constexpr):
        """One row: scale = max|x| * fp32(1/127) (1 for an all-zero row), q = round_half_even(x / scale) clamped
        to [-127, 127], x / scale an IEEE division (div_rn): the codes and scales torch's quantize_int8_rowwise
        gives on CUDA (where `tensor / 127` is a product with the float32 reciprocal)."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        ok = offs < K
        x = tl.load(x_ptr + row * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 0)
        scale = tl.where(amax > 0, amax * inv_qmax, 1.0)
        y = tl.math.div_rn(x, scale)
        # round half to even, as torch.round, in exact steps (|y| <= 127): floor, then up past .5 or at a tie to even
        f = tl.floor(y)
        d = y - f
        y = tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, f + (f - 2.0 * tl.floor(f * 0.5))))
        q = tl.minimum(tl.maximum(y, -127.0), 127.0).to(tl.int8)
        tl.store(q_ptr + row * stride_qm + offs, q, mask=ok)
        tl.store(s_ptr + row, scale)

    _CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_stages=stages, num_warps=warps)
                for bm, bn, bk, stages, warps in TILES]

    def _prune(configs, named_args, **kwargs):
        """The autotuner's candidates for a product: those of `candidates` (M_KEY, K)."""
        keep = set(candidates(named_args["M_KEY"], named_args["K"]))
        return [c for c in configs if _tile(c) in keep] or configs

    _w8a8_tuned = triton.autotune(configs=_CONFIGS, key=["M_KEY", "N", "K"],
                                  prune_configs_by={"early_config_prune": _prune})(_w8a8_kernel)

    @torch.library.triton_op("parity::w8a8_mm", mutates_args=())
    def w8a8_mm(xq: torch.Tensor, wq: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
        """bf16/fp16/fp32 y [M, N] = (xq @ wq^T) * xs * ws^T, see the module docstring (CUDA tensors)."""
        M, K = xq.shape
        N = wq.shape[0]
        y = torch.empty(M, N, dtype=out_dtype, device=xq.device)
        if M == 0:
            return y

        args = (xq, wq, xs, ws, y, M, N, K, xq.stride(0), wq.stride(0), y.stride(0), _m_key(M))
        # a pinned configuration is launched alone (a compiled graph runs exactly it); shapes traced as symbols
        # (a prefill compiled for varying lengths) are never decode-pinned
        cfg = _PINNED.get((M, N, K)) if all(type(v) is int for v in (M, N, K)) else None
        if cfg is not None:
            kw = cfg.kwargs
            grid = (triton.cdiv(N, kw["BLOCK_N"]), triton.cdiv(M, kw["BLOCK_M"]))
            torch.library.wrap_triton(_w8a8_kernel)[grid](*args, **kw, num_warps=cfg.num_warps,
                                                          num_stages=cfg.num_stages)
            return y

        def grid(meta):
            return (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(M, meta["BLOCK_M"]))

        torch.library.wrap_triton(_w8a8_tuned)[grid](*args)
        return y

    _w8a8_bmm_tuned = triton.autotune(configs=_CONFIGS, key=["M_KEY", "N", "K"],
                                      prune_configs_by={"early_config_prune": _prune})(_w8a8_bmm_kernel)

    @torch.library.triton_op("parity::w8a8_bmm", mutates_args=())
    def w8a8_bmm(xq: torch.Tensor, wq: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
        """y [B, M, N] = (xq[b] @ wq[b]^T) * xs[b] * ws[b]^T for each b: w8a8_mm over a batch in one launch (a
        cohort's runs, parity.rollout.cohort), each product the same bits as w8a8_mm's. xq [B, M, K], wq [B, N, K]
        int8, xs [B, M, 1], ws [B, N, 1] float32 (CUDA tensors). A tile pinned for (M, N, K) by tune_decode is
        launched alone, as in w8a8_mm."""
        B, M, K = xq.shape
        N = wq.shape[1]
        xq, wq, xs, ws = xq.contiguous(), wq.contiguous(), xs.contiguous(), ws.contiguous()
        y = torch.empty(B, M, N, dtype=out_dtype, device=xq.device)
        if M == 0 or B == 0:
            return y
        args = (xq, wq, xs, ws, y, M, N, K, xq.stride(0), xq.stride(1), wq.stride(0), wq.stride(1), y.stride(0),
                y.stride(1), _m_key(M))
        cfg = _PINNED.get((M, N, K)) if all(type(v) is int for v in (M, N, K)) else None
        if cfg is not None:
            kw = cfg.kwargs
            grid = (triton.cdiv(N, kw["BLOCK_N"]), triton.cdiv(M, kw["BLOCK_M"]), B)
            torch.library.wrap_triton(_w8a8_bmm_kernel)[grid](*args, **kw, num_warps=cfg.num_warps,
                                                              num_stages=cfg.num_stages)
            return y

        def grid(meta):
            return (triton.cdiv(N, meta["BLOCK_N"]), triton.cdiv(M, meta["BLOCK_M"]), B)

        torch.library.wrap_triton(_w8a8_bmm_tuned)[grid](*args)
        return y

    @torch.library.triton_op("parity::int8_quant_rows", mutates_args=())
    def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 codes [M, K], float32 scales [M, 1]) of x [M, K] (CUDA), equal to quantize_int8_rowwise's."""
        M, K = x.shape
        q = torch.empty(M, K, dtype=torch.int8, device=x.device)
        s = torch.empty(M, 1, dtype=torch.float32, device=x.device)
        if M:
            block = triton.next_power_of_2(K)
            torch.library.wrap_triton(_quant_kernel)[(M,)](x, q, s, K, x.stride(0), q.stride(0), _INV_QMAX, BLOCK=block,
                                                           num_warps=4 if block <= 4096 else 8)
        return q, s


# (M, N, K) of a decode-sized product -> the tile configuration tune_decode picked for it; w8a8_mm launches that
# configuration alone, so a compiled graph runs exactly it. Left to itself a compiled graph benchmarks the
# candidates its own way when it is first built, and its picks varied from run to run, and with them the decode
# step's time; pinned by tune_decode, the step is the same in every run (docs/PERFORMANCE.md, the pinned-tile series).
_PINNED: dict = {}
# (M, N, K) -> where its pinned tile came from: "table" (TILES_FILE, checked once) or "timed" (tune_decode's timing)
PIN_SOURCE: dict = {}
# The tiles tune_decode picked on a device, by the device's name (tests/bench/gpu_pin_int8_tiles.py writes it):
# a decode state takes its tile from here, checked once against the torch path, instead of compiling and timing
# every candidate in every process at its start (10-18 s a process while sixteen processes start at once).
# PARITY_INT8_TILES=timed times every shape as before.
TILES_FILE = Path(__file__).with_name("int8_tiles.json")


@functools.cache
def _table(device_name: str) -> dict:
    """{(M, N, K): config} of TILES_FILE for this device name ({} without an entry, or with PARITY_INT8_TILES=timed).
    A malformed file is an error naming it and the bad entry."""
    if os.environ.get("PARITY_INT8_TILES", "table") == "timed" or not TILES_FILE.exists():
        return {}
    entry = json.loads(TILES_FILE.read_text()).get("devices", {}).get(device_name)
    if entry is None:
        return {}
    out = {}
    for key, tile in entry.get("tiles", {}).items():
        try:
            m, n, k = (int(v) for v in key.split(","))
            bm, bn, bk, stages, warps = (int(v) for v in tile)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{TILES_FILE}: device {device_name!r}, tile {key!r}: {tile!r} is not "
                             "'M,N,K': [BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps]") from e
        out[(m, n, k)] = (bm, bn, bk, stages, warps)
    return out


def _tile(c) -> tuple[int, int, int, int, int]:
    kw = c.kwargs
    return (kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], c.num_stages, c.num_warps)


def _from_table(m: int, n: int, k: int, device: torch.device):
    """The table's tile for (m, n, k) on this device when it is one of the candidates and gives the torch path's
    bits on random codes (one launch); else None (tune_decode times the candidates)."""
    want = _table(torch.cuda.get_device_name(device)).get((m, n, k))
    c = next((c for c in _prune(_CONFIGS, {"M_KEY": m, "K": k}) if _tile(c) == want), None) if want else None
    if c is None:
        return None
    g = torch.Generator(device=device).manual_seed(1)
    xq = torch.randint(-127, 128, (m, k), generator=g, device=device, dtype=torch.int8)
    wq = torch.randint(-127, 128, (n, k), generator=g, device=device, dtype=torch.int8)
    xs = torch.rand(m, 1, generator=g, device=device) * 1e-2
    ws = torch.rand(n, 1, generator=g, device=device) * 1e-2
    y = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    try:
        _launch_tile(c, xq, wq, xs, ws, y)
    except Exception:  # noqa: BLE001 - a tile that does not compile or launch here: timed like any other shape
        return None
    return c if torch.equal(y, _reference(xq, wq, xs, ws, torch.bfloat16)) else None


def _launch_tile(c, xq: torch.Tensor, wq: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor, y: torch.Tensor) -> None:
    """One launch of the W8A8 kernel with configuration `c`: y [M, N] = (xq [M, K] . wq [N, K]^T) xs ws."""
    (m, k), n = xq.shape, wq.shape[0]
    grid = (triton.cdiv(n, c.kwargs["BLOCK_N"]), triton.cdiv(m, c.kwargs["BLOCK_M"]))
    _w8a8_kernel[grid](xq, wq, xs, ws, y, m, n, k, k, k, n, m, **c.kwargs, num_warps=c.num_warps,
                       num_stages=c.num_stages)


def tune_decode(m: int, shapes, device: torch.device) -> dict:
    """Pick and pin the tile configuration of each M-row product with weights [N, K] in `shapes` (decode sizes,
    M <= 256): the device's tile in TILES_FILE where it has one (checked once), otherwise timed as a decode step
    runs it: every candidate (bit-identical to the torch path first) in a CUDA graph of back-to-back launches
    cycling through weight copies twice the size of the L2 cache, so the weights come from memory. (Triton's
    autotuner, one launch at a time after an L2 flush, picked slower tiles: docs/PERFORMANCE.md, the pinned-tile
    series.) Returns {(M, N, K): config} for reports (PIN_SOURCE says which way each came); nothing when the
    kernels are not usable."""
    shapes = set(shapes)
    # no integer product (a bf16 or FP8 engine): nothing to tune, and no kernel check to pay for
    if not shapes or m > 256 or device.type != "cuda" or not usable(device.index or 0):
        return {}
    g = torch.Generator(device=device).manual_seed(0)
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    for n, k in sorted(shapes):
        if (m, n, k) in _PINNED:
            continue
        c = _from_table(m, n, k, device)
        if c is not None:
            _PINNED[(m, n, k)], PIN_SOURCE[(m, n, k)] = c, "table"
            continue
        xq = torch.randint(-127, 128, (m, k), generator=g, device=device, dtype=torch.int8)
        ws = torch.rand(n, 1, generator=g, device=device) * 1e-2
        xs = torch.rand(m, 1, generator=g, device=device) * 1e-2
        wqs = [torch.randint(-127, 128, (n, k), generator=g, device=device, dtype=torch.int8)
               for _ in range(max(4, -(-2 * l2 // (n * k))))]
        ref = _reference(xq, wqs[0], xs, ws, torch.bfloat16)
        y = torch.empty(m, n, dtype=torch.bfloat16, device=device)
        best = None
        for c in _prune(_CONFIGS, {"M_KEY": m, "K": k}):
            us = _cold_graph_us(c, xq, wqs, xs, ws, y, ref)
            if us is not None and (best is None or us < best[0]):
                best = (us, c)
        if best is not None:
            _PINNED[(m, n, k)], PIN_SOURCE[(m, n, k)] = best[1], "timed"
        del wqs
    return {key: v for key, v in _PINNED.items() if key[0] == m and key[1:] in shapes}


def _cold_graph_us(c, xq: torch.Tensor, wqs: list, xs: torch.Tensor, ws: torch.Tensor, y: torch.Tensor,
                   ref: torch.Tensor, reps: int = 3) -> float | None:
    """Microseconds per product of configuration `c`, launched back to back over the weight copies `wqs` in one
    CUDA graph (median of `reps` replays); None when it does not compile, launch, or equal `ref`."""
    try:
        _launch_tile(c, xq, wqs[0], xs, ws, y)
        if not torch.equal(y, ref):
            return None
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for wq in wqs:
                _launch_tile(c, xq, wq, xs, ws, y)
    except Exception:  # noqa: BLE001 - a candidate that fails to compile or launch is not chosen
        return None
    times = []
    for _ in range(reps + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(wqs))
    return sorted(times[1:])[reps // 2]


def _m_key(m: int) -> int:
    """The autotuner's row key: exact for decode sizes, the next power of two above (prefill lengths vary from
    call to call; one tuning per bucket, not per length)."""
    return m if m <= 256 else min(1 << (m - 1).bit_length(), 1 << 16)


def _reference(xq: torch.Tensor, wq: torch.Tensor, xs: torch.Tensor, ws: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """The torch path the kernel must equal bit for bit: QuantLinear's exact int32 accumulator (cuBLASLt on CUDA),
    then the eager rescale."""
    acc = int8_gemm(xq, wq, "int8_mm_cuda" if xq.is_cuda else "int8_simulated")
    return (acc.float() * xs * ws.t()).to(out_dtype)


def chosen_configs() -> dict:
    """The autotuner's choice per (M bucket, N, K) so far in eager calls (Inductor tunes its own copy inside a
    compiled graph) and the pinned decode configurations, for benchmark reports."""
    if triton is None:
        return {}
    return {**{str(k[:3]): str(v) for k, v in _w8a8_tuned.cache.items()},
            **{f"pinned {k}": f"{v} ({PIN_SOURCE.get(k, 'pinned')})" for k, v in _PINNED.items()}}


@functools.cache
def usable(device_index: int = 0) -> bool:
    """True when Triton is installed, the device is a CUDA GPU with int8 tensor cores (sm_80+), PARITY_INT8_TRITON
    is not 0, and the kernels (product, batched product, quantization) equal the torch path bit for bit on random
    products and activations; otherwise False with the reason in `unusable_reason`."""
    global unusable_reason
    if triton is None or not torch.cuda.is_available() or os.environ.get("PARITY_INT8_TRITON", "1") == "0":
        unusable_reason = "no Triton, no CUDA, or PARITY_INT8_TRITON=0"
        return False
    dev = torch.device("cuda", device_index)
    if torch.cuda.get_device_capability(dev) < (8, 0):
        unusable_reason = "needs sm_80 or newer"
        return False
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = ((64, 96, 320), (5, 64, 64), (33, 80, 1040))
    # one tile a shape, the first the autotuner would try, pinned for the check: every tile sums the same exact int32
    # products and rescales them alike, so one shows the bits; the autotuner here compiled and timed every candidate
    # of both kernels for every shape (tens of seconds at a process's start, before its engine could be built), and
    # each candidate tune_decode keeps is checked against the torch path again
    probe = {s: _prune(_CONFIGS, {"M_KEY": s[0], "K": s[2]})[0] for s in shapes if s not in _PINNED}
    _PINNED.update(probe)
    try:
        for m, n, k in shapes:
            xq = torch.randint(-127, 128, (m, k), generator=g, device=dev, dtype=torch.int8)
            wq = torch.randint(-127, 128, (n, k), generator=g, device=dev, dtype=torch.int8)
            xs = torch.rand(m, 1, generator=g, device=dev) * 1e-2
            ws = torch.rand(n, 1, generator=g, device=dev) * 1e-2
            if not torch.equal(w8a8_mm(xq, wq, xs, ws, torch.bfloat16), _reference(xq, wq, xs, ws, torch.bfloat16)):
                unusable_reason = f"product differs from torch._int_mm + rescale at {(m, n, k)}"
                return False
            # the batched product: each of its products the single one's bits (another run's codes and scales)
            xb, wb = torch.stack([xq, xq.flip(0)]), torch.stack([wq, wq.flip(1)])
            xsb, wsb = torch.stack([xs, xs.flip(0) * 3]), torch.stack([ws, ws.flip(0) * 5])
            want = torch.stack([_reference(xb[i], wb[i], xsb[i], wsb[i], torch.bfloat16) for i in range(2)])
            if not torch.equal(w8a8_bmm(xb, wb, xsb, wsb, torch.bfloat16), want):
                unusable_reason = f"batched product differs from torch._int_mm + rescale at {(2, m, n, k)}"
                return False
            x = torch.randn(m, k, generator=g, device=dev).to(torch.bfloat16)
            x[0] = 0  # an all-zero row: scale 1
            (q, s), (rq, rs) = quant_rows(x), quantize_int8_rowwise(x)
            if not (torch.equal(q, rq) and torch.equal(s, rs)):
                unusable_reason = (f"quantization differs from quantize_int8_rowwise at {(m, k)}: "
                                   f"{int((q != rq).sum())} codes, {int((s != rs).sum())} scales")
                return False
    except Exception as e:  # noqa: BLE001 - any compile or launch failure: the cuBLASLt path serves instead
        unusable_reason = f"{type(e).__name__}: {e}"[:400]
        return False
    finally:
        for key in probe:
            _PINNED.pop(key, None)
    unusable_reason = None
    return True
