"""The INT4 decode bench's length sweep on CPU: the fit that splits a kernel's time into a fixed part and a streaming
rate, against hand computations, and the bookkeeping of its A/B passes (tests/bench/gpu_int4_decode_variants.py;
the timings themselves need a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))

from gpu_int4_decode_variants import fixed_and_streaming, line_fit  # noqa: E402


def test_line_fit_by_hand() -> None:
    # exact line 4 + 3/64 x
    a, b = line_fit([(128, 10.0), (256, 16.0), (384, 22.0)])
    assert a == pytest.approx(4.0, abs=1e-12) and b == pytest.approx(6 / 128, abs=1e-15)
    # not on a line: mean x 2, mean y 3, sxy = (-1)(-3) + 0 + (1)(2) = 5, sxx = 2: b = 2.5, a = 3 - 2 x 2.5 = -2
    assert line_fit([(1, 0.0), (2, 4.0), (3, 5.0)]) == pytest.approx((-2.0, 2.5))


def test_fixed_and_streaming_by_hand() -> None:
    # batch 64 x 8 KV heads, K and V of 68 bytes a token-head: 69,632 bytes a slot; 6 us every 128 slots is
    # 69,632 / (6 / 128) bytes a microsecond = 1,485.5 GB/s; 4 us at L = 0; 2 TB/s at L = 256 is 8.91 us
    bps = 2 * 64 * 8 * 68
    r = fixed_and_streaming({256: 16.0, 128: 10.0, 384: 22.0}, bps)
    assert r["fixed_us"] == 4.0
    assert r["streaming_GBps"] == pytest.approx(1485.5, abs=0.05)
    assert r["max_residual_us"] == 0.0
    assert r["us_for_2TBps_at_L256"] == pytest.approx(8.91, abs=0.005)
    assert list(r["us"]) == ["128", "256", "384"]
    # a kernel whose time does not grow has no streaming rate
    assert fixed_and_streaming({128: 5.0, 256: 5.0}, bps)["streaming_GBps"] is None


def test_every_variant_is_named_by_its_own_configuration() -> None:
    """A variant's name says what it launched whatever CONFIG is pinned to (a name once kept an old default's
    programs per SM after CONFIG changed), and the first variant is the pinned CONFIG."""
    from gpu_int4_decode_variants import VARIANTS, variant_name

    from parity.rollout.int4_attention import BLOCKS_FORM, CONFIG
    assert list(VARIANTS.values())[0] == CONFIG
    assert variant_name(CONFIG) == "ws64-warps1-stages3-pps1-merge-prefetchok-fwht-groups-groupv-l2pf64-quad"
    assert variant_name(BLOCKS_FORM) in VARIANTS
    for name, cfg in VARIANTS.items():
        assert set(CONFIG) <= set(cfg) and name == variant_name(cfg)
    assert variant_name({**BLOCKS_FORM, "programs_per_sm": 8, "maxnreg": 168, "asm": False}) == \
        "rows16-warps4-stages2-pps8-reg168-noasm-blocks"
    assert variant_name({**BLOCKS_FORM, "warp_slots": 32, "merge": True, "num_warps": 2}) == \
        "ws32-warps2-stages2-pps1-merge"
    assert len({tuple(sorted(c.items())) for c in VARIANTS.values()}) == len(VARIANTS)  # no two alike


def test_the_kernel_route_peer_is_timed_on_its_route_and_divides_every_row(monkeypatch) -> None:
    """The INT4 bench's BF16 peer on the raw-value kernel: its pass runs with PARITY_PLAIN_ATTENTION=kernel, the
    switch is restored after, the main rows are kept and each summary row gets its ratio to the peer."""
    import os

    import gpu_bench_kv
    import gpu_int4_decode_variants as g

    seen = []

    def fake_rows(d, reps, rows=None, budget_batches=True, teacher_forced=True):
        seen.append((os.environ.get("PARITY_PLAIN_ATTENTION"), rows, teacher_forced))
        g.RESULTS["kv"] = {"bf16": {"tok_s_b64": 25000.0}}

    monkeypatch.setattr(gpu_bench_kv, "kv_rows", fake_rows)
    monkeypatch.setattr(g, "dump", lambda: None)
    monkeypatch.setenv("PARITY_PLAIN_ATTENTION", "torch")
    main = {"summary": {"bf16": {"tok_s_b64": 20000.0}, "int8_w8a8_int4kv": {"tok_s_b64": 30000.0}}}
    monkeypatch.setitem(g.RESULTS, "kv", main)
    g.kernel_route_peer("model", 3, main)
    assert seen == [("kernel", [("bf16", "bf16", "bf16", True)], False)]
    assert os.environ["PARITY_PLAIN_ATTENTION"] == "torch" and g.RESULTS["kv"] is main
    assert main["bf16_kernel_route_tok_s_b64"] == 25000.0
    assert main["summary"]["bf16"]["over_bf16_kernel_route_b64"] == 0.8
    assert main["summary"]["int8_w8a8_int4kv"]["over_bf16_kernel_route_b64"] == 1.2


def test_the_fused_pre_attention_ab_alternates_the_switch_and_restores_it(monkeypatch) -> None:
    """The INT4 bench's --pre-ab: BF16 and W8A8 + INT4 rows with cuda_decode._FUSED_PRE on, off, on, off; the switch
    is restored after; each setting's ratio is its mean INT4 tok/s over its mean BF16 tok/s (by hand below)."""
    import gpu_bench_kv
    import gpu_int4_decode_variants as g

    import parity.rollout.cuda_decode as cd
    seen = []
    tok_s = iter([(20000.0, 34000.0), (21000.0, 29000.0), (22000.0, 36000.0), (19000.0, 30000.0)])

    def fake_rows(d, reps, rows=None, budget_batches=True, teacher_forced=True):
        seen.append((cd._FUSED_PRE, [r[0] for r in rows], budget_batches, teacher_forced))
        bf16, int4 = next(tok_s)
        g.RESULTS["kv"] = {"bf16": {"tok_s_b64": bf16},
                           "int8_w8a8_int4kv": {"tok_s_b64": int4, "kv_kernel": {"fused_pre_attention": cd._FUSED_PRE}}}

    monkeypatch.setattr(gpu_bench_kv, "kv_rows", fake_rows)
    monkeypatch.setattr(g, "build_model_dir", lambda: "model")
    monkeypatch.setattr(g, "dump", lambda: None)
    monkeypatch.setattr(cd, "_FUSED_PRE", False)
    g.pre_ab(3)
    assert [s[0] for s in seen] == [True, False, True, False] and cd._FUSED_PRE is False
    assert all(s[1:] == (["bf16", "int8_w8a8_int4kv"], False, False) for s in seen)
    ab = g.RESULTS.pop("pre_ab")
    assert "kv" not in g.RESULTS
    assert ab["int8_w8a8_int4kv_fused"] == [34000.0, 36000.0] and ab["bf16_unfused"] == [21000.0, 19000.0]
    assert ab["over_bf16_fused"] == pytest.approx(35000 / 21000) and ab["over_bf16_unfused"] == pytest.approx(1.475)
    assert ab["kv_kernel_fused"] == {"fused_pre_attention": True}
