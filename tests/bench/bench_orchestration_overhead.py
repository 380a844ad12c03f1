"""Orchestration overhead of one train-and-eval pipeline on the embedded default: Prefect (flow and task
runs against a local server), MLflow (params, per-step metrics, artifacts, model registration) and the
registry DB, as a fraction of the pipeline's wall time. Goal: under 5%.

overhead = flow wall time - time spent inside the parity library calls (each task times its one call).
One-time costs are printed separately: importing Prefect/MLflow/SQLAlchemy and the library (torch,
transformers, the stage modules), starting the server, creating an empty MLflow store. Fresh outputs folder, so `prepare` builds the model as `make run` does.

    .venv/bin/python tests/bench/bench_orchestration_overhead.py [--quick] [hydra overrides...]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from scripts.run_local import free_port, start_server, stop_process, wait_healthy  # noqa: E402

LIBRARY_MODULES = ("parity.commands.evaluate", "parity.commands.quantize", "parity.commands.validate",
                   "parity.training.warm_start", "parity.rewards.grader", "parity.training.loop")
QUICK = ["model.warm_start.steps=30", "model.warm_start.eval_problems=16", "trainer.eval_problems=16",
         "trainer.prompts_per_step=2", "rollout.n=4", "trainer.total_steps=2", "trainer.checkpoint_every=1",
         "trainer.eval_every=0", "eval.grade_workers=1", "eval.limit=8"]


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the server
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny settings (seconds of work: overhead dominates)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="parity-bench-orch-"))
    out = root / "outputs"
    os.environ.update({"PARITY_OUTPUTS": str(out), "PREFECT_HOME": str(root / "prefect"),
                       "PREFECT_SERVER_ANALYTICS_ENABLED": "false"})
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    t = time.perf_counter()
    server = start_server(root / "prefect", port, root / "server.log")
    try:
        wait_healthy(api, server)
        t_server = time.perf_counter() - t
        os.environ["PREFECT_API_URL"] = api
        t = time.perf_counter()
        from flows.train_and_eval import train_and_eval
        from parity.tracking import mlflow_log

        # the library's own imports (torch, transformers, the stage modules) are paid by a direct run too:
        # load them here so the pipeline timing below separates orchestration from import cost
        for mod in LIBRARY_MODULES:
            importlib.import_module(mod)

        t_import = time.perf_counter() - t
        t = time.perf_counter()
        mlflow_log.client(f"sqlite:///{out}/mlflow.db").search_experiments()  # creates the empty store
        t_store = time.perf_counter() - t
        overrides = [*(QUICK if args.quick else []), *args.overrides]
        t = time.perf_counter()
        result = train_and_eval(overrides=overrides)
        wall = time.perf_counter() - t
    finally:
        stop_process(server.pid)
    lib = sum(result["lib_seconds"].values())
    overhead = wall - lib
    print(json.dumps({"overrides": overrides, "pipeline_wall_s": round(wall, 2), "library_s": round(lib, 2),
                      "library_s_by_stage": {k: round(v, 2) for k, v in result["lib_seconds"].items()},
                      "orchestration_overhead_s": round(overhead, 2),
                      "one_time_s": {"prefect_server_start": round(t_server, 1), "imports": round(t_import, 1),
                                     "empty_mlflow_store": round(t_store, 1)},
                      "final_accuracy": result["final_accuracy"]}, indent=1))
    print(f"orchestration overhead: {overhead:.1f} s of {wall:.1f} s = {100 * overhead / wall:.1f}% of the "
          f"pipeline wall time (goal < 5%)")


if __name__ == "__main__":
    main()
