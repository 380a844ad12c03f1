"""The two-launch draw's kernels (parity.rollout.sampler_kernel) compiled for the H200 (sm_90a) by Triton's own
compiler, no GPU needed: both build at the block size the decode path launches, with registers and shared memory
that leave room for several programs an SM. Skipped without Triton (the project's CPU environment)."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

import re  # noqa: E402

import parity.rollout.sampler_kernel as sk  # noqa: E402
from tests.bench.kv_kernels_sm90 import report  # noqa: E402

STATS = {"x_ptr": "*fp32", "m_ptr": "*fp32", "s_ptr": "*fp32", "stride": "i32", "V": "i32", "nblk": "i32",
         "inv_t": "fp32"}
DRAW = {"x_ptr": "*fp32", "m_ptr": "*fp32", "s_ptr": "*fp32", "u_ptr": "*fp64", "tok_ptr": "*i64", "lp_ptr": "*fp32",
        "stride": "i32", "V": "i32", "nblk": "i32", "inv_t": "fp32"}


@pytest.mark.parametrize("V", [151_936, 1_028])
def test_both_kernels_build_for_sm90(V):
    nb = triton.next_power_of_2(triton.cdiv(V, sk.BLOCK))
    for name, fn, sig, const in (("block stats", sk._block_stats, STATS, {"BLOCK": sk.BLOCK}),
                                 ("draw", sk._draw, DRAW, {"BLOCK": sk.BLOCK, "NB": nb})):
        line = report(f"sampler {name}, V = {V}", fn, sig, const, {"num_warps": 4})
        regs, spill, smem = (int(re.search(rf"{k}\s+(\d+)", line).group(1)) for k in ("regs", "spill", "smem"))
        assert spill == 0 and regs <= 128 and smem <= 48 * 1024, line
