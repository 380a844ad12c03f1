"""Decode attention over the packed int4 per-token-head cache in the rotated basis: no key or value is dequantized.

The cache (parity.precision.kv_packed) holds, per token and KV head, 4-bit codes n' of the rotated vector H (d x)
(H the D x D Sylvester-Hadamard matrix, d the +-1 diagonal; Hadamard off: of x itself) and one word with the
scale s and the zero point z. The codec's value of a key is k = d (H (n' - z)) s / D, so for a query q

    q . k = s / D * q~ . (n' - z),   q~ = H (d q)      (the query rotated once, not every key)
    sum_j p_j v_j = d (H u) / D,     u = sum_j p_j s_j (n'_j - z_j)

and the kernel never rotates a key or a value: it reads the codes and the scale words, folds scale and zero point
into the two products, and rotates its output once per (row, head). The values it attends over are the codec's
(those the simulated cache holds, before their rounding to the cache dtype); only the arithmetic of the sum
differs, as any attention kernel's does:

- q . n': q~ is quantized to 15-bit integers per head (two int8 parts, |error| <= 3e-5 of the head's largest
  element, against bf16's 2e-3 of each element), once per step (`prepare_queries`, or the fused pre-attention
  kernel), so the product is an exact integer tensor-core product with the int8 codes `c & 15` and
  `(c ^ 0x80) & 0xF0` = 16 (hi - 8), one bitwise operation per four codes; the head's sums fold the zero point.
- p s n': the weights p s (float32) are rounded to fp16 relative to the tile's largest scale, and the codes enter
  the fp16 tensor-core product as 1024 + byte and 1024 + low nibble, one byte permute (and a mask) per two codes
  straight from the loaded byte pairs; the 1024 offsets and the zero points come off through the weights' sums.
- the output rotation d (H u) / D: products with H_{D/2} (+-1) of u in two bf16 terms (16 bits), or in the
  warp-split and slot-groups forms (CONFIG's "fwht", "groups") float32 butterflies on u itself, the heads' rows only.
- float32 caches (tests, fp32 models) take the exact route instead: float32 codes and IEEE float32 products.

Measured against a float64 attention over the codec's values computed from the codes (under Triton's
interpreter, tests/test_int4_attention_interpret.py): bf16 queries and output 1.7e-3 (the bf16 rounding of the
output), float32 1e-6; the simulated cache's bf16 values are themselves 3e-3 - 4e-3 away from that attention.

Structure (flash decoding): a program takes one (row, KV head) and a split of the attended slots; K and V are read
once per KV head (grouped-query attention), and the 16 rows of the products are (slot sub-range, query head)
pairs so that none is padding when the KV head has 2 query heads (see the kernel's docstring). Splits
are added until the grid fills the GPU (`split_plan`); each split writes a partial (running max, sum, rotated
weighted sum) and the last split of a (row, head) to finish, found with an atomic counter, merges them, rotates
back and writes the output: one launch, no second kernel. The counters are reset by the merging program, so a
captured CUDA graph replays it. The warp-split form (CONFIG's "warp_slots"; parity.rollout.int4_attention_warps)
computes the same with each warp on its own slots and no exchange between warps inside the loop, and the slot-groups
form ("groups"; parity.rollout.int4_attention_groups) fills the products' rows with (slot group, head) pairs in one
warp; the pieces the forms share are in parity.rollout.int4_attention_parts.

Tests: tests/test_int4_attention_interpret.py (CPU, Triton's interpreter) and tests/test_kv_packed_cuda.py.
"""

from __future__ import annotations

import functools
import math

import torch

from parity.precision.kv import _hadamard, _rht_signs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs
    triton = None

# Launch configuration: rows of the K product per iteration (each row R = 16 / G slots, G query heads a KV head
# rounded up to a power of two: an iteration covers ROWS * R slots), warps, pipeline depth, programs to aim for per
# SM (splits are added while rows x KV heads x splits is below it), the byte unpacking through inline PTX (CUDA
# only), optionally a register cap ("maxnreg", more programs per SM), and two forms of the loop: "blocks" (column
# group r of an iteration takes the slots start + r * ROWS + [0, ROWS) instead of start + n * R + r, so that the
# softmax's sums over a row's slots stay inside one warp: 9 barriers an iteration instead of 20 in the sm_90a SASS)
# and "merge" (the query's two int8 parts side by side in one product's columns, which are padding otherwise: two
# int8 products an iteration instead of four), and "row_scale" (the V weights' fp16 rounding relative to each row's
# largest scale instead of the tile's: no maximum across warps, 6 barriers an iteration with "blocks" instead of 9,
# 4.5% more instructions), and "warp_slots" (0: this module's kernel; n: the warp-split form, n slots a warp an
# iteration, parity.rollout.int4_attention_warps). tests/bench/gpu_int4_decode_variants.py checks
# and times the candidates; `CONFIG` is what the decode path launches: the warp-split form, one warp a program with
# 64 slots an iteration and the query's parts merged, no split at batch 64 (the fastest of 19-21 variants at L = 256
# in all three runs on one H100, 2026-12-05 and 2026-12-06: 15.23-15.26 us, 1,168-1,170 GB/s, against 17.4 us for
# the blocks form rows16-warps4-stages2-pps1-blocks pinned before it; 20.0-20.2 us at 384 against 22.8; split in two
# 19.2 us; docs/perf_runs/*_packed_kv_int4_warp_split*.json), since then with "prefetch_ok" (the warp-split form loads
# the next iteration's key mask in this one: that load was a memory round trip every iteration, found with Nsight
# Compute) and three stages of loads in flight: 12.0 us against 15.0 at L = 256, 15.3 against 19.9 at 384 in one
# run (one H100, 2026-12-06, tests/bench/gpu_int4_attention_ncu.py --ab; docs/PERFORMANCE.md), and since then with
# "fwht" (the warp-split form rotates its output in float32 butterflies on the heads' rows only, instead of products
# with H_{D/2} over 16 padded rows: 604 instructions after the loop instead of 1,060, no H_{D/2} read): 10.83-10.86 us
# against 11.96-11.97 at L = 256, 14.17-14.23 against 15.40-15.43 at 384 (one H100, 2026-12-06, the same A/B;
# docs/perf_runs/2026-12-06_int4_attention_fwht_ab_h100.json), and since then with "groups" (the slot-groups form,
# parity.rollout.int4_attention_groups: 4 groups of 16 slots x 2 heads in the products' 16 rows, the softmax on real
# rows only, 967 loop instructions per 64 slots against 1,265; its rotation is the butterflies): 10.41 against 10.82
# us at L = 256 in one A/B, 10.54 us in the bench after (one H100, 2026-12-06;
# docs/perf_runs/2026-12-06_packed_kv_int4_slot_groups_h100.json). ROWS, blocks and row_scale apply to this module's
# kernel only (warp_slots 0), which the exact route keeps; prefetch_ok, fwht and groups to the warp-split forms only
# (groups where the query's parts merge and G <= 8, else the warp-split form). "group_v" (slot groups only): each
# group's V product on its own instead of one block-diagonal product, the same sums in the same order (the same
# output bits under the interpreter) with the weights left in the scores' layout: 892 loop instructions per 64 slots
# against 967, no shared-memory round trip in the loop (sm_90a SASS; at most 4 groups: 8 would spill at D = 128),
# and "l2_slots" (slot groups only; 0, or n a power of two >= 32: the first n slots' codes and scale words prefetched
# into L2 as the program starts, before the query's loads, whose wait the compiler places ahead of the first tiles'
# copies): 10.18 against 10.41 us at L = 256 with group_v, and 9.72-10.06 against 10.26-10.52 with the prefetch of
# one iteration's slots (more slots slower; a query load inside the loop, split tensor-core chains of the K product,
# an earlier load of the slot index: slower or the same) (one H100, 2026-12-06, tests/bench/gpu_int4_attention_ncu.py
# --ab; docs/perf_runs/2026-12-06_int4_attention_l2_prefetch_ab_h100.json). "quad_unpack": the V operands unpacked in
# one asm block (58 fewer loop instructions, the same output): 1% faster at 256, median of 12 rounds (a lazy rescale
# of the softmax's sums, 3-6% slower, was removed; ..._int4_attention_quad_unpack_ab_h100.json). The scores
# a tile ahead (beside the last tile's V products) were 21-38% slower, two splits 47% (..._k_ahead_ab_h100.json).
# "pdl" (off): launched as a programmatic dependent of the kernel ahead (int4_attention_groups): 5% faster launched
# back to back, no faster in the decode step after the fused pre-attention (..._int4_attention_pdl_ab_h100.json).
CONFIG = {"ROWS": 16, "num_warps": 1, "num_stages": 3, "programs_per_sm": 1, "asm": True, "blocks": True,
          "merge": True, "row_scale": False, "warp_slots": 64, "prefetch_ok": True, "fwht": True, "groups": True,
          "group_v": True, "l2_slots": 64, "quad_unpack": True, "pdl": False}
# this module's kernel in the form pinned before (rows16-warps4-stages2-pps1-blocks): what the exact route launches
# (with EXACT_ROWS), and the base the bench's and the tests' other variants of this kernel change
BLOCKS_FORM = {"ROWS": 16, "num_warps": 4, "num_stages": 2, "programs_per_sm": 1, "asm": True, "blocks": True,
               "merge": False, "row_scale": False, "warp_slots": 0, "prefetch_ok": False, "fwht": False,
               "groups": False, "group_v": False, "l2_slots": 0, "quad_unpack": False, "pdl": False}
# The exact route (float32 output) multiplies the codes by a block-diagonal float32 query, whose tiles grow with
# the column groups R = 16 / G: at G = 1, D = 128 they need 247,808 B of shared memory at ROWS 16 (2 stages) on
# sm_90, over the H200's 232,448 B, and 189,504 B at ROWS 8 (Triton's compile for sm_90a; checked for every G and
# D by tests/test_int4_attention_sm90.py). The exact route is the float32 check's, so it takes the smaller tile.
EXACT_ROWS = 8
_DEFAULT_SMS = 132


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_SMS


def slots_per_iteration(G: int, rows: int | None = None) -> int:
    """Slots one iteration of the kernel covers: rows x (16 / G rounded up to a power of two, at least 1)."""
    return (rows or CONFIG["ROWS"]) * max(1, 16 // triton_next_pow2(G))


def warp_form(cfg: dict, G: int, exact: bool = False) -> tuple[int, bool]:
    """(slots a warp an iteration, merged query parts) of the warp-split form (int4_attention_warps) under launch
    configuration `cfg`, or (0, False) for this module's kernel (the exact route always). The parts merge when
    `cfg` asks and G <= 8; unmerged, a warp takes at most 32 slots and no register cap applies (64 slots, or 32
    under 168 registers, spill at G = 16, D = 128 on sm_90a)."""
    if not cfg.get("warp_slots") or exact:
        return 0, False
    merge = bool(cfg.get("merge")) and 2 * triton_next_pow2(G) <= 16
    return (cfg["warp_slots"] if merge else min(cfg["warp_slots"], 32)), merge


def groups_form(cfg: dict, G: int, exact: bool = False) -> tuple[int, int]:
    """(groups, slots a group) of the slot-groups form (int4_attention_groups) under launch configuration `cfg`:
    with "groups" and the warp-split form's query parts merged (G <= 8), 8 / GP groups (GP: G rounded up to a power of
    two) of warp_slots / groups slots each, at least 16 (the products' smallest width); else (0, 0)."""
    if not cfg.get("groups") or not warp_form(cfg, G, exact)[1]:  # merged parts: G <= 8
        return 0, 0
    nq = 8 // triton_next_pow2(G)
    return nq, max(16, cfg["warp_slots"] // nq)


def iteration_slots(cfg: dict, G: int, exact: bool = False) -> int:
    """Slots one iteration of launch configuration `cfg` covers: the groups' slots in the slot-groups form,
    num_warps x a warp's slots in the warp-split form, else `slots_per_iteration`."""
    nq, sg = groups_form(cfg, G, exact)
    slots = warp_form(cfg, G, exact)[0]
    return nq * sg if nq else cfg["num_warps"] * slots if slots else slots_per_iteration(G, cfg["ROWS"])


def triton_next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def split_plan(B: int, n_kv: int, L: int, device: torch.device, tile: int,
               programs_per_sm: int | None = None) -> tuple[int, int]:
    """(splits, slots per split) for B rows x n_kv heads over L slots: splits of whole iterations of `tile` slots,
    added while the grid has fewer than programs_per_sm programs per SM; no split without slots."""
    bn = tile
    pps = CONFIG["programs_per_sm"] if programs_per_sm is None else programs_per_sm
    tiles = max(1, -(-L // bn))
    want = max(1, -(-pps * _sm_count(device) // (B * n_kv)))
    per = -(-tiles // min(tiles, want))
    return -(-tiles // per), per * bn


@functools.cache
def constants(head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(signs float32 [D], signs / D float32 [D], H_{D/2} float32 [D/2, D/2]): the rotation's diagonal, the output
    rotation's diagonal with the 1/D, and the half-size transform the output rotation is built from."""
    signs = _rht_signs(head_dim, torch.device("cpu")).float()
    return (signs.to(device), (signs / head_dim).to(device),
            _hadamard(head_dim // 2, torch.device("cpu")).float().contiguous().to(device))


@functools.cache
def hadamard_matrix(head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """H_D (+-1, exact in any float dtype) for the query rotation's product."""
    return _hadamard(head_dim, torch.device("cpu")).to(dtype).contiguous().to(device)


class Queries:
    """The query side of the attention for one layer and step, made once per (row, head) by `prepare_queries`
    (or by the fused pre-attention kernel, parity.rollout.pre_attention): the rotated query q~ = H (d q) (float32,
    [B, H, D]; q itself without the rotation) for the exact route, and for the tensor-core route its 15-bit
    integer codes as four int8 rows per head (high and low parts of the even and odd elements, [B, H, 4, D/2])
    with three float32 factors per head ([B, H, 4]: scale / 16, 8 x scale x sum of the odd codes, scale x sum of
    all codes; the fourth written as zero, unused)."""

    def __init__(self, rotated: torch.Tensor, codes: torch.Tensor, factors: torch.Tensor) -> None:
        self.rotated, self.codes, self.factors = rotated, codes, factors


def prepare_queries(q: torch.Tensor, hadamard: bool, out: Queries | None = None) -> Queries:
    """Queries of q [B, H, D] (one launch). `out` (same shapes) is filled in place when given (a captured graph
    keeps its buffers)."""
    B, H, D = q.shape
    q = q.contiguous()
    if out is None:
        out = Queries(torch.empty(B, H, D, dtype=torch.float32, device=q.device),
                      torch.empty(B, H, 4, D // 2, dtype=torch.int8, device=q.device),
                      torch.empty(B, H, 4, dtype=torch.float32, device=q.device))
    rows = B * H
    signs, _, _ = constants(D, q.device)
    hm = hadamard_matrix(D, torch.float32 if q.dtype == torch.float32 else torch.bfloat16, q.device)
    _query_kernel[(triton.cdiv(rows, 16),)](q, out.rotated, out.codes, out.factors, signs, hm, rows, D=D,
                                            HADAMARD=hadamard, num_warps=4)
    return out


class Workspace:
    """The partial results of the splits and the merge counters of one cache: allocated on the first call (outside
    graph capture: the decode path runs a step eagerly before capturing it) for as many splits as the cache's
    slots can need, so that later launches, captured or not, reuse the same buffers. The counters start at zero
    and the merging program resets its own."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.m = self.l = self.u = self.count = None

    def get(self, B: int, n_kv: int, G: int, D: int, splits: int, most: int, device: torch.device) -> tuple:
        """Buffers for `splits` splits (`most`: the largest split count this cache's calls can ask for)."""
        need = (B, n_kv, G, D, device)
        if self.key is None or self.key[:5] != need or self.key[5] < splits:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("int4 decode attention: its workspace must be allocated before graph capture "
                                   "(run the step once eagerly first)")
            cap = max(splits, most, 1)
            self.m = torch.empty(B * n_kv, cap, G, dtype=torch.float32, device=device)
            self.l = torch.empty_like(self.m)
            self.u = torch.empty(B * n_kv, cap, G, D, dtype=torch.float32, device=device)
            self.count = torch.zeros(B * n_kv, dtype=torch.int32, device=device)
            self.key = (*need, cap)
        return self.m, self.l, self.u, self.count


def launch_config(exact: bool, config: dict | None = None) -> dict:
    """The launch configuration of a call: CONFIG (the exact route: BLOCKS_FORM with its smaller tile), then the
    caller's `config`."""
    return {**CONFIG, **({**BLOCKS_FORM, "ROWS": EXACT_ROWS} if exact else {}), **(config or {})}


def int4_attention(qs: Queries, kc: torch.Tensor, vc: torch.Tensor, kw: torch.Tensor, vw: torch.Tensor,
                   key_ok: torch.Tensor, slot: torch.Tensor, L: int, scale: float, hadamard: bool,
                   out_dtype: torch.dtype, workspace: Workspace, config: dict | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the queries `qs` (`prepare_queries`, H heads) over slots [0, L) of one layer's int4 cache:
    codes kc / vc uint8 [B, n_kv, S, D/2], scale words kw / vw int32 [B, n_kv, S]. Slot j is seen when j <= slot
    (long [1] on the device) and key_ok[b, j]. Returns [B, H * D] in out_dtype (float32: the exact route, else
    the tensor-core route). `out` [B, H, D] of out_dtype is written when given (tests poison it first)."""
    exact = out_dtype == torch.float32
    cfg = launch_config(exact, config)
    B, H, D = qs.rotated.shape
    n_kv, S = kc.shape[1], kc.shape[2]
    G = H // n_kv
    dev = kc.device
    tile = iteration_slots(cfg, G, exact)
    splits, per = split_plan(B, n_kv, L, dev, tile, cfg["programs_per_sm"])
    out = torch.empty(B, H, D, dtype=out_dtype, device=dev) if out is None else out
    pm, pl, pu, cnt = workspace.get(B, n_kv, G, D, splits, -(-S // tile), dev)
    _, signs_d, hhalf = constants(D, dev)
    if not exact:  # the tensor-core route multiplies by H_{D/2} in bf16 (+-1, exact): read it so, half the bytes
        hhalf = hadamard_matrix(D // 2, torch.bfloat16, dev)
    ok = key_ok.view(torch.uint8) if key_ok.dtype == torch.bool else key_ok
    qk = scale * math.log2(math.e) / (D if hadamard else 1)
    asm = bool(cfg["asm"]) and dev.type == "cuda" and not exact
    slots, merge = warp_form(cfg, G, exact)
    launch = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"],
              **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") and dev.type == "cuda" and (merge or not slots)
                 else {})}
    args = (kc, vc, kw, vw, ok, slot, out, pm, pl, pu, cnt, hhalf, signs_d, qk, L, S, n_kv, H, per, splits,
            ok.stride(0), pm.shape[1])
    nq, sg = groups_form(cfg, G, exact)
    if nq:
        from parity.rollout.int4_attention_groups import _int4_attn_groups_kernel
        const = groups_constants(cfg, G, D, hadamard, asm, splits == 1)
        _int4_attn_groups_kernel[(B * n_kv, splits)](qs.codes, qs.factors, *args, **launch, **const,
                                                     **({"launch_pdl": True} if const["PDL"] else {}))
    elif slots:
        from parity.rollout.int4_attention_warps import _int4_attn_warps_kernel
        _int4_attn_warps_kernel[(B * n_kv, splits)](qs.codes, qs.factors, *args, **launch,
                                                    **warp_constants(cfg, G, D, hadamard, asm, splits == 1))
    else:
        _int4_attn_kernel[(B * n_kv, splits)](qs.rotated, qs.codes, qs.factors, *args, **launch,
                                              **kernel_constants(cfg, G, D, hadamard, exact, asm, splits == 1))
    return out.view(B, H * D)


def warp_constants(cfg: dict, G: int, D: int, hadamard: bool, asm: bool, one_split: bool) -> dict:
    """The warp-split kernel's compile-time arguments (parity.rollout.int4_attention_warps) for launch configuration
    `cfg` (launch_config, the tensor-core route): G query heads a KV head, head dim D."""
    slots, merge = warp_form(cfg, G)
    gp = triton.next_power_of_2(G)
    return {"G": G, "BLOCK_G": max(16, gp), "W": cfg["num_warps"], "SLOTS": slots, "D": D, "HADAMARD": hadamard,
            "ASM": asm, "ONE_SPLIT": one_split, "MERGE": merge, "PREFETCH_OK": bool(cfg.get("prefetch_ok")),
            "FWHT": bool(cfg.get("fwht")), "GP": gp, "LOGD": D.bit_length() - 1}


def groups_constants(cfg: dict, G: int, D: int, hadamard: bool, asm: bool, one_split: bool) -> dict:
    """The slot-groups kernel's compile-time arguments (parity.rollout.int4_attention_groups) for launch
    configuration `cfg` (its form: `groups_form`)."""
    nq, sg = groups_form(cfg, G)
    pf = int(cfg.get("l2_slots") or 0)
    if pf and (pf < 32 or pf & (pf - 1)):
        raise ValueError(f"int4_attention config: l2_slots must be 0 or a power of two >= 32 (a whole 128-byte line "
                         f"of scale words), got {pf}")
    vsplit = bool(cfg.get("group_v")) and nq <= 4  # 8 groups' products a group: 8 B spill at D = 128
    return {"G": G, "GP": triton.next_power_of_2(G), "NQ": nq, "SG": sg, "D": D, "HADAMARD": hadamard, "ASM": asm,
            "ONE_SPLIT": one_split, "PREFETCH_OK": bool(cfg.get("prefetch_ok")), "LOGD": D.bit_length() - 1,
            "VSPLIT": vsplit, "PF_L2": pf if asm else 0, "PDL": bool(cfg.get("pdl")) and asm,
            "QUAD": bool(cfg.get("quad_unpack")) and vsplit}  # a whole tile's four operands at once spill (sm_90a)


def kernel_constants(cfg: dict, G: int, D: int, hadamard: bool, exact: bool, asm: bool, one_split: bool) -> dict:
    """The kernel's compile-time arguments for launch configuration `cfg` (launch_config): G query heads a KV head,
    head dim D. "merge" needs two column groups' room (2 G rounded up <= 16) and the tensor-core route; "row_scale"
    the tensor-core route (the exact route does not round the weights)."""
    gp = triton.next_power_of_2(G)
    return {"G": G, "GP": gp, "BLOCK_G": max(16, gp), "ROWS": cfg["ROWS"], "D": D, "HADAMARD": hadamard,
            "EXACT": exact, "ASM": asm, "ONE_SPLIT": one_split, "BLOCKS": bool(cfg.get("blocks")),
            "MERGE": bool(cfg.get("merge")) and not exact and 2 * gp <= max(16, gp),
            "ROW_SCALE": bool(cfg.get("row_scale")) and not exact}


if triton is not None:
    from parity.rollout.int4_attention_parts import (
        _epilogue,
        _f16_byte,
        _f16_low,
        _hi8,
        _online_softmax,
        _u_rows,
    )

    @triton.jit
    def _round(x):
        return tl.floor(x + 0.5)

    @triton.jit
    def _store_query(x, r, ok, qf_ptr, qi_ptr, qc_ptr, sg_ptr, hm_ptr, D: tl.constexpr, HADAMARD: tl.constexpr):
        """Rows x [M, D] (the query heads at flat rows r, valid where ok) -> the Queries buffers: q~ = H (d x) as a
        product with H_D (+-1: exact products, float32 sums), its 15-bit codes in four int8 parts and the
        three factors (see Queries)."""
        DH: tl.constexpr = D // 2
        d = tl.arange(0, D)
        if HADAMARD:
            xd = x * tl.load(sg_ptr + d)[None, :]  # sign flips: exact in x's dtype
            hm = tl.load(hm_ptr + d[:, None] * D + d[None, :])
            if x.dtype == tl.float32:
                q = tl.dot(xd, hm, input_precision="ieee")
            else:
                q = tl.dot(xd.to(hm.dtype), hm)
        else:
            q = x.to(tl.float32)
        tl.store(qf_ptr + r.to(tl.int64)[:, None] * D + d[None, :], q, mask=ok[:, None])
        qe, qo = tl.split(tl.reshape(q, (q.shape[0], DH, 2)))
        amax = tl.maximum(tl.maximum(tl.max(tl.abs(qe), 1), tl.max(tl.abs(qo), 1)), 1e-30)
        qinv = 16256.0 / amax
        Qe = tl.minimum(tl.maximum(_round(qe * qinv[:, None]), -16256.0), 16256.0)
        Qo = tl.minimum(tl.maximum(_round(qo * qinv[:, None]), -16256.0), 16256.0)
        ea = _round(Qe * (1.0 / 128.0))
        oa = _round(Qo * (1.0 / 128.0))
        jj = tl.arange(0, DH)
        qb = qi_ptr + r.to(tl.int64)[:, None] * (4 * DH) + jj[None, :]
        tl.store(qb, ea.to(tl.int8), mask=ok[:, None])
        tl.store(qb + DH, oa.to(tl.int8), mask=ok[:, None])
        tl.store(qb + 2 * DH, (Qe - 128.0 * ea).to(tl.int8), mask=ok[:, None])
        tl.store(qb + 3 * DH, (Qo - 128.0 * oa).to(tl.int8), mask=ok[:, None])
        qsig = amax * (1.0 / 16256.0)
        fb = qc_ptr + r.to(tl.int64) * 4
        tl.store(fb, qsig * 0.0625, mask=ok)
        tl.store(fb + 1, qsig * 8.0 * tl.sum(Qo, 1), mask=ok)  # sums of integers below 2**24: exact
        tl.store(fb + 2, qsig * (tl.sum(Qe, 1) + tl.sum(Qo, 1)), mask=ok)
        tl.store(fb + 3, qsig * 0.0, mask=ok)  # unused: written, so that no buffer holds uninitialized memory

    @triton.jit
    def _query_kernel(q_ptr, qf_ptr, qi_ptr, qc_ptr, sg_ptr, hm_ptr, rows, D: tl.constexpr,
                      HADAMARD: tl.constexpr):
        r = tl.program_id(0) * 16 + tl.arange(0, 16)
        ok = r < rows
        d = tl.arange(0, D)
        x = tl.load(q_ptr + r.to(tl.int64)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        _store_query(x, r, ok, qf_ptr, qi_ptr, qc_ptr, sg_ptr, hm_ptr, D, HADAMARD)

    @triton.jit
    def _int4_attn_kernel(qr_ptr, qi_ptr, qc_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, ok_ptr, slot_ptr, o_ptr, pm_ptr,
                          pl_ptr, pu_ptr,
                          cnt_ptr, hp_ptr, sg_ptr, qk_scale, L, S, n_kv, H, split_slots, n_split, ok_stride, cap,
                          G: tl.constexpr, GP: tl.constexpr, BLOCK_G: tl.constexpr, ROWS: tl.constexpr,
                          D: tl.constexpr, HADAMARD: tl.constexpr, EXACT: tl.constexpr, ASM: tl.constexpr,
                          ONE_SPLIT: tl.constexpr, BLOCKS: tl.constexpr = False,
                          MERGE: tl.constexpr = False, ROW_SCALE: tl.constexpr = False):
        """Columns of the products: c = r * GP + g, query head g (GP = G rounded up to a power of two) of slot
        sub-range r (R = BLOCK_G / GP of them); an iteration covers T = ROWS * R consecutive slots, slot
        start + n * R + r in row n and column group r (BLOCKS: start + r * ROWS + n, so that column group r's slots
        are consecutive rows of the K product, one warp's). So every row of the score tile is a real (slots, head) pair
        even when G is 2: the K product [T, D/2] x [D/2, BLOCK_G] (slots x heads, int8 tensor cores) is folded
        into it once (its padded head columns dropped), the softmax works on ROWS x 16 real scores, and the V
        product takes the weights scattered back to their slots. (The exact route multiplies the codes as
        [ROWS, R * D/2] rows with a block-diagonal query instead.)"""
        R: tl.constexpr = BLOCK_G // GP
        T: tl.constexpr = ROWS * R
        DH: tl.constexpr = D // 2
        DQ: tl.constexpr = D // 4
        i4 = tl.arange(0, DQ)
        bh = tl.program_id(0)
        sp = tl.program_id(1)
        b = bh // n_kv
        kvh = bh % n_kv
        c = tl.arange(0, BLOCK_G)
        cg = c % GP  # head of column c
        cr = c // GP  # sub-range of column c
        c_ok = cg < G
        j = tl.arange(0, DH)
        # block-diagonal: row c of the K product's left operand holds its head's query in column block cr
        rr = tl.arange(0, R)
        qrow = (b * H + kvh * G + cg).to(tl.int64)
        if EXACT:
            qe = tl.load(qr_ptr + qrow[:, None] * D + 2 * j[None, :], mask=c_ok[:, None], other=0.0)
            qo = tl.load(qr_ptr + qrow[:, None] * D + 2 * j[None, :] + 1, mask=c_ok[:, None], other=0.0)
            diag = cr[:, None, None] == rr[None, :, None]  # [BLOCK_G, R, 1]
            c_c = tl.sum(qe, 1) + tl.sum(qo, 1)
            bea = tl.reshape(tl.where(diag, qe[:, None, :], 0.0), (BLOCK_G, R * DH))
            boa = tl.reshape(tl.where(diag, qo[:, None, :], 0.0), (BLOCK_G, R * DH))
            beb = bea
            bob = boa
            c_a = c_c
            c_b = c_c
        else:  # the query's int8 parts, [D/2, BLOCK_G]: column g = head g of this KV head (zeros past G)
            gq = tl.arange(0, BLOCK_G)
            qb = qi_ptr + (b * H + kvh * G + gq).to(tl.int64)[None, :] * (4 * DH) + j[:, None]
            qok = (gq < G)[None, :]
            if MERGE:  # two parts side by side: column grp * GP + g holds part grp of head g (grp 0: a, 1: b)
                gg = gq % GP
                grp = gq // GP
                qb = qi_ptr + (b * H + kvh * G + gg).to(tl.int64)[None, :] * (4 * DH) + j[:, None] + (grp * 2 * DH)[None, :]
                qok = ((gg < G) & (grp < 2))[None, :]
                bea = tl.load(qb, mask=qok, other=0)  # even elements' parts a and b
                boa = tl.load(qb + DH, mask=qok, other=0)  # odd elements' parts a and b
                w_e = tl.where(grp == 0, 2048, tl.where(grp == 1, 16, 0))  # the parts' weights in the exact sum
                w_o = tl.where(grp == 0, 128, tl.where(grp == 1, 1, 0))
            else:
                bea = tl.load(qb, mask=qok, other=0)
                boa = tl.load(qb + DH, mask=qok, other=0)
                beb = tl.load(qb + 2 * DH, mask=qok, other=0)
                bob = tl.load(qb + 3 * DH, mask=qok, other=0)
            c_a = tl.load(qc_ptr + qrow * 4, mask=c_ok, other=0.0)
            c_b = tl.load(qc_ptr + qrow * 4 + 1, mask=c_ok, other=0.0)
            c_c = tl.load(qc_ptr + qrow * 4 + 2, mask=c_ok, other=0.0)
        base = bh.to(tl.int64) * S
        kc = kc_ptr + base * DH
        vc = vc_ptr + base * DH
        vc16 = vc.to(tl.pointer_type(tl.uint16))
        ks = ks_ptr + base
        vs = vs_ptr + base
        okp = ok_ptr + b.to(tl.int64) * ok_stride
        slot = tl.load(slot_ptr)
        n = tl.arange(0, ROWS)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        z_i = tl.zeros([BLOCK_G], tl.float32)  # sum of weights x zero points (units of the tile's scale, below)
        w_i = tl.zeros([BLOCK_G], tl.float32)  # sum of weights (same units)
        if EXACT:
            acc_x = tl.zeros([BLOCK_G, DH], tl.float32)
            acc_y = tl.zeros([BLOCK_G, DH], tl.float32)
        else:  # per byte of a pair: 1024 + byte (x) and 1024 + low nibble (y)
            acc_x0 = tl.zeros([BLOCK_G, DQ], tl.float32)
            acc_y0 = tl.zeros([BLOCK_G, DQ], tl.float32)
            acc_x1 = tl.zeros([BLOCK_G, DQ], tl.float32)
            acc_y1 = tl.zeros([BLOCK_G, DQ], tl.float32)
        if ROW_SCALE:
            s_prev = tl.full([BLOCK_G], 1.0, tl.float32)
        else:
            s_prev = 1.0
        lo = sp * split_slots
        hi = tl.minimum(lo + split_slots, L)
        for start in range(lo, hi, T):
            if BLOCKS:  # sub-range r: slots start + r * ROWS + [0, ROWS)
                sl = start + cr[:, None] * ROWS + n[None, :]  # slot of (product row c, column n) [BLOCK_G, ROWS]
            else:  # sub-range r: slots start + n * R + r
                sl = start + n[None, :] * R + cr[:, None]
            s_in = sl < hi
            wk = tl.load(ks + sl, mask=s_in, other=0)
            wv = tl.load(vs + sl, mask=s_in, other=0)
            seen = (tl.load(okp + sl, mask=s_in, other=0) != 0) & s_in & (sl <= slot)
            vslot = start + tl.arange(0, T)
            ck = tl.load(kc + vslot[:, None] * DH + j[None, :], mask=(vslot < hi)[:, None], other=0)  # [T, D/2]
            if EXACT:
                cv = tl.load(vc + vslot[:, None] * DH + j[None, :], mask=(vslot < hi)[:, None], other=0)
            else:  # byte pairs: element 4i + {0, 1} in byte 2i, 4i + {2, 3} in byte 2i + 1
                cv = tl.load(vc16 + vslot[:, None] * DQ + i4[None, :], mask=(vslot < hi)[:, None], other=0)
            f = (wk & -16).to(tl.float32, bitcast=True) * qk_scale
            zk = (wk & 15).to(tl.float32)
            sv = (wv & -16).to(tl.float32, bitcast=True)
            zv = (wv & 15).to(tl.float32)
            if EXACT:  # [T, D/2] codes as [ROWS, R * D/2] rows against the block-diagonal query
                if BLOCKS:  # row n: the slots start + r * ROWS + n of every sub-range r, one after another
                    kx = start + rr[None, :, None] * ROWS + n[:, None, None]
                    ckr = tl.reshape(tl.load(kc + kx * DH + j[None, None, :], mask=kx < hi, other=0), (ROWS, R * DH))
                else:
                    ckr = tl.reshape(ck, (ROWS, R * DH))
                s = tl.dot(bea, tl.trans((ckr & 15).to(tl.float32)), input_precision="ieee")
                s = tl.dot(boa, tl.trans((ckr >> 4).to(tl.float32)), s, input_precision="ieee")
                s = (s - zk * c_c[:, None]) * f
            else:
                # slots x heads (16 columns, G of them real), then column g of the slot of (n, r) to row r * GP + g
                lo8 = (ck & 15).to(tl.int8, bitcast=True)  # n' of the even elements
                hi8 = _hi8(ck, ASM)  # 16 (n' - 8) of the odd ones
                if MERGE:
                    tt_ = (tl.dot(lo8, bea, out_dtype=tl.int32) * w_e[None, :]
                           + tl.dot(hi8, boa, out_dtype=tl.int32) * w_o[None, :])
                else:
                    ta = tl.dot(lo8, bea, out_dtype=tl.int32) * 16
                    ta = tl.dot(hi8, boa, ta, out_dtype=tl.int32)
                    tb = tl.dot(lo8, beb, out_dtype=tl.int32) * 16
                    tb = tl.dot(hi8, bob, tb, out_dtype=tl.int32)
                    tt_ = ta * 128 + tb
                # 16 (Q . n' - 8 sum(Q odd)), exact, in column group 0 (MERGE: the groups' weighted parts summed)
                if BLOCKS:  # product row r * ROWS + n
                    t4 = tl.reshape(tt_, (R, ROWS, BLOCK_G // GP, GP))
                else:  # product row n * R + r
                    t4 = tl.reshape(tt_, (ROWS, R, BLOCK_G // GP, GP))
                if not MERGE:
                    t4 = tl.where((tl.arange(0, BLOCK_G // GP) == 0)[None, None, :, None], t4, 0)
                t4 = tl.sum(t4, 2)
                if BLOCKS:
                    t = tl.reshape(tl.permute(t4, (0, 2, 1)), (BLOCK_G, ROWS)).to(tl.float32)
                else:
                    t = tl.trans(tl.reshape(t4, (ROWS, BLOCK_G))).to(tl.float32)
                s = (t * c_a[:, None] + c_b[:, None]) * f - (zk * f) * c_c[:, None]
            m_new, alpha, p, l_i = _online_softmax(s, seen, m_i, l_i, 1)
            if EXACT:
                pw = p * sv
                beta = alpha
            else:  # relative to the tile's largest scale (in [0, 1]: fp16 keeps 11 bits)
                if ROW_SCALE:  # relative to the row's largest scale (its slots only: no sum across warps)
                    s_max = tl.maximum(tl.max(sv, 1), 1e-30)
                    inv_s = (1.0 / s_max)[:, None]
                else:
                    s_max = tl.maximum(tl.max(tl.max(sv, 1), 0), 1e-30)
                    inv_s = 1.0 / s_max
                pw = (p * (sv * inv_s)).to(tl.float16).to(tl.float32)
                beta = alpha * (s_prev / s_max)
                s_prev = s_max
            z_i = z_i * beta + tl.sum(pw * zv, 1)
            w_i = w_i * beta + tl.sum(pw, 1)
            # the weights back at their slots: the column of [BLOCK_G, T] of slot (n, r) holds column n of row c if
            # r == cr
            if BLOCKS:  # column r * ROWS + n (else n * R + r)
                pt = tl.reshape(tl.where(cr[:, None, None] == rr[None, :, None], pw[:, None, :], 0.0), (BLOCK_G, T))
            else:
                pt = tl.reshape(tl.where(cr[:, None, None] == rr[None, None, :], pw[:, :, None], 0.0), (BLOCK_G, T))
            if EXACT:
                acc_y = tl.dot(pt, (cv & 15).to(tl.float32), acc_y * beta[:, None], input_precision="ieee")
                acc_x = tl.dot(pt, (cv >> 4).to(tl.float32), acc_x * beta[:, None], input_precision="ieee")
            else:
                pt = pt.to(tl.float16)
                acc_x0 = tl.dot(pt, _f16_byte(cv, 0, ASM), acc_x0 * beta[:, None])
                acc_y0 = tl.dot(pt, _f16_low(cv, 0, ASM), acc_y0 * beta[:, None])
                acc_x1 = tl.dot(pt, _f16_byte(cv, 1, ASM), acc_x1 * beta[:, None])
                acc_y1 = tl.dot(pt, _f16_low(cv, 1, ASM), acc_y1 * beta[:, None])
            m_i = m_new
        # per column u = sum_j p_j s_j (n'_j - z_j), even elements from the low nibbles, odd from the high ones
        if EXACT:
            u_lo = acc_y - z_i[:, None]
            u_hi = acc_x - z_i[:, None]
        else:
            if ROW_SCALE:
                s_out = s_prev[:, None]
            else:
                s_out = s_prev
            u_lo, u_hi = _u_rows(acc_x0, acc_y0, acc_x1, acc_y1, w_i[:, None], z_i[:, None])
            u_lo = u_lo * s_out
            u_hi = u_hi * s_out
        # merge the R sub-ranges of each head: rows c < GP of [BLOCK_G, ...] hold head c afterwards
        mr = tl.reshape(m_i, (R, GP))
        top = tl.max(mr, 0)
        top = tl.where(top == float("-inf"), 0.0, top)
        wr = tl.where(mr == float("-inf"), 0.0, tl.exp2(mr - top[None, :]))
        l_h = tl.sum(tl.reshape(l_i, (R, GP)) * wr, 0)
        lo_h = tl.sum(tl.reshape(u_lo, (R, GP, DH)) * wr[:, :, None], 0)
        hi_h = tl.sum(tl.reshape(u_hi, (R, GP, DH)) * wr[:, :, None], 0)
        m_h = tl.max(mr, 0)
        # back to BLOCK_G rows (the products of the output rotation need 16): row c holds head cg
        l_c = tl.reshape(tl.broadcast_to(l_h[None, :], (R, GP)), (BLOCK_G,))
        m_c = tl.reshape(tl.broadcast_to(m_h[None, :], (R, GP)), (BLOCK_G,))
        lo_c = tl.reshape(tl.broadcast_to(lo_h[None, :, :], (R, GP, DH)), (BLOCK_G, DH))
        hi_c = tl.reshape(tl.broadcast_to(hi_h[None, :, :], (R, GP, DH)), (BLOCK_G, DH))
        own = c_ok & (cr == 0)  # the rows that write
        head = (b * H + kvh * G + cg).to(tl.int64)
        _epilogue(m_c, l_c, lo_c, hi_c, own, c_ok, cg, head, bh, sp, n_split, cap, o_ptr, pm_ptr, pl_ptr, pu_ptr,
                  cnt_ptr, hp_ptr, sg_ptr, G, BLOCK_G, D, HADAMARD, EXACT, ONE_SPLIT)
