"""Running a study's training runs (each one `python -m parity train` process, several at a time) and reading
each run's folder back into one record: its arm and seed, per-step curves, and the outcomes the table reports.

A run whose folder already holds summary.json is read back, not rerun, so an interrupted study continues where it
stopped; a failed run is recorded with its error and the others carry on."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from parity.config import load_config
from parity.errors import ParityError
from parity.study.members import RunSpec
from parity.study.preload import start
from parity.training.warm_start import built_model
from parity.training.warm_start import prepare_model as prepare_start_model

# per-step metrics kept in study.json (the rest stay in each run's metrics.jsonl)
CURVE_KEYS = ("reward/mean", "mismatch/abs_prob_diff_mean", "mismatch/k3_kl", "drift/delta_cosine",
              "drift/adv_token_mean", "drift/adv_length_cov", "response/length_mean", "response/length_cv_within_group",
              "response/entropy", "response/repeat_4gram_frac", "response/truncated_frac", "train/collapsed",
              "correction/lambda", "correction/tolerance", "correction/masked_frac", "train/grad_norm",
              "correction/dual_delta_mean", "correction/dual_c", "correction/shift_over_adv",
              "correction/adv_shift_mean", "correction/mis_seq_masked_frac", "correction/is_weight_mean",
              "mismatch/k3_kl", "adv/abs_mean", "perf/step_s", "perf/rollout_s", "perf/train_s")
# (+ heldout_unquantized: the one of the first two that is exact); the final_* pair: the larger last evaluation
EVAL_KEYS = ("eval/accuracy", "eval/accuracy_unquantized", "eval/final_accuracy", "eval/final_accuracy_unquantized")


def late_mean(values: list[float], frac: float = 0.1) -> float | None:
    """Mean of the last `frac` of a series (at least one value)."""
    if not values:
        return None
    k = max(1, round(len(values) * frac))
    return statistics.fmean(values[-k:])


def smoothed_peak(values: list[float], window: int = 5) -> float | None:
    """The highest mean of `window` consecutive values (the series' own max when shorter)."""
    if not values:
        return None
    if len(values) < window:
        return max(values)
    return max(statistics.fmean(values[i:i + window]) for i in range(len(values) - window + 1))


def read_run(spec: RunSpec, run_dir: Path, seconds: float | None = None) -> dict:
    """The study's record of a run: a finished one, or one stopped early (no summary.json yet: marked partial,
    its collapse step read from the metrics)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    partial = not (run_dir / "summary.json").is_file()
    steps = [r for r in rows if "reward/mean" in r]
    if partial:
        fired = [r["step"] for r in steps if r.get("train/collapsed") == 1.0]
        summary = {"collapse_step": fired[0] if fired else None}
    else:
        summary = json.loads((run_dir / "summary.json").read_text())
    curves = {k: [[r["step"], r[k]] for r in steps if k in r] for k in CURVE_KEYS}
    evals = {k: [[r["step"], r[k]] for r in rows if k in r] for k in EVAL_KEYS}
    rewards = [r["reward/mean"] for r in steps]
    plain = evals["eval/accuracy_unquantized"] or evals["eval/accuracy"]  # an exact rollout's own engine is that
    evals["heldout_unquantized"] = plain  # the trained weights on an exact engine, for every arm alike
    cos = [v for _, v in curves["drift/delta_cosine"]]
    return {"name": spec.name, "arm": spec.arm, "seed": spec.seed, "labels": dict(spec.labels),
            "overrides": list(spec.overrides), "steps": len(steps), "curves": {k: v for k, v in curves.items() if v},
            "evals": {k: v for k, v in evals.items() if v},
            "final_reward": late_mean(rewards), "peak_reward": smoothed_peak(rewards),
            "initial_reward": statistics.fmean(rewards[:max(1, round(len(rewards) * 0.1))]) if rewards else None,
            "heldout_initial": plain[0][1] if plain else None, "heldout_final": plain[-1][1] if plain else None,
            "heldout_engine_final": evals["eval/accuracy"][-1][1] if evals["eval/accuracy"] else None,
            "collapse_step": summary.get("collapse_step"), "collapsed": summary.get("collapse_step") is not None,
            "mismatch_mean": statistics.fmean(v for _, v in curves["mismatch/abs_prob_diff_mean"])
            if curves["mismatch/abs_prob_diff_mean"] else None,
            "delta_cosine_final": cos[-1] if cos else None,
            "seconds": seconds if seconds is not None else summary.get("seconds"), "engine": summary.get("engine"),
            # the larger last evaluation: the trained weights on an exact engine, and in the rollout's format
            "heldout_large_final": _last(evals.get("eval/final_accuracy_unquantized") or
                                         evals.get("eval/final_accuracy")),
            "heldout_large_deployed_final": _last(evals.get("eval/final_accuracy")),
            "rollout_path": summary.get("rollout_path"), "rollout_paths": summary.get("rollout_paths"),
            "code_version": summary.get("code_version"), "start_weights_sha256": summary.get("start_weights_sha256"),
            "partial": partial,
            "step_seconds": statistics.median(r["perf/step_s"] for r in steps if "perf/step_s" in r)
            if any("perf/step_s" in r for r in steps) else None}


def _last(series: list | None) -> float | None:
    return series[-1][1] if series else None


def _overrides(spec: RunSpec, outputs_dir: str) -> list[str]:
    return [f"outputs_dir={outputs_dir}", *spec.override_list()]


def _failed(spec: RunSpec, error: str, log: Path | None = None) -> dict:
    return {"name": spec.name, "arm": spec.arm, "seed": spec.seed, "labels": dict(spec.labels),
            "overrides": list(spec.overrides), "error": error, "log": str(log) if log else None}


def check_finished_matches(spec: RunSpec, run_dir: Path) -> None:
    """A finished run is read back only if it ran the steps this study asks for (another stage or --steps
    writes the same run names): otherwise an error, and the finished run is left as it is."""
    summary = run_dir / "summary.json"
    want = [o.split("=", 1)[1] for o in spec.overrides if o.startswith("trainer.total_steps=")]
    if not summary.is_file() or not want:
        return
    ran = json.loads(summary.read_text()).get("steps")
    if ran is not None and int(ran) != int(want[-1]):
        raise ParityError(f"run {run_dir} finished with {ran} steps, this study asks for {want[-1]} "
                          "(trainer.total_steps): pass --tag NAME to keep both, or --outputs-dir elsewhere")


def run_one(spec: RunSpec, outputs_dir: str, env: dict, log_dir: Path,
            train: Callable[[Any], dict] | None = None, preloader: Any = None) -> dict:
    """Train one run (unless its folder already holds a finished one) and read it back: in this process with
    `train(cfg)` when given (the command's training entry; one import of torch for all runs: the form for runs one
    at a time), else as a `python -m parity train` process, forked from `preloader` when given
    (parity.study.preload)."""
    run_dir = Path(outputs_dir) / "runs" / spec.name
    t0 = time.time()
    if not (run_dir / "summary.json").is_file():
        if run_dir.exists():  # a run that died half-way: start it again from scratch
            shutil.rmtree(run_dir)
        log = log_dir / f"{spec.name}.log"
        if train is not None:
            try:
                train(load_config(_overrides(spec, outputs_dir)))
            except Exception as e:  # one failed run must not stop the study
                log.write_text(traceback.format_exc())
                return _failed(spec, f"{type(e).__name__}: {e}", log)
        else:
            code = start(["-m", "parity", "train", *_overrides(spec, outputs_dir)], env, log, os.getcwd(),
                         preloader).wait()
            if code:
                return _failed(spec, log.read_text()[-1500:], log)
    return read_run(spec, run_dir, round(time.time() - t0, 1))


def run_all(specs: list[RunSpec], outputs_dir: str, concurrency: int, threads_per_run: int, log_dir: Path,
            on_done: Callable[[dict, int, int, float], None] | None = None, extra_env: dict | None = None,
            train: Callable[[Any], dict] | None = None, preloader: Any = None) -> list[dict]:
    """Every spec, `concurrency` at a time (subprocesses, forked from `preloader` when given; one at a time runs in
    this process through `train` when given); results in the order of `specs`."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads_per_run), MKL_NUM_THREADS=str(threads_per_run),
               PYTHONUNBUFFERED="1", **(extra_env or {}))
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    out: dict[int, dict] = {}
    if concurrency <= 1:
        for i, s in enumerate(specs):
            out[i] = run_one(s, outputs_dir, env, log_dir, train=train)
            if on_done is not None:
                on_done(out[i], len(out), len(specs), time.time() - t0)
        return [out[i] for i in range(len(specs))]
    with ThreadPoolExecutor(max(1, concurrency)) as ex:
        futures = {ex.submit(run_one, s, outputs_dir, env, log_dir, None, preloader): i for i, s in enumerate(specs)}
        for fut in as_completed(futures):
            i = futures[fut]
            out[i] = fut.result()
            if on_done is not None:
                on_done(out[i], len(out), len(specs), time.time() - t0)
    return [out[i] for i in range(len(specs))]


def prepare_model(base: list[str], outputs_dir: str, env_threads: int, in_process: bool = False) -> dict:
    """Build the shared warm start once, before the runs start (every run would otherwise race to build it). A
    build runs in a process of its own (its own thread count); a warm start already built is read here, without
    starting one (a study re-run or a second part begins at once)."""
    cfg = load_config([f"outputs_dir={outputs_dir}", *base])
    if in_process:
        return prepare_start_model(cfg)
    built = built_model(cfg)
    if built is not None:
        return built
    env = dict(os.environ, OMP_NUM_THREADS=str(env_threads), PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, "-m", "parity", "prepare", f"outputs_dir={outputs_dir}", *base],
                       env=env, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"prepare failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))
