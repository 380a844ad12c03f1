"""`python -m parity study --preset laptop|gpu|cluster [--stage search|arms] [--quick]`: the collapse-and-rescue
study of corrections under a rollout mismatch. Every arm (mismatch source x correction x objective, parity.study.presets) is trained once per seed as its
own `python -m parity train` process, several at a time; the results go to <out>/study.json (every run: its
config, per-step curves, final and peak reward, held-out accuracy of the trained weights unquantized, collapse
step), <out>/study.md (mean ± standard error over seeds per arm) and three PNG figures.

    python -m parity study --preset laptop --stage search     # where does uncorrected training degrade?
    python -m parity study --preset laptop                    # every arm of the headline setting, 3 seeds
    python -m parity study --preset laptop --quick            # 2 steps, 1 seed: the whole path in seconds
    python -m parity study --figures-only --out outputs/study/laptop-arms   # table and figures again

Runs already finished (their summary.json exists) are read back, not rerun."""


from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from parity.paths import plain_name
from parity.study.cohorts import check_max_runs, plan, serving, with_members
from parity.study.members import expand
from parity.study.mps import MpsDaemon, check_sm_share, child_env
from parity.study.preload import Preloader
from parity.study.presets import OBJECTIVES, PRESETS, QUICK
from parity.study.report import (
    arm_rows,
    common_eval_step,
    early_warning,
    early_warning_table,
    figures,
    final_rows,
    final_table,
    gains_at,
    gains_table,
    lost_gain_step,
    lost_gain_tables,
    table,
)

EXAMPLES = [
    "python -m parity study --preset laptop --quick",
    "python -m parity study --preset laptop --stage search",
    "python -m parity study --preset laptop --objective grpo",
    "python -m parity study --preset gpu --stage calibrate --seeds 0 --outputs-dir /tmp/po",
    "python -m parity study --preset gpu --outputs-dir /tmp/po",
    "python -m parity study --preset gpu-reinforce --outputs-dir /tmp/po",
]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m parity study", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="laptop")
    p.add_argument("--stage", choices=["search", "calibrate", "arms"], default="arms",
                   help="search: uncorrected training over the mismatch sources; calibrate: the exact rollout under "
                        "other learning settings; arms: every correction at the headline setting (default)")
    p.add_argument("--quick", action="store_true", help="2 steps, 1 seed, tiny batches (the smoke form)")
    p.add_argument("--out", default=None, help="folder of study.json, study.md and the figures "
                                               "(default <outputs>/study/<preset>-<stage>[-<objective>][-quick])")
    p.add_argument("--outputs-dir", default=os.environ.get("PARITY_OUTPUTS", "outputs"))
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default: the preset's)")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the preset's)")
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--concurrency", type=int, default=None, help="runs at a time (default: the preset's)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per run (default: the preset's)")
    p.add_argument("--arms", default="", help="only arms whose name contains one of these comma-separated words")
    p.add_argument("--objective", default=None, choices=sorted(OBJECTIVES),
                   help="every arm with this objective instead of its own (reinforce_raw: REINFORCE on the raw "
                        "0/1 reward, no baseline)")
    p.add_argument("--extra", default="", help="more Hydra overrides for every run, space-separated")
    p.add_argument("--tag", default="", help="a word in every run name (studies that differ only in --extra)")
    p.add_argument("--mps", choices=["auto", "on", "off"], default="auto",
                   help="CUDA MPS for runs several at a time on one GPU, so that their kernels run side by side "
                        "(auto: where nvidia-cuda-mps-control and a GPU exist; parity.study.mps)")
    p.add_argument("--mps-sm-share", type=int, default=None, metavar="PERCENT",
                   help="under MPS, each run's process uses at most this share of the SMs at a time, so that "
                        "the runs' small kernels run on different SMs at once (default: the preset's; "
                        "parity.study.mps)")
    p.add_argument("--cohorts", action="store_true",
                   help="runs with the same rollout engine (format, sampling, starting weights) sample through one "
                        "rollout server each, their rows decoded in one engine call (parity.study.cohorts); every run "
                        "of the study at once (--concurrency at least its runs)")
    p.add_argument("--cohort-sm-share", type=int, default=None, metavar="PERCENT",
                   help="with --cohorts under MPS, the share of the SMs each rollout server may use at a time "
                        "(default: the runs' share)")
    p.add_argument("--cohort-max-runs", type=int, default=None, metavar="N",
                   help="with --cohorts, at most N runs a rollout server: a larger group of one engine is dealt out "
                        "evenly over as few servers as that allows (default: one server a group)")
    p.add_argument("--cohort-compile-threads", type=int, default=None, metavar="N",
                   help="with --cohorts, Inductor's compile workers in each rollout server's process "
                        "(TORCHINDUCTOR_COMPILE_THREADS; default: the runs' setting, the gpu preset's 1)")
    p.add_argument("--preload", action="store_true",
                   help="runs (and rollout servers) forked from one process that imported torch, transformers and "
                   "Triton first, instead of each importing them at once (parity.study.preload)")
    p.add_argument("--figures-only", action="store_true", help="rewrite study.md and the figures from study.json")
    p.add_argument("--collect", action="store_true", help="read the runs' folders as they are (unfinished ones "
                   "marked partial) into study.json, the table and the figures, without training")
    p.add_argument("--merge", nargs="+", default=None, metavar="STUDY_JSON",
                   help="one study of the runs of several study.json files (jobs that ran parts of the arms, "
                        "each with its own overrides): written to --out with its table and figures")
    return p


def _run_name(preset: str, tag: str, arm_name: str, seed: int, quick: bool) -> str:
    slug = "".join(c if c.isalnum() or c == "." else "-" for c in arm_name.replace("=", "").replace("+", "_")
                   .replace(" / ", "_")).strip("-")
    while "--" in slug:
        slug = slug.replace("--", "-")
    return plain_name(f"study-{preset}{'-quick' if quick else ''}{f'-{tag}' if tag else ''}-{slug}-s{seed}",
                      "trainer.run_name")


def _host() -> dict:
    info = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    try:
        flags = Path("/proc/cpuinfo").read_text()
        info["cpu_bf16"] = "avx512_bf16" in flags or "amx_bf16" in flags
        names = [ln.split(":", 1)[1].strip() for ln in flags.splitlines() if ln.startswith("model name")]
        info["cpu"] = names[0] if names else None
    except OSError:
        pass
    return info


def _error_line(text: str) -> str:
    """The line of a failed run's log that says what went wrong (not Hydra's closing hint)."""
    lines = [ln for ln in text.strip().splitlines() if ln.strip() and "HYDRA_FULL_ERROR" not in ln]
    return (lines or ["failed"])[-1][:160]


def write_outputs(study: dict, out: Path) -> list[str]:
    for r in study["runs"]:
        if "error" not in r:
            r["lost_gain_step"] = lost_gain_step(r.get("evals", {}).get("heldout_unquantized", []))
    study["arms"] = arm_rows(study["runs"])
    study["early_warning"] = early_warning(study["runs"])
    step = common_eval_step(study["runs"])
    study["gains"] = gains_at(study["runs"], step) if step is not None else []
    study["final"] = final_rows(study["runs"])
    (out / "study.json").write_text(json.dumps(study, indent=1, default=str))
    head = (f"# Study `{study['preset']}` ({study['stage']}{', quick' if study.get('quick') else ''})\n\n"
            f"{study.get('note', '')}\n\nCommand: `{study['command']}`  \nDate: {study['date']}; host: "
            f"{json.dumps(study['host'])}; wall time {study.get('wall_s', 0):.0f} s; {len(study['runs'])} runs, "
            f"{study['steps']} steps each, seeds {study['seeds']}.\n\n")
    (out / "study.md").write_text("\n".join(x for x in (
        head + table(study["runs"]), final_table(study["runs"]), gains_table(study["runs"]), lost_gain_tables(study["runs"]),
        early_warning_table(study["runs"])) if x))
    try:
        return [str(p) for p in figures(study["runs"], out, f"{study['preset']} / {study['stage']}")]
    except ImportError as e:  # matplotlib is not part of the numerical core (a bare GPU image may lack it)
        print(f"study: figures skipped ({e}); rerun with --figures-only where matplotlib is installed", flush=True)
        return []


def merge(a: argparse.Namespace, argv: list[str], out: Path) -> dict:
    """study.json, table and figures of the runs of several studies' JSON (a run named twice: the later file's)."""
    parts = [json.loads(Path(f).read_text()) for f in a.merge]
    words = [w.strip() for w in a.arms.split(",") if w.strip()]
    seeds = {int(x) for x in a.seeds.split(",")} if a.seeds else None
    runs = {r["name"]: r for part in parts for r in part["runs"]
            if (not words or any(w in r["arm"] for w in words)) and (seeds is None or r["seed"] in seeds)}
    first = parts[0]
    dates = sorted({p["date"] for p in parts if p.get("date")})
    study = {**{k: v for k, v in first.items() if k not in ("runs", "arms")},
             "date": " to ".join(dict.fromkeys((dates[0], dates[-1]))) if dates else first.get("date"),
             "wall_s": round(sum(p.get("wall_s") or 0 for p in parts), 1),  # the parts' wall times together
             "command": "python -m parity study " + " ".join(shlex.quote(x) for x in argv),
             "parts": [{"file": str(f), "command": p.get("command"), "date": p.get("date"), "host": p.get("host"),
                        "runs": [r["name"] for r in p["runs"]]} for f, p in zip(a.merge, parts, strict=True)],
             "seeds": sorted({r["seed"] for r in runs.values()}), "runs": list(runs.values())}
    out.mkdir(parents=True, exist_ok=True)
    return {"command": "study", "out": str(out), "runs": len(runs), "figures": write_outputs(study, out)}


def select_arms(a: argparse.Namespace, preset: Any) -> list:
    """The stage's arms, with --objective swapped in (arms that become the same are kept once), then those whose
    name contains one of the --arms words."""
    import dataclasses

    arms = list({"search": preset.search, "calibrate": preset.calibrate, "arms": preset.arms}[a.stage])
    if not arms:
        raise ValueError(f"preset {a.preset} has no {a.stage} stage")
    if a.objective:
        swapped = [dataclasses.replace(x, objective=a.objective) for x in arms]
        arms = list({x.name: x for x in swapped}.values())
    if a.arms:
        words = [w.strip() for w in a.arms.split(",") if w.strip()]
        arms = [x for x in arms if any(w in x.name for w in words)]
        if not arms:
            raise ValueError(f"--arms {a.arms!r}: no arm of preset {a.preset} ({a.stage}) matches")
    return arms


def main(argv: list[str]) -> dict:
    # torch and hydra: `parity study --help` (this module's parser) answers without them
    from parity.commands.train import train
    from parity.study.runs import check_finished_matches, prepare_model, read_run, run_all

    a = _parser().parse_args(argv)
    preset = PRESETS[a.preset]
    tail = f"{'-' + a.objective if a.objective else ''}{'-quick' if a.quick else ''}"
    out = Path(a.out or Path(a.outputs_dir) / "study" / f"{a.preset}-{a.stage}{tail}")
    if a.figures_only:
        study = json.loads((out / "study.json").read_text())
        return {"command": "study", "out": str(out), "figures": write_outputs(study, out)}
    if a.merge:
        return merge(a, argv, out)
    arms = select_arms(a, preset)
    seeds = [int(s) for s in a.seeds.split(",")] if a.seeds else list(preset.seeds)
    stage_steps = preset.arms_steps if a.stage == "arms" and preset.arms_steps else preset.steps
    steps = a.steps or (2 if a.quick else stage_steps)
    stage_eval = preset.arms_eval_every if a.stage == "arms" and preset.arms_eval_every else preset.eval_every
    eval_every = a.eval_every or (1 if a.quick else stage_eval)
    if a.quick and not a.seeds:
        seeds = seeds[:1]
    base = [f"experiment={preset.experiment}", *preset.base, *(preset.arms_extra if a.stage == "arms" else ()),
            f"trainer.total_steps={steps}", f"trainer.eval_every={eval_every}"]
    if a.quick:
        quick = list(preset.quick or QUICK)
        swap = [q for q in quick if q.startswith("experiment=")]  # a quick variant of its own (cluster: the seed's)
        if swap:
            base[0], quick = swap[-1], [q for q in quick if not q.startswith("experiment=")] + list(QUICK)
        base += quick
    base += a.extra.split()
    topk = min(preset.topk, 64) if a.quick else preset.topk  # quick variants run tiny vocabularies (99 characters)
    specs = expand([(x.name, x.overrides(topk)) for x in arms], seeds, base,
                   lambda arm, s: _run_name(a.preset, a.tag, arm, s, a.quick), {x.name: x.labels() for x in arms},
                   seed_overrides=preset.seed_overrides,
                   arm_seeds={x.name: x.seeds for x in arms if x.seeds is not None})
    if not specs:
        raise ValueError(f"no run: none of the selected arms runs seeds {seeds}")
    out.mkdir(parents=True, exist_ok=True)
    if a.collect:
        prev = json.loads((out / "study.json").read_text()) if (out / "study.json").is_file() else {}
        runs = []
        for s in specs:
            run_dir = Path(a.outputs_dir) / "runs" / s.name
            if (run_dir / "metrics.jsonl").is_file():
                runs.append(read_run(s, run_dir))
        study = {**{k: v for k, v in prev.items() if k != "runs"}, "preset": a.preset, "stage": a.stage,
                 "quick": a.quick, "note": preset.note, "steps": steps, "seeds": seeds, "runs": runs,
                 "collected": True, "date": prev.get("date", time.strftime("%Y-%m-%d")),
                 "host": prev.get("host", _host()), "command": prev.get("command", "python -m parity study " +
                                                                         " ".join(shlex.quote(x) for x in argv))}
        return {"command": "study", "out": str(out), "runs": len(runs), "figures": write_outputs(study, out)}
    for s in specs:  # before anything runs: a finished run of other steps is an error, not a silent read-back
        check_finished_matches(s, Path(a.outputs_dir) / "runs" / s.name)
    concurrency = a.concurrency or (1 if a.quick else preset.concurrency)
    threads = a.threads or preset.threads_per_run
    if a.cohort_sm_share is not None and not a.cohorts:
        raise ValueError("--cohort-sm-share is the rollout servers' SM share: it needs --cohorts")
    if a.cohort_sm_share is not None:
        check_sm_share(a.cohort_sm_share, "--cohort-sm-share")
    if a.cohort_max_runs is not None and not a.cohorts:
        raise ValueError("--cohort-max-runs is the size of a rollout server's cohort: it needs --cohorts")
    check_max_runs(a.cohort_max_runs)
    if a.cohort_compile_threads is not None and not a.cohorts:
        raise ValueError("--cohort-compile-threads is the rollout servers' compile workers: it needs --cohorts")
    if a.cohort_compile_threads is not None and a.cohort_compile_threads < 1:
        raise ValueError(f"--cohort-compile-threads: at least 1, got {a.cohort_compile_threads}")
    if a.cohorts and concurrency < max(2, len(specs)):
        raise ValueError(f"--cohorts: a cohort's runs meet at every engine call, so every run runs at once: "
                         f"--concurrency {concurrency} is fewer than the study's {len(specs)} runs")
    t0 = time.time()
    print(f"study {a.preset}/{a.stage}: {len(specs)} runs ({len(arms)} arms x {len(seeds)} seeds), {steps} steps, "
          f"{concurrency} at a time; preparing the warm start", flush=True)
    # the warm start of every seed (one for all when the preset's seeds share it), before the runs start: the runs
    # would otherwise race to build it
    preps: dict = {}
    for seed in sorted({s.seed for s in specs}, key=lambda x: -1 if x is None else x):
        extra = [o.format(seed=seed) for o in preset.seed_overrides] if seed is not None else []
        key = " ".join(extra)
        if key not in preps:
            preps[key] = prepare_model([*base, *extra], a.outputs_dir, max(threads, min(os.cpu_count() or 1, 8)),
                                       in_process=concurrency <= 1)
            preps[key]["seed"] = seed if extra else None
            print(f"study: model {preps[key].get('model_dir')} (held-out {preps[key].get('heldout_accuracy')}, "
                  f"sha256 {str(preps[key].get('weights_sha256'))[:12]}) after {time.time() - t0:.0f} s", flush=True)
    prep = next(iter(preps.values())) if len(preps) == 1 else {"per_seed": list(preps.values())}
    study = {"preset": a.preset, "stage": a.stage, "quick": a.quick, "note": preset.note,
             "command": "python -m parity study " + " ".join(shlex.quote(x) for x in argv),
             "date": time.strftime("%Y-%m-%d"), "host": _host(), "steps": steps, "seeds": seeds,
             "model": prep, "runs": []}

    finished: list[dict] = []

    def done(r: dict, k: int, n: int, elapsed: float) -> None:
        finished.append(r)  # study.json grows run by run: an interrupted study keeps what it measured
        (out / "study.json").write_text(json.dumps({**study, "runs": finished, "partial": True}, indent=1, default=str))
        brief = _error_line(r["error"]) if "error" in r else (
            f"reward {r['initial_reward']:.3f} -> {r['final_reward']:.3f}, held-out "
            f"{r['heldout_initial']} -> {r['heldout_final']}, collapse {r['collapse_step']}")
        print(f"[{elapsed:6.0f} s {k}/{n}] {r['arm']} seed {r['seed']}: {brief}", flush=True)

    cohorts: list = []
    if a.cohorts:
        by_seed = {p.get("seed"): p["model_dir"] for p in preps.values()}
        model_dirs = {s.name: by_seed[s.seed if s.seed in by_seed else None] for s in specs}
        import tempfile
        # the servers' sockets in a short folder of their own (a Unix socket's path is at most 107 bytes)
        cohorts = plan(specs, model_dirs, Path(tempfile.mkdtemp(prefix="parity-cohorts-")), a.cohort_max_runs)
        specs = with_members(specs, cohorts)
        study["cohorts"] = [{"members": c.members, "model_dir": c.model_dir} for c in cohorts]
    on_gpu = any(o == "trainer.device=cuda" for o in base)
    sm_share = a.mps_sm_share if a.mps_sm_share is not None else preset.mps_sm_share
    with MpsDaemon(a.mps if on_gpu and concurrency > 1 else "off", sm_share=sm_share) as mps:
        study["mps"] = mps.status
        print(f"study: MPS {mps.status}", flush=True)
        env = {**preset.env, **child_env(mps)}
        with contextlib.ExitStack() as stack:
            pre = None
            if a.preload and concurrency > 1:
                pre = stack.enter_context(Preloader(dict(os.environ, **env), log=out / "logs" / "preload.log"))
            if cohorts:
                # the servers build their engines while the runs start (a member connects when its server listens)
                stack.enter_context(serving(cohorts, dict(os.environ, **env), out / "logs",
                                            sm_share=a.cohort_sm_share, wait=False,
                                            compile_threads=a.cohort_compile_threads, preloader=pre))
                study["mps"]["cohort_sm_share"] = a.cohort_sm_share
            study["runs"] = run_all(specs, a.outputs_dir, concurrency, threads, out / "logs", done, env, train=train,
                                    preloader=pre)
    study["wall_s"] = round(time.time() - t0, 1)
    figs = write_outputs(study, out)
    print((out / "study.md").read_text(), flush=True)
    failed = [r["name"] for r in study["runs"] if "error" in r]
    if failed:
        print(f"study: {len(failed)} runs failed (logs in {out / 'logs'}): {', '.join(failed)}", file=sys.stderr)
    return {"command": "study", "out": str(out), "runs": len(specs), "failed": len(failed),
            "wall_s": study["wall_s"], "figures": figs}
