"""Compile the packed KV cache's Triton kernels for the H200 (sm_90a) on a machine without a GPU and report, per
variant, registers, spills and the matrix instructions in the SASS (Triton's bundled ptxas and cuobjdump): a
compile error, a spill or a missing tensor-core path shows here at no device time. Pointer arguments and the
integer arguments that are multiples of 16 on the device are specialised as the JIT does (tt.divisibility 16:
without it loads are not vectorised and the SASS is not the device's). For the rotated int4 attention and the fused
pre-attention kernel it also counts the instructions of the main loop (warp instructions per 64 slots), the figure
the predictions in docs/PERFORMANCE.md start from.

    python tests/bench/kv_kernels_sm90.py [--int4-only | --dequant-forms]       (needs triton; no GPU)
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import parity.precision.kv_packed as kp
import parity.rollout.decode_attention as da
import parity.rollout.decode_attention_warps as dw
import parity.rollout.int4_attention as ia
import parity.rollout.int4_attention_groups as ig
import parity.rollout.int4_attention_warps as iw
import parity.rollout.pre_attention as pa

TARGET = GPUTarget("cuda", 90, 32)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
CODE = {kp.KIND_INT8: "*i8", kp.KIND_FP8: "*fp8e4nv", kp.KIND_FP8_PTH: "*fp8e4nv", kp.KIND_INT4: "*u8"}
SCALE = {kp.KIND_INT8: "*fp32", kp.KIND_FP8_PTH: "*fp32", kp.KIND_INT4: "*i32"}


def ptxas_registers(ptx: str) -> tuple[int, int]:
    """(registers, bytes of spill stores) of a kernel's PTX, from ptxas -v for sm_90a."""
    d = tempfile.mkdtemp()
    with open(f"{d}/k.ptx", "w") as f:
        f.write(ptx)
    info = subprocess.run([f"{BIN}/ptxas", "-arch=sm_90a", "-v", f"{d}/k.ptx", "-o", f"{d}/v.cubin"],
                          capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores", info)
    if regs is None or spill is None:
        raise RuntimeError(f"ptxas -v reported no register count: {info[-400:]}")
    return int(regs.group(1)), int(spill.group(1))


def report(name: str, fn, sig: dict, const: dict, opts: dict, div16: tuple = (), loop_slots: int = 0) -> str:
    sig = {**sig, **{k: "constexpr" for k in const}}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
             if t.startswith("*") or a in div16}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=TARGET, options=opts)
    d = tempfile.mkdtemp()
    with open(f"{d}/k.cubin", "wb") as f:
        f.write(k.asm["cubin"])
    regs, spill = ptxas_registers(k.asm["ptx"])
    sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f"{d}/k.cubin"], capture_output=True, text=True).stdout
    ops = {op: len(re.findall(rf"\b{op}\b", sass)) for op in ("IGMMA", "HGMMA", "IMMA", "HMMA", "FFMA", "STL")}
    line = (f"{name:58s} regs {regs:>4d} spill {spill:>3d} "
            f"smem {k.metadata.shared:>6d}  " + " ".join(f"{a}={b}" for a, b in ops.items() if b))
    if loop_slots:
        body = main_loop(sass)
        mix = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0] for i in body)
        per64 = len(body) * opts["num_warps"] * 64 / loop_slots
        every = len(re.findall(r"/\*[0-9a-f]{4,}\*/\s+\S", sass))
        # programs an SM by registers (65,536 an SM, allocated 256 a warp)
        pps = min(32, 65536 // (-(-regs * 32 // 256) * 256 * opts["num_warps"]))
        line += (f"\n    main loop {len(body)} instructions a warp per {loop_slots} slots = {per64:.0f} warp "
                 f"instructions per 64 slots, {sum('BAR.SYNC' in i for i in body)} BAR.SYNC; the kernel {every} "
                 f"a warp; {pps} programs an SM by registers\n    loop: "
                 + " ".join(f"{a}={b}" for a, b in mix.most_common(14)))
    print(line, flush=True)
    return line


def main_loop(sass: str) -> list[str]:
    """The instructions of the longest backward branch's body (the kernel's slot loop)."""
    lines = [(int(m.group(1), 16), m.group(2)) for m in
             (re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", x) for x in sass.splitlines()) if m]
    best: list[str] = []
    for addr, ins in lines:
        t = re.search(r"BRA\s.*?0x([0-9a-f]+)", ins)
        if t and int(t.group(1), 16) < addr:
            body = [i for a, i in lines if int(t.group(1), 16) <= a <= addr]
            best = body if len(body) > len(best) else best
    return best


def int4_attention_signature(out: str = "bf16") -> dict:
    """The rotated int4 attention kernel's runtime arguments as Triton types (output dtype `out`)."""
    ints = dict.fromkeys(("L", "S", "n_kv", "H", "split_slots", "n_split", "ok_stride", "cap"), "i32")
    return {"qr_ptr": "*fp32", "qi_ptr": "*i8", "qc_ptr": "*fp32", "kc_ptr": "*u8", "vc_ptr": "*u8", "ks_ptr": "*i32",
            "vs_ptr": "*i32", "ok_ptr": "*u8", "slot_ptr": "*i64", "o_ptr": f"*{out}", "pm_ptr": "*fp32",
            "pl_ptr": "*fp32", "pu_ptr": "*fp32", "cnt_ptr": "*i32", "hp_ptr": "*fp32" if out == "fp32" else "*bf16",
            "sg_ptr": "*fp32",
            "qk_scale": "fp32", **ints}


PRE_SIG = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "q_rs": "i32", "k_rs": "i32", "v_rs": "i32",
           "qn_ptr": "*bf16", "kn_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "pos_ptr": "*i64",
           "kc_ptr": "*u8", "vc_ptr": "*u8", "ks_ptr": "*i32", "vs_ptr": "*i32", "slot_ptr": "*i64",
           "sgn_ptr": "*fp32", "qf_ptr": "*fp32", "qi_ptr": "*i8", "qc_ptr": "*fp32", "qsg_ptr": "*fp32",
           "hm_ptr": "*bf16", "qo_ptr": "*fp32", "S": "i32", "n_kv": "i32", "H": "i32",
           **dict.fromkeys(("eps", "fp8_inv", "min_scale", "inv127", "inv15", "inv448"), "fp32")}
NORM_ROPE_SIG = {"q_ptr": "*bf16", "k_ptr": "*bf16", "q_rs": "i32", "k_rs": "i32", "qn_ptr": "*bf16",
                 "kn_ptr": "*bf16", "eps": "fp32", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "pos_ptr": "*i64",
                 "qo_ptr": "*bf16", "ko_ptr": "*bf16", "H": "i32", "n_kv": "i32"}


def pre_attention_kernels(eager: bool = False) -> list[str]:
    """The fused pre-attention kernel (int4, rotated queries) and its norms-and-rotary kernel for a simulated cache,
    at the 0.6B shape (16 query heads, 8 KV heads, D = 128), the rotary rounded once or as the eager functions."""
    return [report(f"fused pre-attention (int4, rotated queries) eager={eager}", pa._pre_attention_kernel, PRE_SIG,
                   {"D": 128, "HB": 16, "KB": 8, "KIND": kp.KIND_INT4, "HADAMARD": True, "QMODE": 1, "LOG2D": 7,
                    "EAGER": eager}, {"num_warps": 4, "enable_fp_fusion": False}, div16=("q_rs", "k_rs", "v_rs", "S", "H")),
            report(f"norms and rotary (simulated cache) eager={eager}", pa._norm_rope_kernel, NORM_ROPE_SIG,
                   {"D": 128, "HB": 16, "KB": 8, "EAGER": eager}, {"num_warps": 4, "enable_fp_fusion": False},
                   div16=("q_rs", "k_rs", "H"))]


def int4_kernels() -> None:
    sig = int4_attention_signature()
    for rows, warps, stages, one, reg, form in [
            (16, 4, 2, False, 0, ""), (16, 4, 2, True, 0, ""), (8, 4, 2, False, 0, ""), (16, 8, 2, False, 0, ""),
            (32, 8, 2, False, 0, ""), (16, 4, 3, False, 0, ""), (16, 4, 2, False, 128, ""),
            (16, 4, 2, False, 0, "blocks"), (16, 4, 2, False, 0, "merge"), (16, 4, 2, False, 0, "blocks+merge"),
            (8, 4, 2, False, 0, "blocks+merge"), (16, 4, 2, False, 0, "blocks+rowscale"),
            (16, 4, 2, True, 0, "blocks"), (8, 4, 2, True, 128, "blocks+merge")]:
        opts = {"num_warps": warps, "num_stages": stages, **({"maxnreg": reg} if reg else {})}
        report(f"int4 rotated rows={rows} warps={warps} stages={stages} one_split={one} maxnreg={reg or '-'} {form}",
               ia._int4_attn_kernel, sig,
               ia.kernel_constants({"ROWS": rows, "blocks": "blocks" in form, "merge": "merge" in form,
                                    "row_scale": "rowscale" in form}, G=2, D=128, hadamard=True, exact=False, asm=True,
                                   one_split=one), opts,
               div16=("L", "S", "H", "split_slots", "ok_stride"), loop_slots=rows * 8)
    warp_sig = {k: v for k, v in sig.items() if k != "qr_ptr"}
    # the warp-split form as batch 64 launches it (one split), the bench's variants (changes to BLOCKS_FORM: the
    # output rotation as products), then the pinned configuration (int4_attention.CONFIG)
    div16 = ("L", "S", "H", "split_slots", "ok_stride")
    for slots, warps, merge, reg in [(32, 4, True, 0), (64, 4, True, 0), (32, 4, True, 168), (32, 2, True, 0),
                                     (64, 2, True, 0), (32, 4, False, 0)]:
        cfg = {**ia.BLOCKS_FORM, "warp_slots": slots, "num_warps": warps, "merge": merge, "maxnreg": reg}
        report(f"int4 rotated warp-split slots={slots} warps={warps} merge={merge} maxnreg={reg or '-'}",
               iw._int4_attn_warps_kernel, warp_sig, ia.warp_constants(cfg, 2, 128, True, True, True),
               {"num_warps": warps, "num_stages": 2, **({"maxnreg": reg} if reg else {})}, div16=div16,
               loop_slots=slots * warps)
    cfg = {**ia.CONFIG, "groups": False}
    report(f"int4 rotated warp-split slots={cfg['warp_slots']} warps={cfg['num_warps']} "
           f"stages={cfg['num_stages']} prefetch_ok={cfg['prefetch_ok']} fwht={cfg['fwht']}",
           iw._int4_attn_warps_kernel, warp_sig, ia.warp_constants(cfg, 2, 128, True, True, True),
           {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}, div16=div16,
           loop_slots=cfg["warp_slots"] * cfg["num_warps"])
    cfg = ia.CONFIG  # the pinned configuration: the slot-groups form (int4_attention_groups) when "groups"
    if cfg["groups"]:
        report(f"int4 rotated slot groups pinned {ia.groups_form(cfg, 2)} stages={cfg['num_stages']}",
               ig._int4_attn_groups_kernel, warp_sig, ia.groups_constants(cfg, 2, 128, True, True, True),
               {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}, div16=div16,
               loop_slots=ia.iteration_slots(cfg, 2))
    report("int4 query preparation", ia._query_kernel,
           {"q_ptr": "*bf16", "qf_ptr": "*fp32", "qi_ptr": "*i8", "qc_ptr": "*fp32", "sg_ptr": "*fp32",
            "hm_ptr": "*bf16", "rows": "i32"}, {"D": 128, "HADAMARD": True}, {"num_warps": 4})
    pre_attention_kernels(False)
    pre_attention_kernels(True)


def dequant_forms() -> None:
    """The dequantizing attention's pinned form (64 slots, 4 warps) against its warp-split configurations (the INT4
    bench's), one split as at batch 64, G = 2, D = 128, the lengths specialised as the decode step's."""
    ints = dict.fromkeys(("L", "S", "n_kv", "H", "split_slots", "n_split", "ok_stride"), "i32")
    div = ("L", "S", "H", "split_slots", "ok_stride")
    for kind in (kp.KIND_FP8_PTH, kp.KIND_FP8, kp.KIND_INT8, kp.KIND_RAW):
        code = CODE.get(kind, "*bf16")
        scale = SCALE.get(kind, code)
        sig = {"q_ptr": "*bf16", "kc_ptr": code, "vc_ptr": code, "ks_ptr": scale, "vs_ptr": scale, "ok_ptr": "*u8",
               "slot_ptr": "*i64", "o_ptr": "*bf16", "m_ptr": "*bf16", "l_ptr": "*bf16", "acc_ptr": "*bf16"}
        report(f"dequantizing attention kind={kind} pinned 64 slots, 4 warps", da._attn_kernel,
               {**sig, "he_ptr": "*i8", "ho_ptr": "*i8", "sg_ptr": "*fp32", "fp8_scale": "fp32", "qk_scale": "fp32",
                **ints},
               {"G": 2, "BLOCK_G": 16, "D": 128, "KIND": kind, "HADAMARD": False, "DC": 128,
                "TMODE": kp.transform_mode(128), "ONE_SPLIT": True, "DOT_PREC": None, "BLOCK_N": 64},
               {"num_warps": 4, "num_stages": 2}, div16=div, loop_slots=64)
        for warps, slots in ((4, 16), (4, 32), (2, 32)):
            report(f"dequantizing attention kind={kind} warp-split {warps} x {slots}", dw._attn_warps_kernel,
                   {**sig, "fp8_scale": "fp32", "qk_scale": "fp32", **ints},
                   {"G": 2, "BLOCK_G": 16, "W": warps, "SLOTS": slots, "D": 128, "KIND": kind, "ONE_SPLIT": True},
                   {"num_warps": warps, "num_stages": 2}, div16=div, loop_slots=warps * slots)


def main() -> None:
    if "--dequant-forms" in sys.argv:
        dequant_forms()
        return
    int4_kernels()
    if "--int4-only" in sys.argv:
        return
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
