"""The INT4 attention and a plain read of the same bytes, launched for Nsight Compute: where the attention's time goes.

    PYTHONPATH=$PWD/platform:$PWD:$PWD/tests/bench ncu --clock-control none -k regex:"_int4_attn|_read_rows" \\
        --launch-skip 1 --launch-count 4 --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats \\
        --section InstructionStats --section SourceCounters python3 tests/bench/gpu_int4_attention_ncu.py

At the bench's shape (batch 64, 8 KV heads, 2 query heads a KV head, head dim 128, L = 256 attended slots, 17.8 MB
of codes and scale words a launch): the pinned rotated INT4 attention (int4_attention.CONFIG) three times, then
tests/bench/gpu_read_ceiling.py's read of the same bytes in the same layout and grid (the fastest form there: 4 warps,
128 slots a step) three times, each on its own layer's cache. Without ncu it times both (a CUDA graph per kernel,
gpu_int4_decode_variants.event_us) and prints them, so a run without the profiler still says what it launched.

    ... python3 tests/bench/gpu_int4_attention_ncu.py --ab --out $OUT/attention_ab.json

times instead the pinned configuration against the changes in AB (each checked first against a float64 attention,
tests/kv_packed_checks.check_int4_attention, and for the same output as the pinned one on the timing inputs, bit for
bit), in turn, three rounds, at L = 256 and 384; `--changes '{"name": {"num_warps": 2}, ...}'` times those
changes instead of AB. Needs torch and triton only.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from gpu_bench_common import BATCH, SHAPE
from gpu_int4_decode_variants import event_us, timing_inputs
from gpu_read_ceiling import same_layout_call

L = 256
# changes to the pinned configuration (int4_attention.CONFIG) the A/B times
AB = {"warp-split form, butterflies (pinned before the slot groups)": {"groups": False},
      "slot groups, one block-diagonal V product, no L2 prefetch": {"group_v": False, "l2_slots": 0},
      "slot groups, no L2 prefetch": {"l2_slots": 0},
      "slot groups, two iterations' slots prefetched": {"l2_slots": 128},
      "slot groups, V operands unpacked one at a time": {"quad_unpack": False},
      "launched as a programmatic dependent of the one before": {"pdl": True}}


def attention_call(qs, key_ok, scale: float, int4, c, L: int, cfg: dict):
    """One launch of the INT4 attention over layer cache `c` of `int4` at L slots with launch changes `cfg`, as a
    callable (for event_us and the checks)."""
    from parity.rollout import decode_attention as da
    from parity.rollout import int4_attention as ia
    st = torch.tensor([L - 1], device=c.k.device)
    return lambda: ia.int4_attention(qs, c.k, c.v, c.k_scale, c.v_scale, key_ok, st, L, scale, True, torch.bfloat16,
                                     da._workspace(int4), cfg)


def ab(out_path: str, changes: dict | None = None) -> None:
    """The pinned configuration and each change in `changes` (default AB), checked, then timed in turn (three
    rounds) at L = 256, 384."""
    from parity.rollout import int4_attention as ia
    from tests.kv_packed_checks import check_int4_attention
    dev, q, qs, key_ok, scale, kv, int4, fp8 = timing_inputs(384, seed=3)
    del kv, fp8
    B, n_kv, D = BATCH, SHAPE["num_key_value_heads"], SHAPE["head_dim"]
    key_ok[:, :5] = False  # some masked slots (left padding), so that the mask's load matters to the result
    changes = AB if changes is None else changes
    configs = {"pinned": {}, **changes}
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "pinned": dict(ia.CONFIG),
                 "changes": changes, "key_ok": "slots 0-4 masked in every row", "checks": {}, "us": {}}

    def call(c, L, cfg):
        return attention_call(qs, key_ok, scale, int4, c, L, cfg)
    ref = {L: call(int4.layers[0], L, {})().clone() for L in (256, 384)}
    for name, cfg in list(configs.items()):
        try:
            errs = [check_int4_attention(D, torch.bfloat16, dev, shp, True, seed=i, config=cfg)[0]
                    for i, shp in enumerate([(B, n_kv, 2, 384, 384, 383), (B, n_kv, 2, 384, 256, 200),
                                             (3, 5, 2, 300, 77, 70)])]
        except Exception as e:  # a configuration that does not compile or launch: recorded, not timed
            if name == "pinned":
                raise
            res["checks"][name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{name}: {res['checks'][name]}", flush=True)
            del configs[name]
            continue
        diff = torch.cat([(call(int4.layers[0], L, cfg)().float() - ref[L].float()).abs().view(-1, D) for L in ref])
        want = torch.cat([ref[L].float().abs().view(-1, D) for L in ref])
        ulp = want.clamp_min(1e-30) * 2.0 ** -8  # a bf16 ulp of each element
        # the largest difference against its head's largest output (a rounding difference: a bf16 ulp of that,
        # 2^-8, or less; a wrong weight or slot: far more), and the share of heads with any difference
        heads, top = diff.amax(1), want.amax(1).clamp_min(1e-30)
        res["checks"][name] = {"max_rel_err_vs_f64": max(errs), "same_output_as_pinned": bool((diff == 0).all()),
                               "elements_differing": round(float((diff > 0).float().mean()), 5),
                               "max_diff_in_bf16_ulps": round(float((diff / ulp).max()), 2),
                               "max_diff_over_head_max": float((heads / top).max()),
                               "heads_differing": round(float((heads > 0).float().mean()), 5)}
        print(f"{name}: {res['checks'][name]}", flush=True)
    for _ in range(3):
        for name, cfg in configs.items():
            for Lx in (256, 384):
                us = event_us([call(c, Lx, cfg) for c in int4.layers])
                res["us"].setdefault(name, {}).setdefault(str(Lx), []).append(us)
    slot_bytes = 2 * B * n_kv * int4.codec.bytes_per_token_head()
    res["summary"] = {name: {f"L{Lx}_us_min": min(v[str(Lx)]) for Lx in (256, 384)} for name, v in res["us"].items()}
    for name, v in res["summary"].items():
        v["L256_GBps"] = round(256 * slot_bytes / v["L256_us_min"] / 1e3, 1)
        v["L256_over_pinned"] = round(v["L256_us_min"] / res["summary"]["pinned"]["L256_us_min"], 3)
        print(f"{name:20s} {v}", flush=True)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


def main() -> None:
    from parity.rollout import int4_attention as ia
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ab", action="store_true", help="time the pinned configuration against the changes in AB")
    p.add_argument("--changes", type=json.loads, default=None,
                   help='with --ab: the changes to time instead of AB, as JSON {"name": {"key": value, ...}, ...}')
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "attention_ab.json"))
    a = p.parse_args()
    if not torch.cuda.is_available():
        print(f"{__file__}: needs a CUDA device; nothing launched on this machine")
        return
    if a.ab:
        ab(a.out, a.changes)
        return
    dev, q, qs, key_ok, scale, kv, int4, fp8 = timing_inputs(L, seed=3)
    del kv, fp8
    B, n_kv = BATCH, SHAPE["num_key_value_heads"]
    out = torch.empty(B * n_kv, dtype=torch.int32, device=dev)
    attention = [attention_call(qs, key_ok, scale, int4, c, L, {}) for c in int4.layers]
    for launch in attention[:3]:
        launch()
    for c in int4.layers[:3]:
        same_layout_call(c, L, L, 4, 128, out)()
    torch.cuda.synchronize()
    bytes_ = L * 2 * B * n_kv * int4.codec.bytes_per_token_head()
    att = event_us(attention)
    rd = event_us([same_layout_call(c, L, L, 4, 128, out) for c in int4.layers])
    print(f"config {ia.CONFIG}; L = {L}, {bytes_ / 1e6:.1f} MB a launch: attention {att:.2f} us "
          f"({bytes_ / att / 1e3:.0f} GB/s), read {rd:.2f} us ({bytes_ / rd / 1e3:.0f} GB/s), {att / rd:.2f}x")


if __name__ == "__main__":
    main()
