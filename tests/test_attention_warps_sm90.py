"""The dequantizing decode attention's warp-split form (parity.rollout.decode_attention_warps) compiled for the H200
(sm_90a) by Triton's own compiler, no GPU needed: for every kind it serves, the bench's launch configurations and
the group sizes and head dims the decode path launches, it fits the shared memory and its slot loop has no
local-memory traffic (no spilled register read or written there; ptxas may keep a register or two of the prologue
in local memory). Skipped without Triton (the project's CPU environment); it runs with the
CUDA tests (docs/PERFORMANCE.md) and wherever Triton is installed."""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton")

from triton.compiler import ASTSource  # noqa: E402

import parity.precision.kv_packed as kp  # noqa: E402
import parity.rollout.decode_attention_warps as dw  # noqa: E402
from tests.bench.kv_kernels_sm90 import BIN, TARGET, main_loop  # noqa: E402

H200_SMEM = 232448
CODE = {kp.KIND_RAW: ("*bf16", "*bf16"), kp.KIND_INT8: ("*i8", "*fp32"), kp.KIND_FP8: ("*fp8e4nv", "*fp8e4nv"),
        kp.KIND_FP8_PTH: ("*fp8e4nv", "*fp32")}
# (warps, slots a warp) of tests/bench/gpu_int4_decode_variants.py's warp-split rows
CONFIGS = [(4, 16), (4, 32), (2, 32), (1, 32)]


@pytest.mark.parametrize("warps,slots", CONFIGS, ids=[f"warps{w}-ws{s}" for w, s in CONFIGS])
@pytest.mark.parametrize("kind", list(CODE), ids=["raw", "int8", "fp8", "fp8_pth"])
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("G", [1, 2, 4, 8])
def test_warp_split_attention_loop_stays_out_of_local_memory(warps, slots, kind, D, G):
    code, scale = CODE[kind]
    const = {"G": G, "BLOCK_G": max(16, triton.next_power_of_2(G)), "W": warps, "SLOTS": slots, "D": D,
             "KIND": kind, "ONE_SPLIT": True}
    sig = {"q_ptr": "*bf16", "kc_ptr": code, "vc_ptr": code, "ks_ptr": scale, "vs_ptr": scale, "ok_ptr": "*u8",
           "slot_ptr": "*i64", "o_ptr": "*bf16", "m_ptr": "*bf16", "l_ptr": "*bf16", "acc_ptr": "*bf16",
           "fp8_scale": "fp32", "qk_scale": "fp32",
           **dict.fromkeys(("L", "S", "n_kv", "H", "split_slots", "n_split", "ok_stride"), "i32"),
           **dict.fromkeys(const, "constexpr")}
    # as the JIT specialises the decode step's launch: pointers, and the lengths, strides and head count that are
    # multiples of 16 there (L and the splits in 64-slot buckets, S aligned, 16 query heads)
    attrs = {(dw._attn_warps_kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
             if t.startswith("*") or a in ("L", "S", "H", "split_slots", "ok_stride")}
    k = triton.compile(ASTSource(fn=dw._attn_warps_kernel, signature=sig, constexprs=const, attrs=attrs),
                       target=TARGET, options={"num_warps": warps, "num_stages": 2})
    assert k.metadata.shared <= H200_SMEM
    path = os.path.join(tempfile.mkdtemp(), "k.cubin")
    with open(path, "wb") as f:
        f.write(k.asm["cubin"])
    sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", path], capture_output=True, text=True, check=True).stdout
    loop = main_loop(sass)
    assert loop, "no slot loop found in the SASS"
    local = [i for i in loop if "STL" in i or "LDL" in i]
    assert not local, local[:4]
