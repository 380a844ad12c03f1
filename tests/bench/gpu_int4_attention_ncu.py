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
Needs torch and triton only.
"""

from __future__ import annotations

import torch
from gpu_bench_common import BATCH, SHAPE
from gpu_int4_decode_variants import event_us, timing_inputs
from gpu_read_ceiling import same_layout_call

L = 256


def main() -> None:
    from parity.rollout import decode_attention as da
    from parity.rollout import int4_attention as ia
    if not torch.cuda.is_available():
        print(f"{__file__}: needs a CUDA device; nothing launched on this machine")
        return
    dev, q, qs, key_ok, scale, kv, int4, fp8 = timing_inputs(L, seed=3)
    del kv, fp8
    B, n_kv = BATCH, SHAPE["num_key_value_heads"]
    st = torch.tensor([L - 1], device=dev)
    out = torch.empty(B * n_kv, dtype=torch.int32, device=dev)

    def attention(c):
        return ia.int4_attention(qs, c.k, c.v, c.k_scale, c.v_scale, key_ok, st, L, scale, True, torch.bfloat16,
                                 da._workspace(int4), {})

    for c in int4.layers[:3]:
        attention(c)
    for c in int4.layers[:3]:
        same_layout_call(c, L, L, 4, 128, out)()
    torch.cuda.synchronize()
    bytes_ = L * 2 * B * n_kv * int4.codec.bytes_per_token_head()
    att = event_us([lambda c=c: attention(c) for c in int4.layers])
    rd = event_us([same_layout_call(c, L, L, 4, 128, out) for c in int4.layers])
    print(f"config {ia.CONFIG}; L = {L}, {bytes_ / 1e6:.1f} MB a launch: attention {att:.2f} us "
          f"({bytes_ / att / 1e3:.0f} GB/s), read {rd:.2f} us ({bytes_ / rd / 1e3:.0f} GB/s), {att / rd:.2f}x")


if __name__ == "__main__":
    main()
