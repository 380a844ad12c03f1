"""Soak: N RL steps of the default experiment over Ray (2 rollout workers) while a random rollout worker is
SIGKILLed about every K steps, at a random moment of the step (rollout, grading, update or weight sync).
Afterwards metrics.jsonl must hold every step exactly once; the figures are printed as one JSON line.

Each kill is timed from the step that just ended: a timer fires after a random fraction of that step's duration,
so it lands inside the next step. Ray restarts the worker (distributed.max_worker_restarts is raised to cover
every planned kill) and the driver retries its shard with the newest weights.

Run:  .venv/bin/python tests/bench/bench_soak.py                       # 500 steps, a kill every ~50
      .venv/bin/python tests/bench/bench_soak.py --steps 40 --kill-every 12 trainer.prompts_per_step=4 rollout.n=4
Extra arguments are Hydra overrides of the run (the default experiment otherwise, outputs under outputs/).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from parity.config import load_config  # noqa: E402
from parity.training.loop import MetricsLog  # noqa: E402


class RandomWorkerKiller:
    """A callback of the run: after step s (s >= the next planned kill) it arms a timer that SIGKILLs a random
    rollout worker after a random fraction of step s's duration, i.e. somewhere inside step s+1."""

    def __init__(self, run_name: str, workers: int, every: int, steps: int, seed: int) -> None:
        self.run_name, self.workers, self.every, self.steps = run_name, workers, every, steps
        self.rng = random.Random(seed)
        self.next_at = self._gap()
        self.kills: list[dict] = []
        self.failed: list[str] = []
        self._last = time.monotonic()
        self._timers: list[threading.Timer] = []

    def _gap(self) -> int:
        return max(1, round(self.every * self.rng.uniform(0.5, 1.5)))

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        now, took = time.monotonic(), time.monotonic() - self._last
        self._last = now
        # the last step gets no kill: a worker killed after its shard is only noticed by the next rollout
        if step == 0 or step < self.next_at or step + 2 > self.steps:
            return
        self.next_at = step + self._gap()
        worker, delay = self.rng.randrange(self.workers), self.rng.uniform(0.0, 0.9) * took
        t = threading.Timer(delay, self._kill, args=(step + 1, worker, delay))
        t.daemon = True
        t.start()
        self._timers.append(t)

    def _kill(self, during_step: int, worker: int, delay: float) -> None:
        import ray

        try:
            actor = ray.get_actor(f"parity-{self.run_name}-rollout-{worker}")
            pid = ray.get(actor.ready.remote(), timeout=60)["pid"]
            os.kill(pid, signal.SIGKILL)
            self.kills.append({"step": during_step, "worker": worker, "pid": pid, "after_s": round(delay, 3)})
        except Exception as e:  # a worker already restarting: counted, not fatal to the soak
            self.failed.append(f"step {during_step} worker {worker}: {type(e).__name__}: {e}")

    def join(self) -> None:
        for t in self._timers:
            t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--kill-every", type=int, default=50)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-name", default=None)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of the run")
    args = ap.parse_args()

    from parity.commands.train import train

    run_name = args.run_name or f"soak-{time.strftime('%Y%m%d-%H%M%S')}"
    planned = math.ceil(args.steps / max(1, args.kill_every) * 1.5) + 2  # the most kills one worker can take
    cfg = load_config(["distributed.enabled=true", f"distributed.num_rollout_workers={args.workers}",
                       "distributed.rollout_cpus=1", "distributed.trainer_cpus=1",
                       f"distributed.max_worker_restarts={planned}", f"trainer.total_steps={args.steps}",
                       f"trainer.run_name={run_name}", *args.overrides])
    killer = RandomWorkerKiller(run_name, args.workers, args.kill_every, args.steps, args.seed)
    t0 = time.perf_counter()
    summary = train(cfg, callbacks=[killer])
    wall = time.perf_counter() - t0
    killer.join()

    rows = MetricsLog(Path(summary["run_dir"]) / "metrics.jsonl").read()
    counts = Counter(r["step"] for r in rows)
    expected = range(0, args.steps + 1)  # step 0 is the initial evaluation
    step_s = [r["perf/step_s"] for r in rows if "perf/step_s" in r]
    restarts_logged = sum(r.get("faults/worker_restarts", 0.0) for r in rows)
    out = {
        "bench": "soak", "run_dir": summary["run_dir"], "steps": args.steps, "workers": args.workers,
        "kill_every": args.kill_every, "kills": len(killer.kills), "kills_failed": len(killer.failed),
        "worker_restarts": summary["distributed"]["worker_restarts"], "restarts_in_metrics": int(restarts_logged),
        "rows": len(rows), "missing_steps": [s for s in expected if counts[s] == 0],
        "duplicate_steps": sorted(s for s, n in counts.items() if n > 1),
        "unexpected_steps": sorted(s for s in counts if s not in expected),
        "wall_s": round(wall, 1), "s_per_step": round(wall / max(1, args.steps), 3),
        "median_step_s": round(sorted(step_s)[len(step_s) // 2], 3) if step_s else None,
        "initial_accuracy": summary.get("initial_accuracy"), "final_accuracy": summary.get("final_accuracy"),
        "final_reward": summary.get("final_reward"), "kill_log": killer.kills, "kill_failures": killer.failed,
    }
    out["ok"] = (not out["missing_steps"] and not out["duplicate_steps"] and not out["unexpected_steps"]
                 and out["kills"] > 0 and out["worker_restarts"] == out["kills"])
    print(json.dumps(out), flush=True)
    if not out["ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
