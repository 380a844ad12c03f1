"""R3 routing decode: host memory of the naive vs the streaming decode (docs/ROUTING_REPLAY.md's table).

64 synthetic rollouts whose final routing tensor [64, 2048, 16 MoE layers, top-8] int64 is 128 MiB; ids
travel as uint8 (128 experts) through RoutingBatch.to_bytes/from_bytes. Each decode runs in its own
fresh subprocess; both are measured in this one run and must produce the same tensor (sha256).

  temp decode buffer = bytes of decoded-but-not-yet-copied responses held at once (DecodeStats)
  peak RSS           = the process's RSS high-water mark during the decode (VmHWM, reset just before)
  over baseline      = peak RSS - RSS just before the decode (baseline holds torch and the encoded input)
Goals: streaming temp buffer <= one rollout's share (final / 64); streaming peak over baseline <=
final tensor + 10%.

Run: OMP_NUM_THREADS=1 .venv/bin/python tests/bench/bench_moe_r3_decode.py
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import json
import subprocess
import sys

import numpy as np
import torch

from parity.moe import DecodeStats, RoutingBatch, decode_naive, decode_streaming

B, R, N_LAYERS, TOP_K, N_EXPERTS = 64, 2048, 16, 8, 128
MIB = 1024 * 1024
FINAL_BYTES = B * R * N_LAYERS * TOP_K * 8  # int64


def _lengths(rng: np.random.Generator) -> list[int]:
    lengths = rng.integers(1, R + 1, size=B).tolist()
    lengths[3] = lengths[17] = 0  # empty responses
    for i in (5, 22, 40, 63):
        lengths[i] = R + int(rng.integers(1, 512))  # longer than R: truncated on decode
    lengths[9] = R
    return lengths


def synthetic_routing(seed: int = 0) -> RoutingBatch:
    """Built in uint8 only (no wide temporaries that would leave freed heap inside the baseline RSS):
    top-k distinct ids per (token, layer) as a random start plus multiples of E / k, modulo E."""
    rng = np.random.default_rng(seed)
    stride = np.arange(TOP_K, dtype=np.uint8) * np.uint8(N_EXPERTS // TOP_K)
    responses = []
    for n in _lengths(rng):
        start = rng.integers(0, N_EXPERTS, size=(n, N_LAYERS, 1), dtype=np.uint8)
        responses.append((start + stride) % np.uint8(N_EXPERTS))
    return RoutingBatch(responses, N_LAYERS, TOP_K, N_EXPERTS)


def _trim_heap() -> None:
    """Hand freed heap pages back to the OS so the baseline RSS holds only live data."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> bool:
    try:  # Linux >= 4.0: writing 5 resets VmHWM to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return _status_kib("VmHWM") <= _status_kib("VmRSS") + 64


def child(mode: str) -> dict:
    wire = synthetic_routing().to_bytes()  # the transported form; arrays below are views of it
    routing = RoutingBatch.from_bytes(wire)
    gc.collect()
    _trim_heap()
    stats = DecodeStats()
    baseline_kib = _status_kib("VmRSS")
    reset_ok = _reset_peak_rss()
    if mode == "streaming":
        out = torch.empty((B, R, N_LAYERS, TOP_K), dtype=torch.int64)
        decode_streaming(routing, out, pad_value=-1, stats=stats)
    else:
        out = decode_naive(routing, R, pad_value=-1, dtype=torch.int64, stats=stats)
    peak_kib = _status_kib("VmHWM")
    digest = hashlib.sha256(out.numpy().tobytes()).hexdigest()
    return {"mode": mode, "baseline_mib": baseline_kib / 1024, "peak_mib": peak_kib / 1024,
            "temp_mib": stats.peak_temp_bytes / MIB, "final_mib": out.nbytes / MIB, "wire_mib": len(wire) / MIB,
            "peak_reset": reset_ok, "sha256": digest}


def _run_child(mode: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", mode], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} child failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    results = [_run_child(m) for m in ("naive", "streaming")]
    naive, stream = results
    if naive["sha256"] != stream["sha256"]:
        raise SystemExit("streaming and naive decode produced different tensors")
    final = FINAL_BYTES / MIB
    share = final / B
    print(f"final routing tensor [{B}, {R}, {N_LAYERS}, {TOP_K}] int64 = {final:.1f} MiB; one rollout's share "
          f"= {share:.1f} MiB; uint8 wire = {stream['wire_mib']:.1f} MiB; outputs identical (sha256)\n")
    print("| decode | temp decode buffer (MiB) | baseline RSS (MiB) | peak RSS (MiB) | peak - baseline (MiB) "
          "| peak - baseline - final (MiB) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        over = r["peak_mib"] - r["baseline_mib"]
        print(f"| {r['mode']} | {r['temp_mib']:.1f} | {r['baseline_mib']:.1f} | {r['peak_mib']:.1f} | {over:.1f} "
              f"| {over - final:.1f} |")
    temp_ok = stream["temp_mib"] <= share + 1e-9
    rss_ok = stream["peak_mib"] - stream["baseline_mib"] <= 1.1 * final
    print(f"\nstreaming temp buffer <= one rollout's share ({share:.1f} MiB): {'yes' if temp_ok else 'NO'}")
    print(f"streaming peak RSS <= baseline + final tensor + 10% ({1.1 * final:.1f} MiB): {'yes' if rss_ok else 'NO'}")
    print(f"naive / streaming peak over baseline: "
          f"{(naive['peak_mib'] - naive['baseline_mib']) / (stream['peak_mib'] - stream['baseline_mib']):.2f}x")
    if not (naive["peak_reset"] and stream["peak_reset"]):
        print("warning: could not reset VmHWM; peak RSS includes the set-up phase")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", choices=["naive", "streaming"])
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
    else:
        main()
