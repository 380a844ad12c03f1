"""The corrections study: the same RL setup trained once per correction, per precision setting and
per seed, as concurrent `python -m parity train` processes; a JSON + Markdown table of the outcomes.

    .venv/bin/python scripts/study.py --out outputs/study      # docs/study/README.md's study (hours on 2 cores)
    .venv/bin/python scripts/study.py --steps 20 --seeds 0 --precisions int8_int4kv --corrections none,tis
    .venv/bin/python scripts/study.py --experiment arith_tiny_moe --tag noreplay \
        --extra "algorithm.routing_replay=false"        # tiny MoE, rollout routing not replayed in training

Every run uses the embedded default (`experiment=arith_tiny`, or --experiment), REINFORCE with top-64
log-probs for all corrections (score centering needs both; on-policy single-epoch PPO-clip has the same
gradient), and its own run name `study-[<experiment>-][<tag>-]<precision>-<correction>-lr<lr>-s<seed>` (the
experiment named only when it is not arith_tiny; --tag tells apart studies that differ only in --extra);
runs already finished (summary.json present) are read back, not rerun. A run "collapses" when its last-20-step
mean reward falls below half of its first-20-step mean; "held" means final held-out accuracy >= the warm start's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

PRECISIONS = {
    "bf16": [],
    "int8_int4kv": ["+precision=w8a8_int8_kv_int4"],
    # harshest: RTN INT4 weights (per channel), INT8 activations, INT4 KV (torch engine simulation)
    "w4a8_int4kv": ["rollout.precision.weights=int4", "rollout.precision.activations=int8",
                    "rollout.precision.kv_cache=int4_per_token_head"],
    # stress: RTN INT3 weights (per channel, 7 levels), INT8 activations, INT4 KV (torch engine simulation)
    "w3a8_int4kv": ["rollout.precision.weights=int3", "rollout.precision.activations=int8",
                    "rollout.precision.kv_cache=int4_per_token_head"],
    # the INT4-activation pilot (docs/study/pilot_a4.md): per-token RTN INT4 activations (dynamic scale, 15 levels)
    # with INT8 / INT4 weights, INT4 KV
    "w8a4_int4kv": ["rollout.precision.weights=int8", "rollout.precision.activations=int4",
                    "rollout.precision.kv_cache=int4_per_token_head"],
    "w4a4_int4kv": ["rollout.precision.weights=int4", "rollout.precision.activations=int4",
                    "rollout.precision.kv_cache=int4_per_token_head"],
    "w3a4_int4kv": ["rollout.precision.weights=int3", "rollout.precision.activations=int4",
                    "rollout.precision.kv_cache=int4_per_token_head"],
    "w4a4_int4kv_norot": ["rollout.precision.weights=int4", "rollout.precision.activations=int4",
                          "rollout.precision.kv_cache=int4_per_token_head", "rollout.precision.kv_hadamard=false"],
    # harsher than the seed: FP8 (e4m3) weights and activations, INT4 KV without the Hadamard rotation
    "fp8_int4kv_norot": ["rollout.precision.weights=fp8", "rollout.precision.activations=fp8",
                         "rollout.precision.kv_cache=int4_per_token_head", "rollout.precision.kv_hadamard=false"],
}
CORRECTIONS = ["none", "tis", "icepop", "mis", "score_centering", "score_centering+tis", "dual"]
COMMON = ["algorithm.policy_loss=reinforce", "rollout.topk_logprobs=64",
          "trainer.checkpoint_every=0"]


def run_one(spec: dict, outputs: str, env: dict) -> dict:
    run_dir = Path(outputs) / "runs" / spec["name"]
    if not (run_dir / "summary.json").is_file():
        cmd = [sys.executable, "-m", "parity", "train", f"outputs_dir={outputs}", *spec["overrides"],
               f"trainer.run_name={spec['name']}"]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode:
            return {**spec, "error": p.stderr[-1200:]}
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "reward/mean" in r]
    acc = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    first = statistics.fmean(r["reward/mean"] for r in steps[:20])
    last = statistics.fmean(r["reward/mean"] for r in steps[-20:])

    def mean_of(key: str) -> float | None:
        vals = [r[key] for r in steps if key in r]
        return statistics.fmean(vals) if vals else None

    return {**spec, "steps": len(steps), "acc_start": acc[0][1], "acc_final": acc[-1][1],
            "acc_best": max(a for _, a in acc), "acc_curve": acc, "reward_first20": first, "reward_last20": last,
            "collapsed": last < 0.5 * first, "held": acc[-1][1] >= acc[0][1],
            "abs_prob_diff_mean": mean_of("mismatch/abs_prob_diff_mean"), "k3_kl": mean_of("mismatch/k3_kl"),
            "abs_prob_diff_max": max((r["mismatch/abs_prob_diff_max"] for r in steps
                                      if "mismatch/abs_prob_diff_max" in r), default=None),
            "routing_disagreement": mean_of("r3/routing_disagreement"),
            "skipped_steps": steps[-1].get("train/skipped_steps", 0.0),
            # the same weights on an unquantized engine (trainer.eval_unquantized; a bf16 rollout's own engine is
            # that already): the training effect without the deployment gap of the quantized engine
            "acc_unquantized_curve": acc if spec["precision"] == "bf16" else
            [(r["step"], r["eval/accuracy_unquantized"]) for r in rows if "eval/accuracy_unquantized" in r]}


def table(results: list[dict]) -> str:
    lines = ["| precision | correction | lr | seeds | held-out acc start -> final (best) | same weights unquantized "
             "start -> final (mean of the last 3 evaluations +- standard error over seeds) | reward first20 -> last20 | mean abs p diff | max abs p diff | collapsed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        if "error" not in r:
            groups.setdefault((r["precision"], r["correction"], r["lr"]), []).append(r)
    for (prec, corr, lr), rs in groups.items():
        def m(key: str, rs: list[dict] = rs) -> float:
            return statistics.fmean(x[key] for x in rs)
        curves = [x.get("acc_unquantized_curve") for x in rs]
        # a single evaluation of 256 problems moves by ~0.03 between evaluations: the mean of the last three too
        plain = "-"
        if all(curves):
            late = [statistics.fmean(a for _, a in c[-3:]) for c in curves]  # per seed
            se = f" +- {statistics.stdev(late) / len(late) ** 0.5:.3f}" if len(late) > 1 else ""
            plain = (f"{statistics.fmean(c[0][1] for c in curves):.3f} -> {statistics.fmean(c[-1][1] for c in curves):.3f}"
                     f" (last 3: {statistics.fmean(late):.3f}{se})")
        lines.append(f"| {prec} | {corr} | {lr} | {len(rs)} | {m('acc_start'):.3f} -> {m('acc_final'):.3f} "
                     f"({m('acc_best'):.3f}) | {plain} | {m('reward_first20'):.3f} -> {m('reward_last20'):.3f} | "
                     f"{m('abs_prob_diff_mean'):.2e} | {max(x['abs_prob_diff_max'] or 0.0 for x in rs):.2f} | "
                     f"{sum(x['collapsed'] for x in rs)}/{len(rs)} |")
    for r in results:
        if "error" in r:
            lines.append(f"| {r['precision']} | {r['correction']} | {r['lr']} | seed {r['seed']} | failed: "
                         f"{r['error'].strip().splitlines()[-1][:120]} | | | | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="outputs/study", help="folder of the table (study.json, study.md)")
    ap.add_argument("--outputs-dir", default=os.environ.get("PARITY_OUTPUTS", "outputs"))
    ap.add_argument("--precisions", default="int8_int4kv,fp8_int4kv_norot")
    ap.add_argument("--corrections", default=",".join(CORRECTIONS))
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--lrs", default="5e-5", help="comma-separated trainer.lr values")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--concurrency", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("--extra", default="", help="more overrides for every run, space-separated")
    ap.add_argument("--experiment", default="arith_tiny", help="the experiment preset every run starts from "
                    "(e.g. arith_tiny_moe); named in the run names when it is not arith_tiny")
    ap.add_argument("--tag", default="", help="a word added to every run name (studies that differ only in --extra)")
    ap.add_argument("--include-bf16-baseline", action="store_true", help="also run bf16 rollout, no correction")
    a = ap.parse_args(argv)
    if a.tag and (not a.tag.replace("_", "").isalnum()):
        ap.error(f"--tag: letters, digits and _ only, got {a.tag!r}")
    common = [f"experiment={a.experiment}", *COMMON]
    prefix = "".join(f"{x}-" for x in (a.experiment if a.experiment != "arith_tiny" else "", a.tag) if x)
    for p in a.precisions.split(","):
        if p not in PRECISIONS:
            ap.error(f"--precisions: unknown setting {p!r}; known: {', '.join(PRECISIONS)}")
    for c in a.corrections.split(","):
        if any(part not in CORRECTIONS[1:] + ["none"] for part in c.split("+")):
            ap.error(f"--corrections: unknown correction {c!r}; known: {', '.join(CORRECTIONS)}")
    specs = []
    combos = [(p, c) for p in a.precisions.split(",") for c in a.corrections.split(",")]
    if a.include_bf16_baseline:
        combos.insert(0, ("bf16", "none"))
    for lr in a.lrs.split(","):
        for prec, corr in combos:
            for seed in a.seeds.split(","):
                name = f"study-{prefix}{prec}-{corr.replace('+', '_')}-lr{lr}-s{seed}"
                specs.append({"name": name, "precision": prec, "correction": corr, "lr": lr, "seed": int(seed),
                              "overrides": [*common, *PRECISIONS[prec], f"algorithm.correction.name={corr}",
                                            f"trainer.lr={lr}", f"trainer.seed={seed}",
                                            f"trainer.total_steps={a.steps}", f"trainer.eval_every={a.eval_every}",
                                            *a.extra.split()]})
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    # the warm start is shared: build it once before the runs start
    prep = subprocess.run([sys.executable, "-m", "parity", "prepare", f"outputs_dir={a.outputs_dir}", *common,
                           *a.extra.split()], env=env, capture_output=True, text=True)
    if prep.returncode:
        print(prep.stderr[-2000:], file=sys.stderr)
        return 1
    print(f"study: {len(specs)} runs, {a.concurrency} at a time; model {prep.stdout.strip().splitlines()[-1]}",
          flush=True)
    t0, results = time.time(), []
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(a.concurrency) as ex:
        futures = [ex.submit(run_one, s, a.outputs_dir, env) for s in specs]
        for i, f in enumerate(futures):
            r = f.result()
            results.append(r)
            brief = r.get("error", "").strip().splitlines()[-1:] or [
                f"acc {r['acc_start']:.3f}->{r['acc_final']:.3f} reward {r['reward_first20']:.3f}->"
                f"{r['reward_last20']:.3f} |dp| {r['abs_prob_diff_mean']:.2e}"]
            print(f"[{time.time() - t0:6.0f}s {i + 1}/{len(specs)}] {r['name']}: {brief[0]}", flush=True)
            (out / "study.json").write_text(json.dumps(results, indent=1))
    (out / "study.md").write_text(f"experiment={a.experiment} {a.extra} (tag {a.tag or '-'}), {a.steps} steps, "
                                  f"eval every {a.eval_every}\n\n" + table(results))
    print(table(results))
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
