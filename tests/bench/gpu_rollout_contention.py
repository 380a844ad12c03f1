"""Rollout throughput of many processes sharing one GPU, under variants of how they share it.

The study runs a seed's arms as one process each on one GPU (under CUDA MPS). Its profile (docs/PERFORMANCE.md,
"Where a shared GPU's time goes") found the device running out of kernel starts, and the quantized arms' rollouts
9-10x slower shared than alone against 2.3x for bf16. This bench isolates the rollout: every worker process builds
the rollout engine of one study arm's format on the same warm start, decodes the same held-out prompts (n samples
each, the study's sampling) until a shared deadline, and reports its calls, rows and response tokens. The workers
start decoding together (after each has compiled and captured on its own), so the measured window has them all
busy. Variants, each a fresh set of processes:

    base         the study's way: one process an arm, 128 rows a call, MPS
    sm<P>        each MPS client limited to P% of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE): kernels of different
                 processes side by side instead of each wave covering the chip
    blocking     the host waits for the device with its thread asleep (parity.core.device.cuda_blocking_sync)
                 instead of spinning a core
    rows<R>      R rows a call (R / n prompts): what decoding several runs' rows in one call would buy, kernel for
                 kernel (one set of weights stands in for stacked ones)
    procs<N>     N processes instead of one an arm (the same formats in turn)
    cohort       one process a rollout format holding as many engines as the preset has arms of it (nine W4A4,
                 three FP8, ...), all decoded in one call of theirs (parity.rollout.cohort: weights stacked over
                 the runs, batched products): the runs of a format in one engine call, for real
    alone        one process of each format, one at a time (the reference)

Variants combine with '+' (e.g. rows512+procs4). Prints a table of rows/s and tokens/s per variant with the ratio to
`base`, and writes them as JSON:

    python3 tests/bench/gpu_rollout_contention.py --model-dir MODEL --variants base,sm25,blocking,rows512+procs4 \\
        --seconds 40 --out contention.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "platform"))

def preset_formats() -> list[tuple[str, list[str]]]:
    """(format, precision overrides) per arm of the gpu preset, read from the preset itself."""
    from parity.study.presets import PRESETS
    out = []
    for a in PRESETS["gpu"].arms:
        pre = [o for o in a.overrides(PRESETS["gpu"].topk) if o.startswith(("+precision", "rollout."))]
        out.append((a.name.split(" / ")[0], pre))
    return out


def worker(args: argparse.Namespace) -> None:
    import torch

    if args.blocking:
        from parity.core.device import cuda_blocking_sync
        cuda_blocking_sync()
    from transformers import AutoTokenizer

    from parity.config import load_config
    from parity.data.prompts import render_prompt
    from parity.data.tasks import heldout_problems
    from parity.rollout import build_engine, sampling_spec
    from parity.study.presets import PRESETS

    preset = PRESETS["gpu"]
    base = [o for o in preset.base if o.startswith(("trainer.", "data.", "rollout.", "model."))]
    cfg = load_config([f"experiment={preset.experiment}", *base, f"model.path={args.model_dir}",
                       f"trainer.device={args.device}", *json.loads(args.precision)])
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    engine = build_engine(cfg, args.model_dir, reference_dir=args.model_dir)
    n = int(cfg.rollout.n)
    problems = heldout_problems(cfg, 1024)
    per_call = max(1, args.rows // n)
    spec = sampling_spec(cfg, seed=args.index)
    meta: dict = {}  # the last batch's rollout path
    cohort = None
    if args.cohort > 1:  # this format's runs in one engine call, each its own engine (the same warm start here)
        from parity.rollout.cohort import CohortEngine
        cohort = CohortEngine([engine] + [build_engine(cfg, args.model_dir, reference_dir=args.model_dir)
                                          for _ in range(args.cohort - 1)])
        specs = [sampling_spec(cfg, seed=1000 * args.index + k) for k in range(args.cohort)]

    def call(i: int) -> tuple[int, int, float]:
        chunk = [problems[(i * per_call + j) % len(problems)] for j in range(per_call)]
        ids = [tok(render_prompt(cfg.data.prompt_template, p.problem))["input_ids"] for p in chunk]
        t = time.perf_counter()
        if cohort is not None:
            batches = cohort.generate([(ids, s, list(range(len(chunk)))) for s in specs])
        else:
            batches = [engine.generate(ids, spec, prompt_ids=list(range(len(chunk))))]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        meta.update(batches[0].meta or {})
        return len(chunk) * n * len(batches), sum(int(b.response_mask.sum()) for b in batches), time.perf_counter() - t

    for i in range(args.warmup):
        call(i)  # compilation, capture of every attended length, autotuning
    Path(args.ready).touch()
    while not Path(args.go).exists():
        time.sleep(0.01)
    deadline = float(Path(args.go).read_text() or 0) or time.time() + args.seconds
    cpu0, rows, toks, walls = time.process_time(), 0, 0, []
    i = args.warmup
    t0 = time.time()
    while time.time() < deadline:
        r, k, w = call(i)
        i += 1
        rows, toks = rows + r, toks + k
        walls.append(w)
    wall = time.time() - t0
    print(json.dumps({"format": args.format, "calls": len(walls), "rows": rows, "tokens": toks, "wall_s": wall,
                      "call_s_median": statistics.median(walls) if walls else None,
                      "cpu_s": time.process_time() - cpu0,
                      "rollout_path": {k: str(v) for k, v in meta.items()}}), flush=True)


def parse_variant(v: str) -> dict:
    opts = {"name": v, "rows": 128, "procs": None, "sm": None, "blocking": False, "alone": False, "cohort": False}
    for part in v.split("+"):
        if part == "base":
            continue
        if part == "blocking":
            opts["blocking"] = True
        elif part == "alone":
            opts["alone"] = True
        elif part == "cohort":
            opts["cohort"] = True
        elif part.startswith("sm"):
            opts["sm"] = int(part[2:])
        elif part.startswith("rows"):
            opts["rows"] = int(part[4:])
        elif part.startswith("procs"):
            opts["procs"] = int(part[5:])
        else:
            raise SystemExit(f"--variants: unknown part {part!r} in {v!r}")
    return opts


def run_set(args: argparse.Namespace, opts: dict, formats: list, work: Path, env: dict) -> list[dict]:
    """Start one worker per format, let all compile, start them together, collect their lines."""
    work.mkdir(parents=True, exist_ok=True)
    go = work / "go"
    go.unlink(missing_ok=True)
    procs = []
    for i, (fmt, pre, *count) in enumerate(formats):
        ready = work / f"ready{i}"
        ready.unlink(missing_ok=True)
        e = dict(env)
        if opts["sm"]:
            e["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(opts["sm"])
        cmd = [sys.executable, __file__, "--worker", "--model-dir", args.model_dir, "--format", fmt,
               "--out", "-", "--precision", json.dumps(pre), "--rows", str(opts["rows"]), "--index", str(i),
               "--ready", str(ready), "--go", str(go), "--warmup", str(args.warmup), "--seconds", str(args.seconds)]
        if opts["blocking"]:
            cmd.append("--blocking")
        if count:
            cmd += ["--cohort", str(count[0])]
        procs.append((fmt, ready, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                                   env=e)))
    t0 = time.time()
    while not all(r.exists() or p.poll() is not None for _, r, p in procs):
        if time.time() - t0 > args.startup_timeout:
            break
        time.sleep(0.2)
    startup = time.time() - t0
    go.write_text(str(time.time() + args.seconds + 0.5))
    out = []
    for fmt, _, p in procs:
        try:
            so, se = p.communicate(timeout=args.seconds + 120)
        except subprocess.TimeoutExpired:
            p.kill()
            so, se = p.communicate()
        line = next((ln for ln in reversed(so.splitlines()) if ln.startswith("{")), None)
        out.append(json.loads(line) if line else {"format": fmt, "error": se[-800:]})
    for o in out:
        o["startup_s"] = round(startup, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--variants", default="base,alone")
    ap.add_argument("--seconds", type=float, default=40.0, help="measured window of each variant")
    ap.add_argument("--warmup", type=int, default=2, help="calls each worker makes before the window")
    ap.add_argument("--startup-timeout", type=float, default=240.0)
    ap.add_argument("--work", default="/tmp/rollout_contention")
    ap.add_argument("--out", required=True)
    # worker-side
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--format", default="", help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="[]", help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=int, default=128, help=argparse.SUPPRESS)
    ap.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--ready", default="", help=argparse.SUPPRESS)
    ap.add_argument("--go", default="", help=argparse.SUPPRESS)
    ap.add_argument("--blocking", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cohort", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    from parity.study.mps import MpsDaemon, child_env

    mix = preset_formats()
    results: dict = {"date": time.strftime("%Y-%m-%d"), "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
                     "hardware": {"cpus": os.cpu_count()}, "mix": [f for f, _ in mix], "variants": {}}
    try:
        import torch
        results["hardware"]["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # noqa: BLE001 - the report only
        pass
    for v in args.variants.split(","):
        opts = parse_variant(v)
        t = time.time()
        if opts["alone"]:
            seen: dict = {}
            for fmt, pre in mix:
                seen.setdefault(fmt, pre)
            workers = []
            for fmt, pre in seen.items():
                workers += run_set(args, opts, [(fmt, pre)], Path(args.work) / v / fmt, dict(os.environ))
        else:
            formats = mix if opts["procs"] is None else [mix[i % len(mix)] for i in range(opts["procs"])]
            if opts["cohort"]:  # one process a format, with one engine per arm of that format
                counts: dict = {}
                for fmt, pre in mix:
                    counts.setdefault(fmt, [pre, 0])[1] += 1
                formats = [(fmt, pre, k) for fmt, (pre, k) in counts.items()]
            with MpsDaemon("auto", pipe_dir=f"{args.work}/mps-pipe", log_dir=f"{args.work}/mps-log") as d:
                workers = run_set(args, opts, formats, Path(args.work) / v, dict(os.environ, **child_env(d)))
                mps = d.status
            opts["mps"] = mps
        ok = [w for w in workers if "rows" in w]
        res = {"options": opts, "workers": workers, "elapsed_s": round(time.time() - t, 1)}
        if ok and not opts["alone"]:
            wall = max(w["wall_s"] for w in ok)
            res["rows_per_s"] = sum(w["rows"] for w in ok) / wall
            res["tokens_per_s"] = sum(w["tokens"] for w in ok) / wall
        by_fmt: dict = {}
        for w in ok:
            f = by_fmt.setdefault(w["format"], {"rows_per_s": [], "call_s": []})
            f["rows_per_s"].append(w["rows"] / w["wall_s"])
            f["call_s"].append(w["call_s_median"])
        res["per_format"] = {k: {"rows_per_s_each": statistics.median(x["rows_per_s"]),
                                 "call_s_median": statistics.median(x["call_s"]), "processes": len(x["call_s"])}
                             for k, x in by_fmt.items()}
        results["variants"][v] = res
        base = results["variants"].get("base", {}).get("tokens_per_s")
        if base and res.get("tokens_per_s"):
            res["tokens_ratio_to_base"] = res["tokens_per_s"] / base
        print(f"{v:>24}: rows/s {res.get('rows_per_s', 0):8.1f}  tokens/s {res.get('tokens_per_s', 0):10.0f}  "
              f"x base {res.get('tokens_ratio_to_base', float('nan')):.2f}  "
              + "  ".join(f"{k} {x['call_s_median']:.2f}s" for k, x in res["per_format"].items()), flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
