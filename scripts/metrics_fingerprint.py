"""Fingerprints of fixed short runs: a refactoring that must not change the numerics leaves them equal.

    python scripts/metrics_fingerprint.py --out fingerprints.json          # the runs below, 3 steps each
    python scripts/metrics_fingerprint.py --runs dual,dual_centered --out part.json
    python scripts/metrics_fingerprint.py --compare before.json after.json

Each run is `parity.commands.train.train` (the runner distributed.enabled asks for) on the CPU in float32 with one
torch thread, its own outputs folder and fixed seeds: the default experiment, the MoE one with routing replay, the
default with an INT8 W8A8 + INT4 KV rollout under score centering, the default under the dual and the centered
dual corrections and under score centering composed with TIS, and the dual correction with the trainer sharded
over two gloo ranks (Ray actors on a local Ray) (8 prompts x 8 samples after a 120-step warm start, so rewards are
not all 0 and the weights move). The fingerprint is the sha256 of every step's metrics (timings, `perf/*`, left out;
floats written with repr, so one ulp changes it) and of the final weights' bytes."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

RUNS = {
    "default": [],
    "moe_routing_replay": ["experiment=arith_tiny_moe"],
    "int8_int4kv_score_centering": ["+precision=w8a8_int8_kv_int4", "algorithm.correction.name=score_centering",
                                    "algorithm.policy_loss=reinforce", "rollout.topk_logprobs=32"],
    "dual": ["algorithm.correction.name=dual"],
    "dual_centered": ["algorithm.correction.name=dual_centered"],
    "score_centering_tis": ["algorithm.correction.name=score_centering+tis", "algorithm.policy_loss=reinforce",
                            "rollout.topk_logprobs=32"],
    "sharded_gloo_dual": ["algorithm.correction.name=dual", "trainer.shared_prefix=off", "distributed.enabled=true",
                          "distributed.num_rollout_workers=1", "distributed.trainer_workers=2",
                          "distributed.rollout_cpus=1", "distributed.trainer_cpus=1", "distributed.num_cpus=3"],
}
COMMON = ["model.dtype=float32", "trainer.device=cpu", "trainer.total_steps=3", "trainer.eval_every=3",
          "trainer.checkpoint_every=3", "trainer.prompts_per_step=8", "rollout.n=8", "model.warm_start.steps=120",
          "model.warm_start.eval_problems=8", "trainer.eval_problems=8", "eval.grade_workers=1", "trainer.seed=0"]
TIMING = ("perf/", "train/seconds", "seconds")


def fingerprint(name: str, overrides: list[str], outputs: Path) -> dict:
    import torch

    from parity.commands.train import train
    from parity.config import load_config

    torch.set_num_threads(1)
    cfg = load_config([f"outputs_dir={outputs}", *overrides, *COMMON, f"trainer.run_name=fp-{name}"])
    train(cfg)
    run = outputs / "runs" / f"fp-{name}"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    kept = [{k: repr(v) for k, v in sorted(r.items()) if not k.startswith(TIMING)} for r in rows]
    weights = sorted((run / "checkpoints").rglob("*.safetensors"))
    h = hashlib.sha256()
    for w in weights:
        h.update(w.read_bytes())
    return {"metrics_sha256": hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest(),
            "weights_sha256": h.hexdigest(), "steps": sum(1 for r in rows if "reward/mean" in r),
            "weight_files": [str(w.relative_to(run)) for w in weights], "overrides": overrides,
            # what the hashes cover, readable: a run whose rewards are all 0 takes no gradient step
            "reward_mean": [r["reward/mean"] for r in rows if "reward/mean" in r],
            "grad_norm": [r.get("train/grad_norm") for r in rows if "reward/mean" in r]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None)
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--compare", nargs=2, default=None)
    a = p.parse_args()
    if a.compare:
        before, after = (json.loads(Path(f).read_text()) for f in a.compare)
        keys = ("metrics_sha256", "weights_sha256")
        same = all(before[k][h] == after.get(k, {}).get(h) for k in before for h in keys)
        for k in before:
            equal = all(before[k][h] == after.get(k, {}).get(h) for h in keys)
            print(k, "equal" if equal else f"DIFFERENT: {before[k]} vs {after.get(k)}")
        return 0 if same else 1
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.runs.split(","):
            out[name] = fingerprint(name, RUNS[name], Path(tmp))
            print(name, out[name]["metrics_sha256"][:16], out[name]["weights_sha256"][:16], flush=True)
    text = json.dumps(out, indent=1)
    if a.out:
        Path(a.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
