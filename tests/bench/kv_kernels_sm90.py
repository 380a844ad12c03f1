"""Compile the packed KV cache's Triton kernels for the H200 (sm_90a) on a machine without a GPU and report, per
variant, registers, spills and the matrix instructions in the SASS (Triton's bundled ptxas and cuobjdump): a
compile error, a spill or a missing tensor-core path shows here at no device time.

    .venv/bin/python tests/bench/kv_kernels_sm90.py          (needs triton; no GPU)
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import parity.precision.kv_packed as kp
import parity.rollout.decode_attention as da

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
CODE = {kp.KIND_INT8: "*i8", kp.KIND_FP8: "*fp8e4nv", kp.KIND_FP8_PTH: "*fp8e4nv", kp.KIND_INT4: "*u8"}
SCALE = {kp.KIND_INT8: "*fp32", kp.KIND_FP8_PTH: "*fp32", kp.KIND_INT4: "*i32"}


def report(name: str, fn, sig: dict, const: dict, opts: dict) -> str:
    sig = {**sig, **{k: "constexpr" for k in const}}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=TARGET, options=opts)
    d = tempfile.mkdtemp()
    with open(f"{d}/k.ptx", "w") as f:
        f.write(k.asm["ptx"])
    with open(f"{d}/k.cubin", "wb") as f:
        f.write(k.asm["cubin"])
    info = subprocess.run([f"{BIN}/ptxas", "-arch=sm_90a", "-v", f"{d}/k.ptx", "-o", f"{d}/v.cubin"],
                          capture_output=True, text=True).stderr
    sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f"{d}/k.cubin"], capture_output=True, text=True).stdout
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores", info)
    ops = {op: len(re.findall(rf"\b{op}\b", sass)) for op in ("IGMMA", "HGMMA", "IMMA", "HMMA", "FFMA", "STL")}
    line = (f"{name:58s} regs {regs.group(1) if regs else '?':>4s} spill {spill.group(1) if spill else '?':>3s} "
            f"smem {k.metadata.shared:>6d}  " + " ".join(f"{a}={b}" for a, b in ops.items() if b))
    print(line, flush=True)
    return line


def main() -> None:
    for kind, had, D, dt in [(kp.KIND_INT4, True, 128, "bf16"), (kp.KIND_INT4, False, 128, "bf16"),
                             (kp.KIND_INT8, False, 128, "bf16"), (kp.KIND_FP8, False, 128, "bf16"),
                             (kp.KIND_FP8_PTH, False, 128, "bf16"), (kp.KIND_INT4, True, 64, "bf16"),
                             (kp.KIND_INT4, True, 128, "fp32")]:
        val, code, scale = f"*{dt}", CODE[kind], SCALE.get(kind, CODE[kind])
        tag = f"kind={kind} hadamard={had} D={D} {dt}"
        ints = dict.fromkeys(("ksb", "ksh", "kst", "vsb", "vsh", "vst", "NR", "n_kv", "T", "S"), "i32")
        floats = dict.fromkeys(("fp8_inv", "min_scale", "inv127", "inv15", "inv448"), "fp32")
        report(f"write {tag}", kp._kv_write_kernel,
               {"k_ptr": val, "v_ptr": val, "kc_ptr": code, "vc_ptr": code, "ks_ptr": scale, "vs_ptr": scale,
                "slot_ptr": "*i64", "sgn_ptr": "*fp32", **ints, **floats},
               {"KIND": kind, "HADAMARD": had, "D": D, "ROWS": 16, "LOG2D": D.bit_length() - 1},
               {"enable_fp_fusion": False, "num_warps": 4})
        dc = D // 2 if kind == kp.KIND_INT4 else D
        report(f"dequant {tag}", kp._kv_dequant_kernel,
               {"c_ptr": code, "s_ptr": scale, "o_ptr": val, "he_ptr": "*i8", "ho_ptr": "*i8", "sg_ptr": "*fp32",
                "fp8_scale": "fp32", "lo": "i32", "T": "i32", "S": "i32"},
               {"KIND": kind, "HADAMARD": had, "D": D, "DC": dc, "BLOCK_N": 64, "TMODE": kp.transform_mode(D)},
               {"num_warps": 4})
        for one in (True, False):
            part = val if one else "*fp32"
            for cfg in da._attn_tuned.configs:
                report(f"attention {tag} one_split={one} {cfg}", da._attn_kernel,
                       {"q_ptr": val, "kc_ptr": code, "vc_ptr": code, "ks_ptr": scale, "vs_ptr": scale,
                        "ok_ptr": "*u8", "slot_ptr": "*i64", "o_ptr": val, "m_ptr": part, "l_ptr": part,
                        "acc_ptr": part, "he_ptr": "*i8", "ho_ptr": "*i8", "sg_ptr": "*fp32", "fp8_scale": "fp32",
                        "qk_scale": "fp32", **dict.fromkeys(("L", "S", "n_kv", "H", "split_slots", "n_split",
                                                             "ok_stride"), "i32")},
                       {"G": 2, "BLOCK_G": 16, "D": D, "KIND": kind, "HADAMARD": had, "DC": dc,
                        "TMODE": kp.transform_mode(D), "ONE_SPLIT": one, "DOT_PREC": "ieee" if dt == "fp32" else None,
                        **cfg.kwargs}, {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


if __name__ == "__main__":
    main()
