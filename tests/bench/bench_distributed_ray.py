"""Steps/s of the RL loop over Ray with 1 vs 2 rollout workers (and 2 with one-step off-policy overlap), and Ray's overhead against the in-process loop
on the same work (same config, seeds and steps), printed from one run.

Each variant trains the same quick run; the per-step figure is the median of perf/step_s over the steps after
the first (steady state: actors up, caches warm). Start-up (Ray, actors, first step) is reported on its own.
One local Ray serves both distributed variants. The variants are run alternately for --rounds rounds and the
medians over rounds are printed; on a shared machine, repeat when another process took the cores.

Run: OMP_NUM_THREADS=1 .venv/bin/python tests/bench/bench_distributed_ray.py [--steps 6] [--prompts 8] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from parity.commands.train import train  # noqa: E402
from parity.config import load_config  # noqa: E402
from parity.training.loop import MetricsLog  # noqa: E402
from parity.training.warm_start import prepare_model  # noqa: E402


def _cfg(outputs: str, args: argparse.Namespace, name: str, *extra: str):
    return load_config([
        f"outputs_dir={outputs}", "model.warm_start.steps=30", "model.warm_start.eval_problems=16",
        "trainer.eval_problems=16", "trainer.eval_every=0", "trainer.checkpoint_every=0", "eval.grade_workers=1",
        f"trainer.total_steps={args.steps}", f"trainer.prompts_per_step={args.prompts}", "rollout.n=4",
        f"rollout.max_new_tokens={args.max_new_tokens}", "algorithm.correction.name=dual",
        f"trainer.run_name={name}", *extra])


def _steady(run_dir: str, key: str) -> float:
    rows = [r for r in MetricsLog(Path(run_dir) / "metrics.jsonl").read() if key in r]
    return statistics.median(r[key] for r in rows[1:]) if len(rows) > 1 else float("nan")


def _variant(label: str, fn, cfg) -> dict:
    t = time.perf_counter()
    summary = fn(cfg)
    wall = time.perf_counter() - t
    step_s = _steady(summary["run_dir"], "perf/step_s")
    return {"variant": label, "step_s": step_s, "steps_per_s": 1.0 / step_s, "wall_s": wall,
            "rollout_s": _steady(summary["run_dir"], "perf/rollout_s"),
            "train_s": _steady(summary["run_dir"], "perf/train_s"),
            "sync_s": _steady(summary["run_dir"], "perf/sync_s")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--outputs", default=None)
    args = ap.parse_args()
    import ray

    from parity.distributed.cluster import ray_session

    outputs = args.outputs or tempfile.mkdtemp(prefix="bench_distributed_")
    prepare_model(_cfg(outputs, args, "prep"))
    dist = ["distributed.enabled=true", "distributed.rollout_cpus=1", "distributed.trainer_cpus=1",
            "distributed.num_cpus=4"]
    results: list[dict] = []
    t = time.perf_counter()
    with ray_session(_cfg(outputs, args, "x", *dist).distributed):
        ray_start = time.perf_counter() - t
        for r in range(args.rounds):
            results.append(_variant("in-process", train, _cfg(outputs, args, f"local{r}")))
            for n in (1, 2):
                cfg = _cfg(outputs, args, f"ray{n}w{r}", *dist, f"distributed.num_rollout_workers={n}")
                results.append(_variant(f"ray {n} worker{'s' if n > 1 else ''}", train, cfg))
            cfg = _cfg(outputs, args, f"ray2o{r}", *dist, "distributed.num_rollout_workers=2",
                       "distributed.off_policy_overlap=true")
            results.append(_variant("ray 2 + overlap", train, cfg))
        assert ray.is_initialized()

    def med(label: str, key: str) -> float:
        return statistics.median(x[key] for x in results if x["variant"] == label)

    print(f"work: {args.prompts} prompts x 4 responses x {args.max_new_tokens} tokens, {args.steps} steps, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; local Ray start {ray_start:.1f} s")
    print(f"{'variant':<16}{'steps/s':>9}{'step_s':>9}{'rollout_s':>11}{'train_s':>9}{'sync_s':>9}{'wall_s':>9}")
    for label in ("in-process", "ray 1 worker", "ray 2 workers", "ray 2 + overlap"):
        print(f"{label:<16}{med(label, 'steps_per_s'):>9.3f}{med(label, 'step_s'):>9.3f}{med(label, 'rollout_s'):>11.3f}"
              f"{med(label, 'train_s'):>9.3f}{med(label, 'sync_s'):>9.3f}{med(label, 'wall_s'):>9.1f}")
    ratios = {"speedup_2_vs_1_workers": med("ray 1 worker", "step_s") / med("ray 2 workers", "step_s"),
              "speedup_overlap_vs_2_workers": med("ray 2 workers", "step_s") / med("ray 2 + overlap", "step_s"),
              "ray_overhead_1_worker_vs_in_process": med("ray 1 worker", "step_s") / med("in-process", "step_s"),
              "ray_overhead_s_per_step": med("ray 1 worker", "step_s") - med("in-process", "step_s")}
    print(json.dumps({k: round(v, 3) for k, v in ratios.items()}))


if __name__ == "__main__":
    main()
