"""The rotated int4 decode attention (parity.rollout.int4_attention) and the fused pre-attention kernel
(parity.rollout.pre_attention) under Triton's CPU interpreter (TRITON_INTERPRET=1): the checks of
tests/kv_packed_checks.py that tests/test_kv_packed_cuda.py runs on the device, here on CPU tensors (the inline
PTX byte unpacking is CUDA-only; the interpreter runs the same values through plain Triton operations). Skipped
without Triton (the project's CPU environment); with it:

    TRITON_INTERPRET=1 python -m pytest -q tests/test_int4_attention_interpret.py
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":  # Triton fixes interpretation when its kernels are defined
    pytest.skip("set TRITON_INTERPRET=1 before Python starts to run the kernels under Triton's interpreter",
                allow_module_level=True)

from parity.rollout import int4_attention as ia  # noqa: E402
from tests.kv_packed_checks import check_int4_attention, check_pre_attention  # noqa: E402

CPU = torch.device("cpu")
# bf16 queries and output: the output's own bf16 rounding is ~1e-3 (an indexing or masking error gives order 1)
BOUND = {torch.bfloat16: 4e-3, torch.float32: 1e-5}


@pytest.fixture(scope="module", autouse=True)
def gpu_rounding():
    from tests.triton_interpret import patch_casts
    patch_casts()


def _shapes(seed: int, n: int) -> list[tuple]:
    """(B, n_kv, G, S, L, slot): random rows, KV heads, group sizes (1, 2, 3, 4, 8), lengths, the step's slot."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        S = int(torch.randint(16, 330, (1,), generator=g))
        L = int(torch.randint(1, S + 1, (1,), generator=g))
        G = [1, 2, 3, 4, 8][int(torch.randint(0, 5, (1,), generator=g))]
        out.append((int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 3, (1,), generator=g)), G, S, L,
                    int(torch.randint(0, L, (1,), generator=g))))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("hadamard", [True, False], ids=["rotated", "plain"])
def test_against_float64_on_random_lengths_and_heads(dtype, hadamard):
    shapes = [(2, 2, 2, 150, 150, 149), (3, 1, 4, 96, 70, 51)] + _shapes(11 if hadamard else 12, 2)
    for i, shape in enumerate(shapes):
        D = 128 if i % 2 == 0 else 64
        # one split, and splits merged by the last program (programs_per_sm large: as many splits as tiles)
        # and the loop's other forms (int4_attention.CONFIG's "blocks", "merge" and "row_scale"), each way
        for cfg in ({"programs_per_sm": 0}, {"programs_per_sm": 10**6, "ROWS": 16},
                    {"programs_per_sm": 0, "blocks": False}, {"programs_per_sm": 10**6, "blocks": False},
                    {"programs_per_sm": 0, "merge": True}, {"programs_per_sm": 10**6, "blocks": False, "merge": True},
                    {"programs_per_sm": 10**6, "row_scale": True},
                    {"programs_per_sm": 0, "blocks": False, "row_scale": True},
                    # the warp-split form (int4_attention_warps; the exact route ignores it), with and without
                    # the query's parts in one product, one split and many
                    {"programs_per_sm": 0, "warp_slots": 16}, {"programs_per_sm": 10**6, "warp_slots": 16},
                    {"programs_per_sm": 0, "warp_slots": 16, "merge": True},
                    {"programs_per_sm": 10**6, "warp_slots": 16, "merge": True, "num_warps": 2},
                    # its output rotation in butterflies (CONFIG's "fwht"), unmerged and one split, merged, two
                    # warps and many splits
                    {"programs_per_sm": 0, "warp_slots": 16, "fwht": True},
                    {"programs_per_sm": 10**6, "warp_slots": 16, "merge": True, "num_warps": 2, "fwht": True},
                    # the slot-groups form (int4_attention_groups; CONFIG's "groups"), one split and many
                    {"programs_per_sm": 0, "warp_slots": 64, "merge": True, "num_warps": 1, "groups": True},
                    {"programs_per_sm": 10**6, "warp_slots": 32, "merge": True, "num_warps": 1, "groups": True,
                     "prefetch_ok": True}):
            cfg = {**ia.BLOCKS_FORM, **cfg}  # changes to the blocks form (the pinned CONFIG: the next test)
            err, sim = check_int4_attention(D, dtype, CPU, shape, hadamard, seed=i, config=cfg)
            assert err < BOUND[dtype], (shape, D, cfg, err, sim)


@pytest.mark.parametrize("shape,D", [((2, 1, 8, 100, 90, 80), 128), ((1, 1, 16, 70, 70, 60), 128),
                                     ((2, 2, 5, 64, 40, 39), 64), ((1, 2, 6, 40, 33, 30), 128)],
                         ids=["G8", "G16-unmerged", "G5", "G6"])
def test_warp_split_form_at_larger_groups(shape, D):
    """The warp-split form where the merged parts fill all 16 rows (G = 8), where they cannot merge (G = 16: 16
    head rows, at most 32 slots a warp) and at group sizes that are not powers of two; one split and many."""
    for cfg in (dict(ia.CONFIG), {**ia.CONFIG, "programs_per_sm": 10**6},  # the pinned CONFIG, one split and many
                {"warp_slots": 16, "merge": True, "programs_per_sm": 0},
                {"warp_slots": 64, "merge": True, "programs_per_sm": 10**6, "num_warps": 2},
                {"warp_slots": 16, "programs_per_sm": 10**6}, {"warp_slots": 32, "merge": True, "num_warps": 1},
                {"warp_slots": 16, "merge": True, "num_warps": 1, "programs_per_sm": 10**6},
                # the pinned output rotation (butterflies) with two warps and many splits, and unmerged
                {**ia.CONFIG, "num_warps": 2, "warp_slots": 32, "programs_per_sm": 10**6},
                {**ia.CONFIG, "merge": False, "warp_slots": 32},
                # the slot-groups form (G = 16 falls back to the warp-split form), one split and many
                {**ia.CONFIG, "groups": True}, {**ia.CONFIG, "groups": True, "programs_per_sm": 10**6}):
        cfg = {**ia.BLOCKS_FORM, **cfg}  # the others: changes to the blocks form
        err, sim = check_int4_attention(D, torch.bfloat16, CPU, shape, True, seed=3, config=cfg)
        assert err < BOUND[torch.bfloat16], (shape, D, cfg, err, sim)


def test_the_key_mask_loaded_an_iteration_ahead_changes_nothing():
    """The warp-split form's "prefetch_ok" (each iteration loads the next one's key mask): the same output bit for
    bit as the mask loaded in its own iteration, on rows with left padding past the first iterations' slots, one
    split and many, one warp and two, and in the slot-groups form; within the float64 bound."""
    from tests.kv_packed_checks import int4_attention_outputs
    for i, (shape, D) in enumerate([((3, 2, 2, 150, 150, 149), 128), ((2, 1, 4, 90, 61, 60), 64)]):
        for cfg in ({"warp_slots": 16, "merge": True, "num_warps": 1, "programs_per_sm": 0},
                    {"warp_slots": 16, "merge": True, "num_warps": 2, "programs_per_sm": 10**6},
                    {"warp_slots": 32, "merge": True, "num_warps": 1, "groups": True, "programs_per_sm": 10**6}):
            # masked slots beyond the first iteration's 16 a warp
            outs = int4_attention_outputs(shape, D, CPU, [{**ia.CONFIG, **cfg, "prefetch_ok": pf} for pf in (False, True)],
                                          seed=i, left_pad=40)
            assert torch.equal(outs[0], outs[1]), (shape, cfg)
            err, sim = check_int4_attention(D, torch.bfloat16, CPU, shape, True, seed=i,
                                            config={**ia.CONFIG, **cfg, "prefetch_ok": True})
            assert err < BOUND[torch.bfloat16], (shape, cfg, err, sim)


def test_the_slot_groups_v_product_a_group_at_a_time_changes_nothing():
    """The slot-groups form's "group_v" (each group's V product on its own instead of one block-diagonal product):
    the same output bit for bit, at 2, 3 and 4 query heads a KV head (4, 2 with a padded head, and 2 groups), one
    split and many."""
    from tests.kv_packed_checks import int4_attention_outputs
    for i, (shape, D) in enumerate([((2, 2, 2, 150, 150, 149), 128), ((2, 1, 3, 100, 90, 80), 128),
                                    ((3, 1, 4, 96, 70, 51), 64)]):
        for pps in (0, 10**6):
            outs = int4_attention_outputs(shape, D, CPU, [{**ia.CONFIG, "groups": True, "group_v": gv,
                                                           "programs_per_sm": pps} for gv in (False, True)], seed=i)
            assert torch.equal(outs[0], outs[1]), (shape, pps)


def test_split_plan():
    from parity.rollout.int4_attention import slots_per_iteration, split_plan
    assert slots_per_iteration(2, 16) == 128 and slots_per_iteration(1, 16) == 256 and slots_per_iteration(4, 16) == 64
    assert split_plan(64, 8, 384, CPU, 128, 8) == (3, 128)  # 512 (row, head) pairs, 1056 wanted: three splits
    assert split_plan(64, 8, 384, CPU, 128, 1) == (1, 384)
    assert split_plan(1, 8, 384, CPU, 128, 8) == (3, 128)  # never more splits than iterations
    assert split_plan(2, 2, 1000, CPU, 64, 8) == (16, 64)


@pytest.mark.parametrize("kind,hadamard,rotated", [("int4_per_token_head", True, True),
                                                   ("int4_per_token_head", False, True),
                                                   ("fp8_per_token_head", False, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("eager", [False, True], ids=["rounded-once", "eager-rounding"])
def test_fused_pre_attention(kind, hadamard, rotated, dtype, eager):
    """Against the step's functions as Inductor rounds them (the rotary once) and, with the kernel's eager rounding,
    against decode_layers' _rms and _rope run eagerly (x cos, rotate_half(x) sin and their sum each rounded)."""
    r = check_pre_attention(kind, hadamard, 64, dtype, CPU, rotated, seed=3, eager=eager)
    # the torch reference rounds the same float32 operations: equal here (the GPU's rsqrt may move a code by one)
    assert r["k_codes_differing"] <= 0.01, r
    assert r["k_value_max_rel"] < 0.1, r
    key = "q_rotated_rel" if rotated else "q_rel"
    assert r[key] < (1e-6 if dtype == torch.float32 else 1e-2), r


def test_the_pre_attention_rounding_modes_differ():
    """The two roundings of the rotary disagree by an ulp on a fifth of bf16 values (0.207 here): a step whose layer
    functions run eagerly must pass eager_rounding, or its K and q are not the simulated cache's."""
    from tests.kv_packed_checks import pre_attention_rounding_modes
    assert pre_attention_rounding_modes(CPU) > 0.05
