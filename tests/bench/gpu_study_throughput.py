"""Study throughput on one GPU, two trees side by side in one job: the same runs (the `gpu` study preset's arms,
one seed, the same steps and evaluations, from one warm start), first with an earlier tree's code as the study ran
them (every run its own process, the GPU time-sliced between them), then with this tree's (the same processes
under CUDA MPS, parity.study.mps). It prints and writes run-steps per second of each and their ratio, and checks
that the numbers did not move: every run's step-0 row (held-out accuracy of the warm start) and step-1 row (one
rollout batch from fixed weights and seed, one trainer step on it) against the same run's under the other code,
for exact equality (which timing-autotuned kernels do not give across processes on a GPU), and the step-0
evaluation, one computation in every run, as the two phases' means against their own spread (`step0_exact_eval`),
and, after the phases, one trainer step of a few arms on one fixed batch under each tree within the bounds of bf16
arithmetic (`trainer_step`, tests/bench/fixed_trainer_step.py).

    python3 tests/bench/gpu_study_throughput.py --old OLD_TREE/platform --model-dir MODEL \\
        --steps 20 --eval-every 10 --out OUT.json

OLD_TREE is a checkout of the earlier commit (`git archive <commit> platform | tar -x -C OLD_TREE`); MODEL a
prepared warm start (`python -m parity prepare ...`, the preset's base). Each phase gets its own Inductor and
Triton caches, so neither starts from the other's compiled kernels. Run-steps per second: all runs' RL steps over
the phase's wall time from the first launch to the last exit (start-up, compilation and evaluations included), and
over the window in which the runs made the middle 80% of their steps (`steady`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "platform"))

from parity.study.mps import MpsDaemon, child_env  # noqa: E402
from parity.study.preload import Preloader, start  # noqa: E402
from parity.study.presets import PRESETS  # noqa: E402

# the preset's base keys that the earlier tree also knows (the new evaluation keys are left out of both phases)
NEW_KEYS = ("trainer.eval_deployed_every", "trainer.final_eval_problems")
# the preset's base keys the earlier tree does not know that change how, not what, a run computes: this tree's
# phase runs with them, as `parity study` runs the preset
NEW_ONLY = ("trainer.share_step0_eval",)


def run_list(preset_name: str, seed: int, steps: int, eval_every: int, model_dir: str, arms: str) -> list[dict]:
    preset = PRESETS[preset_name]
    base = [f"experiment={preset.experiment}", *(o for o in preset.base if not o.startswith(NEW_KEYS + NEW_ONLY)),
            f"trainer.total_steps={steps}", f"trainer.eval_every={eval_every}", f"model.path={model_dir}",
            f"trainer.seed={seed}"]
    words = [w for w in arms.split(",") if w]
    out = []
    for i, a in enumerate(preset.arms):
        if words and not any(w in a.name for w in words):
            continue
        out.append({"arm": a.name, "name": f"tp-{i:02d}-s{seed}",
                    "overrides": [*base, *a.overrides(preset.topk), f"trainer.run_name=tp-{i:02d}-s{seed}"]})
    return out


def gpu_sample() -> tuple[float, float] | None:
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=10)
        util, mem = p.stdout.strip().splitlines()[0].split(",")
        return float(util), float(mem)
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process so far (its own threads, not its children)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def steps_done(metrics: Path) -> int:
    if not metrics.is_file():
        return 0
    return sum(1 for ln in metrics.read_text().splitlines() if '"reward/mean"' in ln)


def profiles(run_dir: Path) -> dict:
    """The run's profile_step<N>.json files (PARITY_PROFILE_STEPS, parity.core.profile), by step."""
    return {f.stem.removeprefix("profile_step"): json.loads(f.read_text())
            for f in sorted(run_dir.glob("profile_step*.json"))}


def phase_env(pythonpath: str, out_dir: Path, extra_env: dict | None = None) -> dict:
    """A phase's runs' environment: the bench's base, then `extra_env` (the preset's and --env), which wins."""
    return {**os.environ, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
            "TOKENIZERS_PARALLELISM": "false", "TORCHINDUCTOR_CACHE_DIR": str(out_dir / "inductor"),
            "TRITON_CACHE_DIR": str(out_dir / "triton"), **(extra_env or {})}


def preflight(runs: list[dict], new_extra: list[str]) -> None:
    """This tree's phase's run configs (each run's overrides and the phase's extra ones), loaded before the old
    tree's phase spends its minutes: an unknown key or bad value is a ConfigError naming it."""
    from parity.config import load_config
    for r in runs:
        load_config([*r["overrides"], *new_extra])


def _head(f: Path) -> str | None:
    return f.read_text()[:2000] if f.is_file() else None


def cohort_log(out_dir: Path, i: int) -> str | None:
    """The end of cohort server i's log: its engines' build time and each call's rows, steps and seconds."""
    f = out_dir / "logs" / f"cohort{i}.log"
    return f.read_text()[-3000:] if f.is_file() else None


def phase(name: str, pythonpath: str, runs: list[dict], work: Path, timeout_s: float, mps_mode: str,
          extra_env: dict | None = None, extra_overrides: list[str] | None = None, cohorts: bool = False,
          cohort_sm_share: int | None = None, cohort_max_runs: int | None = None,
          cohort_compile_threads: int | None = None, preload: bool = False) -> dict:
    """All `runs` at once, each a `python -m parity train` process with this phase's code; with `cohorts`, the runs
    of one rollout engine sampling through one rollout server (at most `cohort_max_runs` a server;
    parity.study.cohorts); with `preload`, every run and server forked from one process that imported torch and
    transformers first (parity.study.preload), started with the phase."""
    out_dir = work / name
    shutil.rmtree(out_dir, ignore_errors=True)
    (out_dir / "logs").mkdir(parents=True)
    env = phase_env(pythonpath, out_dir, extra_env)
    overrides = {r["name"]: [*r["overrides"], *(extra_overrides or [])] for r in runs}
    groups: list = []
    if cohorts:
        from parity.study.cohorts import plan, with_members
        from parity.study.members import RunSpec
        specs = [RunSpec(name=r["name"], arm=r["arm"], seed=None, overrides=tuple(overrides[r["name"]])) for r in runs]
        model_dirs = {r["name"]: next(o.split("=", 1)[1] for o in r["overrides"] if o.startswith("model.path="))
                      for r in runs}
        groups = plan(specs, model_dirs, Path(tempfile.mkdtemp(prefix="parity-cohorts-")), cohort_max_runs)
        overrides = {s.name: list(s.overrides) for s in with_members(specs, groups)}
    with MpsDaemon(mps_mode, pipe_dir=str(work / "mps-pipe"), log_dir=str(work / "mps-log")) as mps, \
            contextlib.ExitStack() as stack:
        env.update(child_env(mps))
        t0 = time.time()
        pre = None
        if preload:
            pre = stack.enter_context(Preloader(env, log=out_dir / "logs" / "preload.log"))
        if groups:
            from parity.study.cohorts import serving
            # as `parity study` starts them: with the runs, not before them
            stack.enter_context(serving(groups, env, out_dir / "logs", sm_share=cohort_sm_share, wait=False,
                                        compile_threads=cohort_compile_threads, preloader=pre))
        procs = []
        for r in runs:
            procs.append((r, start(["-m", "parity", "train", f"outputs_dir={out_dir}", *overrides[r["name"]]], env,
                                   out_dir / "logs" / f"{r['name']}.log", ROOT, pre)))
        timeline, gpu, server, load = [], [], None, []
        cpu = {r["name"]: None for r, _ in procs}
        while any(p.poll() is None for _, p in procs) and time.time() - t0 < timeout_s:
            time.sleep(2.0)
            done = sum(steps_done(out_dir / "runs" / r["name"] / "metrics.jsonl") for r in runs)
            timeline.append((round(time.time() - t0, 2), done))
            load.append(round(os.getloadavg()[0], 2))
            for r, p in procs:  # the last reading before a process exits: its main process's CPU time
                if p.poll() is None and (c := cpu_seconds(p.pid)) is not None:
                    cpu[r["name"]] = c
            if len(timeline) % 3 == 0 and (g := gpu_sample()) is not None:
                gpu.append(g)
            if server is None and mps.status.get("used"):
                q = subprocess.run(["nvidia-cuda-mps-control"], input="get_server_list\n", text=True,
                                   capture_output=True, env=dict(os.environ, **mps.env()))
                server = q.stdout.strip() or None
        for _, p in procs:
            if p.poll() is None:
                p.kill()
        wall = time.time() - t0
        mps_status = dict(mps.status, server_pid=server)
        preloaded = None if pre is None else {"preload_s": pre.preload_s, "fallback": pre.fallback,
                                              "log": _head(out_dir / "logs" / "preload.log")}
    results = []
    for r, p in procs:
        run_dir = out_dir / "runs" / r["name"]
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()] \
            if (run_dir / "metrics.jsonl").is_file() else []
        steps = [x for x in rows if "reward/mean" in x]
        summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").is_file() else {}
        med = {k: statistics.median(x[k] for x in steps if k in x) if any(k in x for x in steps) else None
               for k in ("perf/step_s", "perf/rollout_s", "perf/train_s")}
        results.append({"arm": r["arm"], "name": r["name"], "returncode": p.returncode, "steps": len(steps),
                        "cpu_s": cpu[r["name"]],
                        "rows": {str(x["step"]): x for x in rows if x["step"] in (0, 1)},
                        "median": med, "rollout_path": summary.get("rollout_path"),
                        "startup_s": summary.get("startup_s"), "startup_detail": summary.get("startup_detail"),
                        "step0_eval_s": summary.get("step0_eval_s"),
                        "step0_eval_shared": summary.get("step0_eval_shared"), "profiles": profiles(run_dir),
                        "log_tail": (out_dir / "logs" / f"{r['name']}.log").read_text()[-1500:]})
    total = sum(x["steps"] for x in results)
    lo, hi = 0.1 * total, 0.9 * total
    t_lo = next((t for t, d in timeline if d >= lo), None)
    t_hi = next((t for t, d in timeline if d >= hi), None)
    steady = (hi - lo) / (t_hi - t_lo) if t_lo is not None and t_hi is not None and t_hi > t_lo else None
    # where the runs' time went before their steps (summary.json's startup_s, this tree's runs only): the median
    # run's seconds since its process started at each point
    marks = [x["startup_s"] for x in results if x.get("startup_s")]
    startup = {k: statistics.median(m[k] for m in marks if k in m) for k in marks[0]} if marks else None
    return {"name": name, "pythonpath": pythonpath, "mps": mps_status, "startup_median_s": startup, "preload": preloaded,
            "cohorts": [{"members": c.members, "log_tail": cohort_log(out_dir, i)} for i, c in enumerate(groups)],
            "cohort_sm_share": cohort_sm_share, "cohort_compile_threads": cohort_compile_threads,
            "wall_s": round(wall, 1), "run_steps": total,
            "run_steps_per_s": total / wall, "steady_run_steps_per_s": steady, "timeline": timeline,
            "loadavg_1min": load, "cpus": os.cpu_count(),
            "gpu_util_mean": statistics.fmean(g[0] for g in gpu) if gpu else None,
            "gpu_mem_peak_mib": max(g[1] for g in gpu) if gpu else None, "runs": results}


def solo(runs: list[dict], arms: str, site: str, work: Path, out: Path, record: dict) -> None:
    """Each named arm alone on the GPU (this tree's code, no other run, no MPS), evaluation off: the floor of a
    run's step time that the side-by-side phases are measured against."""
    words = [w.strip() for w in arms.split(",") if w.strip()]
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'platform'}:{site}", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", TORCHINDUCTOR_CACHE_DIR=str(work / "new" / "inductor"),
               TRITON_CACHE_DIR=str(work / "new" / "triton"), PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    rows = []
    for r in runs:
        if not any(r["arm"].startswith(w) for w in words):
            continue
        t0 = time.time()
        p = subprocess.run([sys.executable, "-m", "parity", "train", f"outputs_dir={work / 'solo'}", *r["overrides"],
                            "trainer.eval_every=0"], env=env, capture_output=True, text=True, cwd=str(ROOT))
        metrics = work / "solo" / "runs" / r["name"] / "metrics.jsonl"
        steps = [json.loads(x) for x in metrics.read_text().splitlines()] if p.returncode == 0 else []
        steps = [{k: v for k, v in x.items() if k.startswith("perf/") or k in ("step", "response/length_mean")}
                 for x in steps if "reward/mean" in x][1:]  # step 1 includes the graphs' capture
        rows.append({"arm": r["arm"], "returncode": p.returncode, "wall_s_with_start_up": round(time.time() - t0, 1),
                     "steps": steps, "profiles": profiles(metrics.parent),
                     "log_tail": None if p.returncode == 0 else p.stderr[-1500:],
                     "median": {k: statistics.median(x[k] for x in steps) if steps else None
                                for k in ("perf/step_s", "perf/rollout_s", "perf/train_s")}})
        print(rows[-1]["arm"], rows[-1]["returncode"], rows[-1]["median"], flush=True)
    record["solo"] = rows
    out.write_text(json.dumps(record, indent=1, default=str))


def profile_table(label: str, runs: list[dict]) -> None:
    """One line a profiled phase: host seconds, the process's CPU seconds, kernels, their summed and union
    seconds, and the three kernels of largest total time."""
    for r in runs:
        for step, phases in (r.get("profiles") or {}).items():
            for ph, s in phases.items():
                top = "; ".join(f"{k['name'][:48]} x{k['count']} {k['mean_us']}us" for k in s["top"][:3])
                sync = sum(v[1] for n, v in s["runtime"].items() if "ynchronize" in n)
                print(f"{label} {r['arm'][:30]:30s} s{step} {ph:7s} wall {s['wall_s']:.3f} cpu {s['cpu_s']:.3f} "
                      f"sync {sync:.3f} kernels {s['kernels']} sum {s['kernel_s']:.3f} busy {s['kernel_busy_s']:.3f} "
                      f"| {top}", flush=True)


def _warm_up(r: dict) -> str:
    """A run's warm-up of its plain evaluation engine while another run computed the step-0 number: its seconds and
    its turn (first and alone, or after the first, with the seconds it waited)."""
    w = (r.get("step0_eval_shared") or {}).get("eval/accuracy_unquantized") or {}
    if w.get("warm_s") is None:
        return ""
    t = w.get("warm_turn")
    turn = f" ({'first' if t['first'] else 'after the first'}, waited {t['waited_s']} s)" if t else ""
    return f" | warm-up {w['warm_s']} s{turn}"


def start_account(ph: dict) -> list[str]:
    """Where a phase's start went, a line a run (its startup marks, the torch.compile seconds its process had spent
    by its first step, its first rollout's set-up, its evaluation engine's warm-up) and a line a cohort server (its
    engines' build and first call, and any later call that compiled, from its log): what to read first when the
    phase's first steps come late or a run stalls mid-way."""
    lines = []
    for r in ph["runs"]:
        marks = r.get("startup_s") or {}
        detail = r.get("startup_detail") or {}
        compiled = (detail.get("compile_s") or {}).get("first_step")
        lines.append(f"{ph['name']} {r['arm'][:30]:30s} " + " ".join(f"{k} {v}" for k, v in marks.items())
                     + (f" | compile by first step {compiled} s" if compiled is not None else "")
                     + (f" | rollout0 set-up {detail['rollout0_setup_s']}" if detail.get("rollout0_setup_s") else "")
                     + _warm_up(r))
    for i, c in enumerate(ph.get("cohorts") or []):
        tail = (c.get("log_tail") or "").splitlines()
        log = [ln for ln in tail if "engines built" in ln or ln.startswith("cohort server: call 1:")]
        late = [f"call {m[1]} {m[2]} s" for ln in tail
                if (m := re.match(r"cohort server: call (\d+): .*?, ([\d.]+) s, .*'compile'", ln)) and m[1] != "1"]
        lines.append(f"{ph['name']} cohort {i} ({len(c.get('members', []))} runs): " + " / ".join(
            ln.removeprefix("cohort server: ") for ln in log) + (f" / compiled later: {', '.join(late)}" if late else ""))
    return lines


def compare_rows(old: dict, new: dict) -> dict:
    """Step 0 and step 1 of each run, old against new, every logged number but timings."""
    out = []
    for ro, rn in zip(old["runs"], new["runs"], strict=True):
        for step in ("0", "1"):
            a, b = ro["rows"].get(step), rn["rows"].get(step)
            if a is None or b is None:
                out.append({"arm": ro["arm"], "step": step, "missing": True})
                continue
            keys = sorted(k for k in set(a) | set(b) if not k.startswith("perf/"))
            diff = {k: [a.get(k), b.get(k)] for k in keys if a.get(k) != b.get(k)}
            out.append({"arm": ro["arm"], "step": step, "keys": len(keys), "equal": len(keys) - len(diff),
                        "differ": diff})
    return {"checks": out, "all_equal": all(not c.get("missing") and not c["differ"] for c in out),
            "step0_exact_eval": step0_exact_eval(old, new)}


def step0_exact_eval(old: dict, new: dict) -> dict:
    """The step-0 held-out evaluation is one computation in every run of a phase (the warm start on the exact
    engine, the same problems and seed), repeated once a run; on a GPU whose kernels are autotuned by timing in
    each process the repeats differ by a sample or two (a flipped token re-samples the rest of its response), so
    exact equality across phases says nothing. This compares the two phases' means of that one computation
    against their own spread: `within_noise` when they differ by at most two standard errors of the difference
    plus one sample of the evaluation (1 / (problems x samples), read from the values' grid: their smallest
    nonzero difference). That bound is for phases that compute the same thing; where the new code's arithmetic
    differs on purpose (an eager prefill, other tiles), a different token is another draw of the sampler, and the
    yardstick is the evaluation's own sampling spread, what a seed changes: `within_seed_spread` when the means
    differ by at most two standard errors of the difference of two evaluations of accuracy p over n draws
    (sqrt(2 p (1 - p) / n), n = 1 / one sample)."""
    def values(ph: dict) -> list[float]:
        vals = []
        for r in ph["runs"]:
            row = r["rows"].get("0") or {}
            v = row.get("eval/accuracy_unquantized", row.get("eval/accuracy"))
            if v is not None:
                vals.append(float(v))
        return vals
    a, b = values(old), values(new)
    if len(a) < 2 or len(b) < 2:
        return {"old": a, "new": b, "within_noise": None, "why": "fewer than two step-0 evaluations in a phase"}
    steps = sorted({round(abs(x - y), 12) for x in a + b for y in a + b if x != y})
    sample = steps[0] if steps else 0.0  # the grid of an accuracy over problems x samples
    se = (statistics.variance(a) / len(a) + statistics.variance(b) / len(b)) ** 0.5
    diff = statistics.fmean(b) - statistics.fmean(a)
    p = statistics.fmean(a + b)
    seed_se = (2 * p * (1 - p) * sample) ** 0.5
    return {"old": a, "new": b, "old_mean": statistics.fmean(a), "new_mean": statistics.fmean(b), "diff": diff,
            "se_diff": se, "one_sample": sample, "within_noise": abs(diff) <= 2 * se + sample,
            "seed_se_diff": seed_se, "within_seed_spread": abs(diff) <= 2 * seed_se}


FIXED_STEP = ROOT / "tests" / "bench" / "fixed_trainer_step.py"


def fixed_trainer_steps(runs: list[dict], arms: str, old_path: str, new_path: str, new_extra: list[str],
                        model_dir: str, topk: int, work: Path, timeout_s: float) -> dict:
    """One trainer step on one fixed batch (sampled by the warm start, tests/bench/fixed_trainer_step.py) per
    chosen arm under each tree, this tree's with its phase's extra settings, compared within the bounds of bf16
    arithmetic: the trainer side of "equal on fixed inputs"."""
    from parity.config import load_config
    chosen = [r for r in runs if any(r["arm"].startswith(w.strip()) for w in arms.split(",") if w.strip())]
    if not chosen:
        return {"checks": [], "all_within": None, "why": f"no arm matches {arms!r}"}
    cfg = load_config([o for o in chosen[0]["overrides"] if not o.startswith("trainer.run_name=")])
    d = work / "fixed_step"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    env = dict(os.environ, PYTHONPATH=new_path, PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=str(d / "inductor"),
               TRITON_CACHE_DIR=str(d / "triton"))
    batch = d / "batch.pt"
    t0 = time.time()
    b = subprocess.run([sys.executable, str(FIXED_STEP), "batch", "--model-dir", model_dir,
                        "--rows", str(cfg.trainer.prompts_per_step * cfg.rollout.n), "--group", str(cfg.rollout.n),
                        "--max-new", str(cfg.rollout.max_new_tokens), "--topk", str(topk),
                        "--temperature", str(cfg.rollout.temperature), "--out", str(batch)],
                       env=env, capture_output=True, text=True, timeout=timeout_s)
    if b.returncode:
        return {"checks": [], "all_within": None, "why": "batch: " + b.stderr[-800:]}
    out = {"batch": json.loads(b.stdout.strip().splitlines()[-1]), "checks": []}
    # ref: the old tree in float32, the reference both trees' bf16 steps round from
    # new32: this tree's settings in float32, held to ref within float32's rounding (the same function)
    trees = (("old", old_path, []), ("new", new_path, new_extra), ("ref", old_path, ["model.dtype=float32"]),
             ("new32", new_path, [*new_extra, "model.dtype=float32"]))

    def step(job: tuple[dict, str, str, list[str]]) -> Path | str:
        r, tree, path, extra = job
        f = d / f"{r['name']}_{tree}.pt"
        try:
            p = subprocess.run([sys.executable, str(FIXED_STEP), "step", "--model-dir", model_dir, "--batch",
                                str(batch), "--overrides", json.dumps([*r["overrides"], *extra]), "--out", str(f)],
                               env=dict(env, PYTHONPATH=path), capture_output=True, text=True, timeout=timeout_s)
            return f if p.returncode == 0 else p.stderr[-800:]
        except subprocess.TimeoutExpired:
            return f"no step within {timeout_s} s"

    # every (arm, tree) step at once, each its own process: a step's numbers do not depend on what else runs (no
    # timing-based tuning in the trainer), and a dozen processes one after another took four to six minutes
    jobs = [(r, tree, path, extra) for r in chosen for tree, path, extra in trees]
    with ThreadPoolExecutor(len(jobs)) as ex:
        done = {(j[0]["name"], j[1]): f for j, f in zip(jobs, ex.map(step, jobs))}
    for r in chosen:
        res = {tree: done[r["name"], tree] for tree, _, _ in trees}
        if not all(isinstance(v, Path) for v in res.values()):
            out["checks"].append({"arm": r["arm"], "error": {k: v for k, v in res.items() if not isinstance(v, Path)}})
            continue
        c = subprocess.run([sys.executable, str(FIXED_STEP), "compare", str(res["old"]), str(res["new"]), "--ref",
                            str(res["ref"]), "--b32", str(res["new32"]), "--json",
                            str(d / f"{r['name']}_compare.json")], env=env,
                           capture_output=True, text=True)
        cmp = json.loads((d / f"{r['name']}_compare.json").read_text()) if c.returncode in (0, 1) else \
            {"within": None, "error": c.stderr[-800:]}
        out["checks"].append({"arm": r["arm"], **cmp})
    out["all_within"] = all(c.get("within") is True for c in out["checks"])
    out["seconds"] = round(time.time() - t0, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", help="the earlier tree's platform/ folder (not needed with --solo)")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--preset", default="gpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--arms", default="", help="only arms whose name contains one of these comma-separated words")
    ap.add_argument("--work", default="/tmp/study_throughput")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a phase may take")
    ap.add_argument("--old-commit", default=None)
    ap.add_argument("--solo", default="", help="instead of the two phases: each arm whose name starts with one of "
                    "these comma-separated prefixes alone on the GPU, evaluation off")
    ap.add_argument("--profile", default="", help="PARITY_PROFILE_STEPS for every run (parity.core.profile); with "
                    "--contended-only, only this tree's phase runs (under MPS), without the earlier tree")
    ap.add_argument("--contended-only", action="store_true", help="only this tree's side-by-side phase")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for every run of this tree's phase "
                    "(e.g. CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25, PARITY_CUDA_BLOCKING_SYNC=1)")
    ap.add_argument("--new-extra", default="", help="more overrides for every run of this tree's phase, "
                    "space-separated (settings the earlier tree does not know, e.g. trainer.eval_rows=512)")
    ap.add_argument("--new-cohorts", action="store_true", help="this tree's phase with the runs of one rollout "
                    "engine sampling through one rollout server (parity.study.cohorts; `parity study --cohorts`)")
    ap.add_argument("--new-cohort-sm-share", type=int, default=None, metavar="PERCENT",
                    help="with --new-cohorts, the share of the SMs each rollout server may use (default: the runs')")
    ap.add_argument("--new-cohort-max-runs", type=int, default=None, metavar="N",
                    help="with --new-cohorts, at most N runs a rollout server (`parity study --cohort-max-runs`)")
    ap.add_argument("--new-cohort-compile-threads", type=int, default=None, metavar="N",
                    help="with --new-cohorts, Inductor's compile workers in each rollout server "
                    "(`parity study --cohort-compile-threads`)")
    ap.add_argument("--new-preload", action="store_true", help="this tree's runs and rollout servers forked from one "
                    "process that imported torch and transformers first (parity.study.preload; `parity study --preload`)")
    ap.add_argument("--fixed-step-arms", default="bf16 / none,w4a4+int4kv / score_centering / ,w4a4+int4kv / tis",
                    help="arms (comma-separated name prefixes) whose trainer step on one fixed batch is compared "
                    "between the trees after the phases (tests/bench/fixed_trainer_step.py); empty: none")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.profile:
        os.environ["PARITY_PROFILE_STEPS"] = a.profile
    # this tree's phase runs as `parity study` runs the preset: its environment (the host's waits, the compile
    # threads), then --env; the old tree's phase with the bench's base environment, which holds what its preset set
    extra_env = {**PRESETS[a.preset].env, **dict(kv.split("=", 1) for kv in a.env)}
    new_extra = [*(o for o in PRESETS[a.preset].base if o.startswith(NEW_ONLY)), *a.new_extra.split()]
    site = os.environ.get("PARITY_CARRY_SITE", str(ROOT / ".gpucarry" / "site"))
    runs = run_list(a.preset, a.seed, a.steps, a.eval_every, a.model_dir, a.arms)
    record = {"date": time.strftime("%Y-%m-%d"), "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "hardware": {"gpu": (subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                                  capture_output=True, text=True).stdout.strip()),
                           "cpus": os.cpu_count()},
              "old_commit": a.old_commit, "new_commit": os.environ.get("PARITY_COMMIT"),
              "runs": [{"arm": r["arm"], "overrides": r["overrides"]} for r in runs]}
    out = Path(a.out)
    work = Path(a.work)
    if a.solo:
        solo(runs, a.solo, site, work, out, record)
        profile_table("solo", record["solo"])
        return
    if a.contended_only:
        record["new"] = phase("new", f"{ROOT / 'platform'}:{site}", runs, work, a.timeout, "auto", extra_env,
                              new_extra, a.new_cohorts, a.new_cohort_sm_share, a.new_cohort_max_runs,
                              a.new_cohort_compile_threads, preload=a.new_preload)
        record["extra_env"], record["new_extra"] = extra_env, new_extra
        out.write_text(json.dumps(record, indent=1, default=str))
        n = record["new"]
        print(f"contended: {n['run_steps']} run-steps in {n['wall_s']} s = {n['run_steps_per_s']:.2f}/s "
              f"(steady {n['steady_run_steps_per_s']}); MPS {n['mps']}", flush=True)
        profile_table("contended", n["runs"])
        return
    if not a.old:
        ap.error("--old is needed for the side-by-side phases")
    preflight(runs, new_extra)
    old = phase("old", f"{a.old}:{site}", runs, work, a.timeout, "off")
    record["old"] = old
    out.write_text(json.dumps(record, indent=1, default=str))
    print(f"old: {old['run_steps']} run-steps in {old['wall_s']} s = {old['run_steps_per_s']:.2f}/s "
          f"(steady {old['steady_run_steps_per_s']})", flush=True)
    new = phase("new", f"{ROOT / 'platform'}:{site}", runs, work, a.timeout, "auto", extra_env, new_extra,
                a.new_cohorts, a.new_cohort_sm_share, a.new_cohort_max_runs, a.new_cohort_compile_threads,
                preload=a.new_preload)
    record["new"] = new
    record["extra_env"], record["new_extra"] = extra_env, new_extra
    record["ratio"] = new["run_steps_per_s"] / old["run_steps_per_s"]
    # a run that failed did less work in its phase: the ratio then compares different amounts of work
    record["failed_runs"] = {ph["name"]: [r["arm"] for r in ph["runs"] if r["returncode"] != 0] for ph in (old, new)}
    record["ratio_valid"] = not any(record["failed_runs"].values())
    if old["steady_run_steps_per_s"] and new["steady_run_steps_per_s"]:
        record["steady_ratio"] = new["steady_run_steps_per_s"] / old["steady_run_steps_per_s"]
    record["fixed_inputs"] = compare_rows(old, new)
    out.write_text(json.dumps(record, indent=1, default=str))
    print(f"new: {new['run_steps']} run-steps in {new['wall_s']} s = {new['run_steps_per_s']:.2f}/s "
          f"(steady {new['steady_run_steps_per_s']}); MPS {new['mps']}; startup (median run, s since its process "
          f"started) {new['startup_median_s']}", flush=True)
    for line in start_account(new):
        print(line, flush=True)
    e0 = record["fixed_inputs"]["step0_exact_eval"]
    print(f"ratio {record['ratio']:.2f} (steady {record.get('steady_ratio')}); fixed inputs equal: "
          f"{record['fixed_inputs']['all_equal']}; step-0 evaluation old {e0.get('old_mean')} new {e0.get('new_mean')}"
          f" (within the phases' own noise: {e0['within_noise']}; within a seed's sampling spread: "
          f"{e0.get('within_seed_spread')})", flush=True)
    if not record["ratio_valid"]:
        print(f"  NOT VALID: runs failed, so the phases did different work: {record['failed_runs']}", flush=True)
    for c in record["fixed_inputs"]["checks"]:
        if c.get("missing") or c.get("differ"):
            print("  differs:", c["arm"], "step", c["step"], json.dumps(c.get("differ"))[:300], flush=True)
    for ph in (old, new):
        for r in ph["runs"]:
            if r["returncode"] != 0:
                print(f"  {ph['name']} {r['arm']} exit {r['returncode']}: {(r['log_tail'] or '')[-300:]}", flush=True)
    if a.fixed_step_arms:
        fx = fixed_trainer_steps(runs, a.fixed_step_arms, f"{a.old}:{site}", f"{ROOT / 'platform'}:{site}",
                                 new_extra, a.model_dir, PRESETS[a.preset].topk, work, a.timeout)
        record["fixed_inputs"]["trainer_step"] = fx
        out.write_text(json.dumps(record, indent=1, default=str))
        for c in fx["checks"]:
            print(f"fixed trainer step {c['arm']}: within {c.get('within')} (same-sign update rel L2 "
                  f"{c.get('update_same_sign_rel_l2')}, gradient to the float32 step {c.get('grad_rel_l2_to_ref')}, "
                  f"log-probs {c.get('logprob_mean_abs_to_ref')}, differ {c.get('differ')}"
                  f"{'; ' + str(c['error'])[:300] if c.get('error') else ''})", flush=True)
        if fx.get("why"):
            print("fixed trainer step:", fx["why"], flush=True)


if __name__ == "__main__":
    main()
