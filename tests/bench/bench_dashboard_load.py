"""Dashboard page load on a store of 50 runs x 200 steps (goal: under 2 s a page).

Fills a fresh SQLite MLflow store (5 corrections x 10 seeds, the default config's flattened params, 8
per-step metrics), then loads each page in streamlit's AppTest with every cache cleared first (what a
new visitor after the cache TTL sees), and again warm. The peer, measured in the same run, is the bare
MLflow read the page cannot avoid (search_runs of all runs). Prints one line per page and a JSON summary.

    OMP_NUM_THREADS=1 .venv/bin/python tests/bench/bench_dashboard_load.py [--runs 50 --steps 200 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
CORRECTIONS = ["none", "tis", "icepop", "score_centering", "dual"]
PAGES = ["runs", "compare", "benchmarks", "regression", "precision"]
METRICS = ["reward/mean", "eval/accuracy", "mismatch/abs_prob_diff_mean", "mismatch/k3_kl", "correction/lambda",
           "correction/sc_term_abs", "perf/rollout_tokens_per_s", "perf/step_s"]


def fill_store(uri: str, n_runs: int, steps: int) -> None:
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    from parity.config import flatten, load_config

    params = {k: str(v) for k, v in flatten(load_config([])).items()}
    c = MlflowClient(uri)
    exp = c.create_experiment("parity")
    for i in range(n_runs):
        corr, seed = CORRECTIONS[i % len(CORRECTIONS)], i // len(CORRECTIONS)
        p = {**params, "algorithm.correction.name": corr, "trainer.seed": str(seed), "trainer.run_name": f"r{i}"}
        rid = c.create_run(exp, run_name=f"{corr}-s{seed}", tags={"parity.stage": "train"}).info.run_id
        ents = [Param(k, v[:6000]) for k, v in p.items()]
        for j in range(0, len(ents), 100):
            c.log_batch(rid, params=ents[j:j + 100])
        now = int(time.time() * 1000)
        ms = [Metric(k, 0.5 + 0.3 * math.sin(s / 20 + i) + 0.01 * m, now, s)
              for s in range(1, steps + 1) for m, k in enumerate(METRICS)]
        for j in range(0, len(ms), 1000):
            c.log_batch(rid, metrics=ms[j:j + 1000])
        c.set_terminated(rid)


class Browser:
    """One AppTest session, like one browser tab on a running server: the server's process-level resources
    (imports, the MLflow client, the resolved sources) stay; every load starts with the data caches empty,
    i.e. what a visitor sees after the cache TTL, reading the store again."""

    def __init__(self) -> None:
        from streamlit.testing.v1 import AppTest

        self.at = AppTest.from_file(str(REPO / "dashboards" / "app.py"), default_timeout=300)

    def load(self, page: str, cold: bool = True) -> float:
        import streamlit as st

        if cold:
            st.cache_data.clear()
        t = time.perf_counter()
        self.at.switch_page(f"views/{page}.py").run()
        dt = time.perf_counter() - t
        assert not self.at.exception, [e.value for e in self.at.exception]
        return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--store", help="reuse (or create) this SQLite MLflow store file instead of a temporary one")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = Path(a.store) if a.store else Path(d) / "mlflow.db"
        uri = f"sqlite:///{path.resolve()}"
        if not path.is_file():
            t = time.perf_counter()
            fill_store(uri, a.runs, a.steps)
            print(f"filled {a.runs} runs x {a.steps} steps x {len(METRICS)} metrics in {time.perf_counter() - t:.1f} s")
        os.environ.update({"PARITY_TRACKING_URI": uri, "PARITY_REGISTRY_URL": f"sqlite:///{d}/registry.db",
                           "PARITY_OUTPUTS": d})
        t = time.perf_counter()
        tab = Browser()
        tab.at.run()
        first = time.perf_counter() - t
        print(f"first load of a fresh process (imports of streamlit, mlflow, altair, hydra): {first:.1f} s")
        for page in PAGES:
            tab.load(page)
        from dashboards import data

        peer = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            data.fetch_runs(data.mlflow_client(uri))
            peer.append(time.perf_counter() - t)
        peer_s = statistics.median(peer)
        results = {}
        # Runs and Compare read the 50 runs (Compare: the 5 newest x 4 curves of 200 steps); the others read an
        # empty registry and outputs folder (their cost is the page itself)
        for name in PAGES:
            times = []
            for _ in range(a.repeats):
                times.append(tab.load(name))
            warm = statistics.median([tab.load(name, cold=False) for _ in range(a.repeats)])
            med = statistics.median(times)
            results[name] = {"cold_median_s": round(med, 3), "cold_max_s": round(max(times), 3), "warm_median_s":
                             round(warm, 3), "ratio_to_search_runs": round(med / peer_s, 2), "under_2s": med < 2.0}
            print(f"{name:10s} cold-cache load: median {med:.2f} s, max {max(times):.2f} s "
                  f"({med / peer_s:.1f}x the bare search_runs {peer_s:.2f} s) -> {'OK' if med < 2 else 'OVER'} "
                  f"(goal < 2 s); cached: {warm:.2f} s")
        print(json.dumps({"runs": a.runs, "steps": a.steps, "first_load_s": round(first, 2),
                          "search_runs_s": round(peer_s, 3), "pages": results}))


if __name__ == "__main__":
    main()
