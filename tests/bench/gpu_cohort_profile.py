"""One format's cohort call against its members' own calls, alone on the device: where a cohort's time goes.

A cohort (parity.rollout.cohort) decodes N runs' rows as one batch; its call lasts until the longest of all N x 128
rows ends. This bench builds N engines of one `gpu` preset format on one warm start, then for each of a few calls
(the same held-out prompts for every run, each run its own sampling seed) times every member's own call one after
the other and the cohort's call of all of them, and counts the decode steps of each (a call's longest response).
Printed and written: seconds and steps of each, milliseconds per step, and the cohort's time over the members'
summed time. Per-step cost near one member's means the batch is cheap and the lockstep is what costs; per-step
cost near N members' means the batched products are.

    python3 tests/bench/gpu_cohort_profile.py --model-dir MODEL --format w4a4+int4kv --members 9 --calls 3 \\
        --out cohort_profile.json

`--extra rollout.compact_tail=true`: a call's unfinished rows move to smaller states once most have ended (each
row's `tail_rows` record says which sizes the cohort's call went through).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "platform"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--format", default="w4a4+int4kv", help="an arm name's first word in the gpu preset")
    ap.add_argument("--members", type=int, default=9)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--extra", default="", help="more overrides, space-separated (e.g. a shorter rollout on CPU)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from parity.config import load_config
    from parity.data.prompts import render_prompt
    from parity.data.tasks import heldout_problems
    from parity.rollout import build_engine, sampling_spec
    from parity.rollout.cohort import CohortEngine
    from parity.study.presets import PRESETS

    preset = PRESETS["gpu"]
    arm = next((x for x in preset.arms if x.name.split(" / ")[0] == a.format), None)
    if arm is None:
        sys.exit(f"--format {a.format!r}: not a format of the gpu preset "
                 f"({sorted({x.name.split(' / ')[0] for x in preset.arms})})")
    pre = [o for o in arm.overrides(preset.topk) if o.startswith(("+precision", "rollout."))]
    base = [o for o in preset.base if o.startswith(("trainer.", "data.", "rollout.", "model."))]
    cfg = load_config([f"experiment={preset.experiment}", *base, f"model.path={a.model_dir}",
                       f"trainer.device={a.device}", *pre, *a.extra.split()])
    tok = AutoTokenizer.from_pretrained(a.model_dir)
    engines = [build_engine(cfg, a.model_dir, reference_dir=a.model_dir) for _ in range(a.members)]
    cohort = CohortEngine(engines)
    problems = heldout_problems(cfg, 1024)
    per_call = int(cfg.trainer.prompts_per_step)

    def sync() -> None:
        if torch.cuda.is_available() and a.device.startswith("cuda"):
            torch.cuda.synchronize()

    def calls_of(i: int) -> list[tuple]:
        chunk = problems[i * per_call:(i + 1) * per_call]
        ids = [tok(render_prompt(cfg.data.prompt_template, p.problem))["input_ids"] for p in chunk]
        return [(ids, sampling_spec(cfg, seed=100 * i + k), list(range(len(chunk)))) for k in range(a.members)]

    def steps(b) -> int:
        return int(b.response_mask.sum(-1).max())

    t0 = time.time()
    warm = calls_of(0)
    engines[0].generate(*warm[0])  # compilation and capture of one engine; the cohort's own below
    cohort.generate(warm)
    sync()
    warmup_s = time.time() - t0
    print(f"warm-up (compile, capture): {warmup_s:.0f} s", flush=True)
    rows = []
    for i in range(1, a.calls + 1):
        cs = calls_of(i)
        own_s, own_steps = [], []
        for eng, c in zip(engines, cs):
            sync()
            t = time.perf_counter()
            b = eng.generate(*c)
            sync()
            own_s.append(time.perf_counter() - t)
            own_steps.append(steps(b))
        sync()
        t = time.perf_counter()
        bs = cohort.generate(cs)
        sync()
        co_s = time.perf_counter() - t
        co_steps = max(steps(b) for b in bs)
        row = {"call": i, "own_s": own_s, "own_steps": own_steps, "own_ms_per_step": [1e3 * s / max(n, 1) for s, n in
                                                                                       zip(own_s, own_steps)],
               "cohort_s": co_s, "cohort_steps": co_steps, "cohort_ms_per_step": 1e3 * co_s / max(co_steps, 1),
               "cohort_over_own_sum": co_s / sum(own_s), "rows_a_member": bs[0].responses.shape[0],
               "tokens": sum(int(b.response_mask.sum()) for b in bs), "decode_path": bs[0].meta.get("decode_path"),
               "tail_rows": bs[0].meta.get("decode_tail_rows")}
        rows.append(row)
        print(f"call {i}: members alone {sum(own_s):.2f} s in all ({min(own_steps)}-{max(own_steps)} steps, "
              f"{min(row['own_ms_per_step']):.1f}-{max(row['own_ms_per_step']):.1f} ms a step); cohort {co_s:.2f} s, "
              f"{co_steps} steps, {row['cohort_ms_per_step']:.1f} ms a step: {row['cohort_over_own_sum']:.2f}x the "
              f"members' sum [{row['decode_path']}]", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
                                           "format": a.format, "members": a.members, "device": a.device,
                                           "env": {k: v for k, v in os.environ.items() if k.startswith("PARITY_")},
                                           "warmup_s": round(warmup_s, 1),
                                           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                                           "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
