"""Time int8_triton's decode tiles on this GPU for the products the project's models run and write them into
platform/parity/precision/int8_tiles.json under the device's name: a decode state then takes its tile from the
table (checked once against the torch path) instead of compiling and timing every candidate at its start.

    PYTHONPATH=platform python3 tests/bench/gpu_pin_int8_tiles.py --out $OUT/int8_tiles.json

Products [N, K] (stacked q/k/v, o, stacked gate/up, down): the gpu preset's Countdown model (hidden 512, 8 heads
and 4 kv heads of 64, MLP 1536) and the Qwen3-0.6B shape of the decode benches (hidden 1024, 16 and 8 heads of 128,
MLP 3072); rows a run: the decode batch and its tail states' (rollout.compact_tail halves them down to 16).
Each shape is timed by `tune_decode` as a decode state does it (PARITY_INT8_TILES=timed: the table is ignored);
the file keeps the other devices' entries and writes the date, Triton and torch versions and the seconds taken.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

os.environ["PARITY_INT8_TILES"] = "timed"  # time every shape, whatever the table says now

import torch  # noqa: E402

from parity.precision import int8_triton as it  # noqa: E402

MODELS = {"countdown_gpu": [(1024, 512), (512, 512), (3072, 512), (512, 1536)],
          "qwen3_0.6b": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]}
ROWS = [16, 32, 64, 128, 256]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="rows a run, comma-separated (<= 256)")
    ap.add_argument("--table", default=str(it.TILES_FILE), help="the table to update")
    ap.add_argument("--out", required=True, help="where to write the updated table (copy it over --table)")
    a = ap.parse_args()
    if not torch.cuda.is_available() or not it.usable():
        raise SystemExit(f"needs a CUDA GPU where int8_triton is usable: {it.unusable_reason}")
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    t0 = time.perf_counter()
    tiles, seconds = {}, {}
    for m in (int(r) for r in a.rows.split(",")):
        for model, shapes in MODELS.items():
            t = time.perf_counter()
            for (mm, n, k), c in sorted(it.tune_decode(m, shapes, dev).items()):
                tiles[f"{mm},{n},{k}"] = list(it._tile(c))
            seconds[f"{model} m={m}"] = round(time.perf_counter() - t, 2)
            print(f"{model} m={m}: {seconds[f'{model} m={m}']} s", flush=True)
    table = json.loads(open(a.table).read()) if os.path.exists(a.table) else {}
    table.setdefault("about", "int8_triton decode tiles a device's tune_decode picked, by device name "
                     "(tests/bench/gpu_pin_int8_tiles.py); keys 'M,N,K', values [BLOCK_M, BLOCK_N, BLOCK_K, "
                     "num_stages, num_warps]")
    import triton
    table.setdefault("devices", {})[name] = {
        "date": datetime.date.today().isoformat(), "triton": triton.__version__, "torch": torch.__version__,
        "command": "PYTHONPATH=platform python3 tests/bench/gpu_pin_int8_tiles.py", "seconds": seconds,
        "total_s": round(time.perf_counter() - t0, 1), "tiles": dict(sorted(tiles.items()))}
    with open(a.out, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    print(f"{len(tiles)} tiles for {name} in {time.perf_counter() - t0:.1f} s -> {a.out}")


if __name__ == "__main__":
    main()
