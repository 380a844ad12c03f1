"""The rotated int4 decode attention compiled for the H200 (sm_90a) by Triton's own compiler, no GPU needed: every
query-group size and head dim the decode path launches fits the device's shared memory with the configuration
`int4_attention` chooses (the exact float32 route once asked for 247,808 B at G = 1, over the 232,448 B an H200
block may use; Triton reports that only at launch, on the device). Skipped without Triton (the project's CPU
environment); it runs with the CUDA tests (docs/PERFORMANCE.md) and wherever Triton is installed."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from triton.compiler import ASTSource  # noqa: E402

import parity.rollout.int4_attention as ia  # noqa: E402
import parity.rollout.int4_attention_warps as iw  # noqa: E402
from tests.bench.kv_kernels_sm90 import TARGET, int4_attention_signature, ptxas_registers  # noqa: E402

H200_SMEM = 232448  # cudaDevAttrMaxSharedMemoryPerBlockOptin on sm_90 (227 KiB)


def shared_bytes(out: str, G: int, D: int, hadamard: bool) -> int:
    exact = out == "fp32"
    cfg = ia.launch_config(exact, None if exact else ia.BLOCKS_FORM)  # this kernel as int4_attention launches it
    const = ia.kernel_constants(cfg, G, D, hadamard, exact, not exact, False)
    sig = {**int4_attention_signature(out), **dict.fromkeys(const, "constexpr")}
    attrs = {(ia._int4_attn_kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
             if t.startswith("*")}
    k = triton.compile(ASTSource(fn=ia._int4_attn_kernel, signature=sig, constexprs=const, attrs=attrs),
                       target=TARGET, options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    return k.metadata.shared


@pytest.mark.parametrize("out", ["fp32", "bf16"])
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("G", [1, 2, 4, 8])
def test_int4_attention_fits_the_h200_shared_memory(out, D, G):
    assert shared_bytes(out, G, D, True) <= H200_SMEM


@pytest.mark.parametrize("cfg", [{}, {"warp_slots": 32}, {"num_warps": 2}, {"num_warps": 2, "warp_slots": 32},
                                 {"num_warps": 4, "warp_slots": 32, "num_stages": 2},
                                 {"num_warps": 4, "warp_slots": 32, "num_stages": 2, "maxnreg": 168},
                                 {"warp_slots": 32, "merge": False, "num_warps": 4},
                                 {"num_stages": 2, "prefetch_ok": False}, {"fwht": False}],
                         ids=["butterflies", "ws32", "warps2", "ws32-warps2", "ws32-warps4-stages2",
                              "ws32-warps4-stages2-reg168", "ws32-unmerged-warps4", "stages2-mask-in-its-iteration",
                              "rotation-as-products"])
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("G", [1, 2, 4, 8, 16])
def test_warp_split_form_compiles_without_spills(cfg, D, G):
    """The warp-split form (bf16 route only) for every group size the decode path launches, as pinned
    (int4_attention.CONFIG) without the slot groups and with the changes the bench and the A/B time: it compiles for
    sm_90a, fits the shared memory and keeps its registers (a spill would put local-memory traffic in the loop)."""
    cfg = ia.launch_config(False, {"groups": False, **cfg})  # changes to the pinned launch
    merge = ia.warp_form(cfg, G)[1]
    const = ia.warp_constants(cfg, G, D, True, True, False)  # as int4_attention launches it, split
    assert_fits_without_spills(iw._int4_attn_warps_kernel, const, {
        "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"],
        **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") and merge else {})})  # as int4_attention launches it


def assert_fits_without_spills(fn, const: dict, options: dict) -> None:
    """Compile one of the warp-split kernels (the bf16 route's signature) for sm_90a with compile-time arguments
    `const` and launch `options`: shared memory within the H200's, at most 255 registers, no spill."""
    sig = {k: v for k, v in int4_attention_signature().items() if k != "qr_ptr"}
    sig = {**sig, **dict.fromkeys(const, "constexpr")}
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items() if t.startswith("*")}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=TARGET, options=options)
    assert k.metadata.shared <= H200_SMEM
    regs, spills = ptxas_registers(k.asm["ptx"])
    assert regs <= 255 and spills == 0, (regs, spills)
    return k


@pytest.mark.parametrize("eager", [False, True], ids=["rounded-once", "eager-rounding"])
def test_the_pre_attention_kernels_build_for_sm90(eager):
    """The fused pre-attention kernel and its norms-and-rotary kernel for a simulated cache (the fused route's two
    kernels, parity.rollout.pre_attention), both roundings of the rotary: no spills, shared memory within the H200's."""
    import re

    from tests.bench.kv_kernels_sm90 import pre_attention_kernels
    for line in pre_attention_kernels(eager):
        spill, smem = (int(re.search(rf"{k}\s+(\d+)", line).group(1)) for k in ("spill", "smem"))
        assert spill == 0 and smem <= H200_SMEM, line


@pytest.mark.parametrize("cfg", [{"groups": True}, {"groups": True, "warp_slots": 32},
                                 {"groups": True, "num_stages": 2}, {"groups": True, "group_v": False, "l2_slots": 0},
                                 {"groups": True, "l2_slots": 128}, {"groups": True, "quad_unpack": True},
                                 {"groups": True, "pdl": True}],
                         ids=["pinned", "groups-ws32", "groups-stages2", "one-v-product-no-prefetch", "prefetch-128",
                              "quad-unpack", "pdl"])
@pytest.mark.parametrize("D", [128, 64])
@pytest.mark.parametrize("G", [1, 2, 4, 8])
def test_slot_groups_form_compiles_without_spills(cfg, D, G):
    """The slot-groups form (int4_attention_groups) for every group size it takes (G <= 8), split as at small
    batches: it compiles for sm_90a, fits the shared memory, no spill."""
    from parity.rollout import int4_attention_groups as ig
    cfg = ia.launch_config(False, cfg)
    const = ia.groups_constants(cfg, G, D, True, True, False)  # as int4_attention launches it, split
    assert_fits_without_spills(ig._int4_attn_groups_kernel, const,
                               {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})


def test_the_l2_prefetch_takes_whole_lines_of_scale_words():
    """l2_slots: 0 or a power of two of at least 32 slots (the prefetch's line counts are tensor sizes, and 32 scale
    words fill a 128-byte line); a clear error names the key otherwise, and without inline PTX nothing is
    prefetched."""
    for bad in (16, 48, 100):
        with pytest.raises(ValueError, match="l2_slots"):
            ia.groups_constants({**ia.CONFIG, "l2_slots": bad}, 2, 128, True, True, True)
    assert ia.groups_constants({**ia.CONFIG, "l2_slots": 128}, 2, 128, True, True, True)["PF_L2"] == 128
    assert ia.groups_constants({**ia.CONFIG, "l2_slots": 0}, 2, 128, True, True, True)["PF_L2"] == 0
    assert ia.groups_constants(ia.CONFIG, 2, 128, True, False, True)["PF_L2"] == 0


def test_the_dependent_launch_waits_before_the_first_load():
    """"pdl": the slot-groups kernel waits for the kernel before it (griddepcontrol.wait) after its L2 prefetches and
    before any load or asynchronous copy, so that what that kernel writes (the query, the step's slot, the cache's
    new slot) is read after it; and the fused pre-attention kernel with PDL lets its dependents launch before any of
    its own loads. Without "pdl" neither instruction is there."""
    import re

    import parity.precision.kv_packed as kp
    from parity.rollout import int4_attention_groups as ig
    from parity.rollout import pre_attention as pa
    from tests.bench.kv_kernels_sm90 import PRE_SIG
    for pdl in (True, False):
        cfg = ia.launch_config(False, {"pdl": pdl})
        ptx = assert_fits_without_spills(ig._int4_attn_groups_kernel, ia.groups_constants(cfg, 2, 128, True, True, True),
                                         {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}).asm["ptx"]
        body = ptx[ptx.index(".entry"):]
        wait = body.find("griddepcontrol.wait")
        assert (wait >= 0) == pdl
        if pdl:
            loads = [m.start() for m in re.finditer(r"\b(ld\.global|cp\.async)", body)]
            assert body.rfind("prefetch.global.L2", 0, loads[0]) >= 0 and wait < loads[0], "the wait after a load"
            assert body.rfind("prefetch.global.L2") < wait, "an L2 prefetch after the wait"
        const = {"D": 128, "HB": 16, "KB": 8, "KIND": kp.KIND_INT4, "HADAMARD": True, "QMODE": 1, "LOG2D": 7, "EAGER": False,
                 "PDL": pdl}
        sig = {**PRE_SIG, **dict.fromkeys(const, "constexpr")}
        k = triton.compile(ASTSource(fn=pa._pre_attention_kernel, signature=sig, constexprs=const), target=TARGET,
                           options={"num_warps": 4, "enable_fp_fusion": False})
        body = k.asm["ptx"][k.asm["ptx"].index(".entry"):]
        trigger = body.find("griddepcontrol.launch_dependents")
        assert (trigger >= 0) == pdl
        assert not pdl or trigger < body.index("ld.global"), "the trigger after a load"
