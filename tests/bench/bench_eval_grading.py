"""Grading throughput (answers/s) of the math-verify GraderPool vs a single process, on MATH-500's 500
gold answers fed back as responses (`... \\boxed{gold}`): one run of each, same items, fresh caches.

The single process grades in its main thread (grade_one, the same code a pool worker runs); the pool
is started and warm (wait_ready) before its clock starts, since a training run creates it once.
Start-up of the pool is reported separately. With N workers the ideal ratio is min(N, free cores).

Run: OMP_NUM_THREADS=1 .venv/bin/python tests/bench/bench_eval_grading.py [--workers 2]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from parity.data.benchmarks import load_benchmark
from parity.rewards.grader import GraderPool
from parity.rewards.mathverify import grade_one, warm_up


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of processes (Linux /proc), to tell work from waiting for a core."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=5.0)
    args = ap.parse_args()
    problems = load_benchmark("math500")
    responses = [f"The final answer is \\boxed{{{p.answer}}}" for p in problems]
    answers = [p.answer for p in problems]

    t = time.perf_counter()
    pool = GraderPool(workers=args.workers, timeout_s=args.timeout)
    pool.wait_ready()
    startup = time.perf_counter() - t

    pids = pool.worker_pids()
    c0, t = _cpu_seconds(pids), time.perf_counter()
    pooled = pool.grade(responses, answers)
    t_pool, cpu_pool = time.perf_counter() - t, _cpu_seconds(pids) - c0
    pool.close()

    warm_up()  # imports and regex builds excluded from the single process's clock, as in the pool
    c0, t = time.process_time(), time.perf_counter()
    single = [grade_one(r, a, args.timeout).score for r, a in zip(responses, answers)]
    t_single, cpu_single = time.perf_counter() - t, time.process_time() - c0

    assert pooled.tolist() == single, "pool and single process disagree"
    n = len(problems)
    out = {"items": n, "workers": args.workers, "cpus": os.cpu_count(), "pool_startup_s": round(startup, 2),
           "single_answers_per_s": round(n / t_single, 1), "pool_answers_per_s": round(n / t_pool, 1),
           "speedup": round(t_single / t_pool, 2), "single_cpu_s": round(cpu_single, 2),
           "pool_workers_cpu_s": round(cpu_pool, 2), "accuracy": sum(single) / n,
           "load_avg_1min": round(os.getloadavg()[0], 2)}
    print(f"single process: {n / t_single:7.1f} answers/s ({t_single:.1f} s)")
    print(f"pool ({args.workers} workers): {n / t_pool:7.1f} answers/s ({t_pool:.1f} s), start-up {startup:.1f} s")
    print(f"CPU seconds: single {cpu_single:.1f}, pool workers {cpu_pool:.1f} (wall >> CPU means no free core)")
    print(f"speedup: {t_single / t_pool:.2f}x (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
