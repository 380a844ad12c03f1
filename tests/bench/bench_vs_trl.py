"""Parity's RL step against TRL's GRPOTrainer, side by side on the same prepared model, prompts and settings.

    make bench                                     # among the other benchmarks
    .venv/bin/python tests/bench/bench_vs_trl.py   # alone; --tokens 16,64 --steps 30 --attempts 3 --max-foreign 0.25
    .venv/bin/python tests/bench/bench_vs_trl.py -- model.warm_start.steps=50   # Hydra overrides after `--`
    .venv/bin/python tests/bench/bench_vs_trl.py --variant "trainer.shared_prefix=off"  # an A/B run of parity too

What runs, per token budget (16 new tokens, parity's default, and 64, as in TRL's examples), each in a process
of its own: the floor (a plain forward + backward + AdamW step of the same model on batches of the same shapes,
[128, prompt width + tokens], the whole batch in one forward, in the compute dtype), then parity, TRL, parity, TRL again, parity
(interleaved, so a drift of the host shows as a difference between the parity runs). The first TRL run has the
environment parity's CLI sets (OMP_WAIT_POLICY=PASSIVE), the second the one a TRL script gets by default (no
OMP_WAIT_POLICY: libgomp's threads spin a while before they sleep, faster on an idle host, slower on a busy one);
`trl_fastest_over_parity` takes the faster of the two. Settings: 16 prompts x 8
responses a step, lr 5e-5, temperature 1, 30 steps, the median of steps 4-30 (a step is the wall time from one
step's end to the next's, as a user waits for it); the compute dtype is what parity's `model.dtype=auto` picks on
this CPU (bfloat16 where the CPU has native bf16, float32 where bf16 would be emulated), on both sides.

The busy-host guard: while a run's timed steps go, tests/bench/host_load.py measures the cores used outside this
benchmark's process tree (from /proc/stat minus the tree's own CPU time, plus hypervisor steal). A run that saw
more than --max-foreign cores of foreign load is repeated, up to --attempts times; the least contended attempt is
kept and every attempt's load is reported. TRL lives in its own virtual environment under outputs/bench/trl-venv
(torch 2.13.0 CPU from the local wheel folder, transformers 5.19.0, tokenizers 0.23.3, trl 1.16.0, accelerate,
datasets, math-verify), built with uv on first use; nothing of TRL enters the project's environment.

Prints one JSON line: per budget the per-phase medians (rollout, grading, train, weight sync for parity; generate,
reward, other preparation, train for TRL), the step medians, the floor, the ratios TRL / parity (each TRL
environment, and the faster) and parity's train phase / floor, and the load each run saw."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "platform"))

from host_load import LoadMonitor, host_description  # noqa: E402

TRL_PINS = ["torch==2.13.0", "transformers==5.19.0", "tokenizers==0.23.3", "trl==1.16.0", "accelerate", "datasets",
            "math-verify[antlr4_13_2]==0.9.0"]
PROMPTS, N_RESP, LR = 16, 8, 5e-5
FIRST_TIMED = 4  # steps 1-3 warm up (allocator, thread pools, first-call paths)


def _env(omp_defaults: bool = False) -> dict[str, str]:
    """The workers' environment: OMP_WAIT_POLICY=PASSIVE, as `python -m parity` sets it, or (omp_defaults) without
    it, as a TRL script runs by default (libgomp's threads then spin a while before they sleep)."""
    env = dict(os.environ)
    if omp_defaults:
        env.pop("OMP_WAIT_POLICY", None)
    else:
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "platform"), env.get("PYTHONPATH", "")) if p)
    return env


def _find_links() -> str:
    if os.environ.get("PIP_FIND_LINKS"):
        return os.environ["PIP_FIND_LINKS"]
    try:
        got = subprocess.run(["pip", "config", "get", "global.find-links"], capture_output=True, text=True, timeout=30)
        if got.returncode == 0 and got.stdout.strip():
            return got.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "/opt/wheels"


def ensure_trl_env(venv: Path) -> dict:
    """TRL's own environment (built once; a marker file records the pins it was built with)."""
    py, marker = venv / "bin" / "python", venv / ".parity-bench-pins"
    if marker.is_file() and marker.read_text() == "\n".join(TRL_PINS) and py.exists():
        return {"venv": str(venv), "built_s": 0.0}
    t0 = time.time()
    uv = [sys.executable, "-m", "uv"]
    subprocess.run([*uv, "venv", "-q", "--clear", "--python", sys.executable, str(venv)], check=True)
    subprocess.run([*uv, "pip", "install", "-q", "--python", str(py), "--find-links", _find_links(), *TRL_PINS],
                   check=True)
    got = subprocess.run([str(py), "-c", "import torch, trl; print(torch.__version__, trl.__version__)"],
                         capture_output=True, text=True, check=True).stdout.split()
    if not got[0].endswith("+cpu"):
        raise RuntimeError(f"TRL's environment got torch {got[0]}, not the CPU build (find-links: {_find_links()})")
    marker.write_text("\n".join(TRL_PINS))
    return {"venv": str(venv), "built_s": round(time.time() - t0, 1)}


# ---------------------------------------------------------------------------------------------- workers (children)

def _config(overrides: list[str], tokens: int, steps: int, run_name: str) -> object:
    from parity.config import load_config
    return load_config([*overrides, "trainer.eval_every=0", "trainer.checkpoint_every=0", f"trainer.total_steps={steps}",
                        f"trainer.prompts_per_step={PROMPTS}", f"rollout.n={N_RESP}", f"trainer.lr={LR}",
                        f"rollout.max_new_tokens={tokens}", f"trainer.run_name={run_name}"])


def worker_floor(a: argparse.Namespace) -> dict:
    """Writes the prompts of every step (for TRL) and times a plain fwd + bwd + AdamW on batches of their shapes."""
    import contextlib

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from parity.data.prompts import build_train_stream, render_prompt
    from parity.rollout import compute_dtype
    from parity.training.loop import encode_prompts
    from parity.training.warm_start import prepare_model

    cfg = _config(a.overrides, a.tokens, a.steps, "bench_floor")
    model_dir = prepare_model(cfg)["model_dir"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    stream = build_train_stream(cfg.data, seed=int(cfg.trainer.seed))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    max_prompt = model.config.max_position_embeddings - a.tokens
    shapes, lines = [], []
    for _ in range(a.steps):
        problems = stream.take(PROMPTS)
        ids, _ = encode_prompts(tok, cfg.data.prompt_template, problems, max_prompt)
        shapes.append(max(len(i) for i in ids))
        lines += [json.dumps({"prompt": render_prompt(cfg.data.prompt_template, p.problem), "answer": p.answer})
                  for p in problems]
    Path(a.prompts).write_text("\n".join(lines) + "\n")
    dtype = compute_dtype(cfg.model.dtype, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(0)
    V, B, R = model.config.vocab_size, PROMPTS * N_RESP, a.tokens
    ends = [time.time()]
    for P in shapes:
        ids = torch.randint(2, V, (B, P + R), generator=gen)
        amp = contextlib.nullcontext() if dtype == torch.float32 else torch.autocast("cpu", dtype=dtype)
        with amp:
            h = model.model(input_ids=ids, use_cache=False).last_hidden_state[:, P - 1:-1]
            logits = model.lm_head(h)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, V), ids[:, P:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ends.append(time.time())
    return {"peer": "floor", "model_dir": str(model_dir), "dtype": str(dtype).replace("torch.", ""),
            "threads": torch.get_num_threads(), "prompt_widths": shapes,
            "steps": [{"step": i + 1, "end": ends[i + 1], "step_s": ends[i + 1] - ends[i]} for i in range(len(shapes))]}


def worker_parity(a: argparse.Namespace) -> dict:
    """`python -m parity train` (the in-process loop) with a clock on every step's end."""
    import torch

    from parity.commands.train import train
    from parity.rollout import compute_dtype

    cfg = _config(a.overrides, a.tokens, a.steps, a.run_name)
    rows: list[dict] = []

    class Clock:
        def on_step(self, step: int, metrics: dict[str, float]) -> None:
            rows.append({"step": step, "end": time.time(), **{k: v for k, v in metrics.items()
                                                              if k.startswith(("perf/", "reward/"))}})

    t0 = time.time()
    train(cfg, callbacks=[Clock()])
    steps = []
    for prev, r in zip(rows, rows[1:]):  # rows[0]: step 0, the initial evaluation
        dt = r["end"] - prev["end"]
        phases = {k: r[f"perf/{k}"] for k in ("rollout_s", "grade_s", "train_s", "sync_s")}
        steps.append({"step": r["step"], "end": r["end"], "step_s": dt, **phases,
                      "other_s": dt - sum(phases.values()), "reward": r.get("reward/mean")})
    return {"peer": "parity", "dtype": str(compute_dtype(cfg.model.dtype, torch.device("cpu"))).replace("torch.", ""),
            "threads": torch.get_num_threads(), "startup_s": round(rows[0]["end"] - t0, 2), "steps": steps}


# ---------------------------------------------------------------------------------------------- orchestration

def _run(cmd: list[str], out: Path, steps: int, label: str, omp_defaults: bool = False) -> dict:
    out.unlink(missing_ok=True)
    with LoadMonitor() as mon:
        t0 = time.time()
        proc = subprocess.run(cmd, env=_env(omp_defaults), cwd=ROOT, capture_output=True, text=True)
        wall = time.time() - t0
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"{label} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    res = json.loads(out.read_text())
    st = res["steps"]
    if len(st) < steps:
        raise RuntimeError(f"{label}: {len(st)} steps recorded, {steps} expected")
    timed = [s for s in st if s["step"] >= FIRST_TIMED]
    t_begin = next(s["end"] for s in st if s["step"] == FIRST_TIMED - 1)
    res["load"] = mon.window(t_begin, timed[-1]["end"])
    res["wall_s"] = round(wall, 1)
    res["timed"] = timed
    return res


def _guarded(cmd_of: Callable[[int], list[str]], out: Path, a: argparse.Namespace, label: str, log: list,
             omp_defaults: bool = False) -> dict:
    best = None
    for attempt in range(1, a.attempts + 1):
        res = _run(cmd_of(attempt), out, a.steps, label, omp_defaults)
        res["attempt"] = attempt
        log.append({"run": label, "attempt": attempt, **res["load"], "median_step_s": _med(res["timed"], "step_s")})
        print(f"[bench_vs_trl] {label} attempt {attempt}: median step {log[-1]['median_step_s']:.3f} s, "
              f"foreign load {res['load']['foreign_cores']:.2f} cores", file=sys.stderr, flush=True)
        if best is None or res["load"]["foreign_cores"] < best["load"]["foreign_cores"]:
            best = res
        if res["load"]["foreign_cores"] <= a.max_foreign:
            break
    assert best is not None
    best["contended"] = best["load"]["foreign_cores"] > a.max_foreign
    return best


def _med(steps: list[dict], key: str) -> float:
    return statistics.median(s[key] for s in steps)


def _side_by_side(a: argparse.Namespace, tokens: int, model_overrides: list[str], trl_py: Path, work: Path) -> dict:
    me = [sys.executable, str(Path(__file__).resolve())]
    base = ["--tokens", str(tokens), "--steps", str(a.steps)]
    ov = ["--", *model_overrides]
    prompts = work / f"prompts_{tokens}.jsonl"
    log: list[dict] = []
    floor = _guarded(lambda i: [*me, "--worker", "floor", *base, "--prompts", str(prompts),
                                "--out", str(work / "floor.json"), *ov], work / "floor.json", a, "floor", log)
    parity_runs = []

    def parity(tag: str, extra: list[str] = ()) -> dict:  # type: ignore[assignment]
        return _guarded(lambda i: [*me, "--worker", "parity", *base, "--run-name", f"bench_vs_trl_{tokens}_{tag}_{i}",
                                   "--out", str(work / "parity.json"), *ov, *extra], work / "parity.json", a,
                        f"parity_{tag}", log)

    def trl_run(label: str, omp_defaults: bool) -> dict:
        return _guarded(lambda i: [str(trl_py), str(HERE / "trl_grpo_worker.py"), "--model", floor["model_dir"],
                                   "--prompts", str(prompts), "--tokens", str(tokens), "--steps", str(a.steps),
                                   "--dtype", floor["dtype"], "--workdir", str(work / f"trl_{tokens}"),
                                   "--out", str(work / "trl.json")], work / "trl.json", a, label, log, omp_defaults)

    parity_runs.append(parity("a"))
    trl = trl_run("trl", omp_defaults=False)  # the environment parity's CLI runs in
    parity_runs.append(parity("b"))
    trl_gomp = trl_run("trl_omp_defaults", omp_defaults=True)  # as a TRL script runs by default
    parity_runs.append(parity("c"))
    variants = {}
    for j, v in enumerate(a.variant):  # parity with other settings, e.g. an optimisation turned off (A/B)
        r = parity(f"variant{j}", v.split())
        variants[v] = {k: round(_med(r["timed"], k), 4) for k in ("step_s", "rollout_s", "grade_s", "train_s")}
        variants[v]["foreign_cores"] = r["load"]["foreign_cores"]

    p_steps = [s for r in parity_runs for s in r["timed"]]
    p_step, t_step, f_step = _med(p_steps, "step_s"), _med(trl["timed"], "step_s"), _med(floor["timed"], "step_s")
    p_train = _med(p_steps, "train_s")
    parity_out = {k: round(_med(p_steps, k), 4) for k in ("step_s", "rollout_s", "grade_s", "train_s", "sync_s",
                                                          "other_s")}
    parity_out["per_run_step_s"] = [round(_med(r["timed"], "step_s"), 4) for r in parity_runs]
    trl_keys = ("step_s", "rollout_s", "grade_s", "prepare_other_s", "train_s")
    trl_out = {k: round(_med(trl["timed"], k), 4) for k in trl_keys}
    trl_gomp_out = {k: round(_med(trl_gomp["timed"], k), 4) for k in trl_keys}
    t_best = min(t_step, trl_gomp_out["step_s"])
    return {
        "tokens": tokens, "dtype": floor["dtype"],
        "parity": parity_out, "trl": trl_out, "trl_omp_defaults": trl_gomp_out, "floor_step_s": round(f_step, 4),
        "trl_over_parity": round(t_step / p_step, 2),
        "trl_omp_defaults_over_parity": round(trl_gomp_out["step_s"] / p_step, 2),
        "trl_fastest_over_parity": round(t_best / p_step, 2),
        "parity_train_over_floor": round(p_train / f_step, 2),
        "trl_train_over_floor": round(trl_out["train_s"] / f_step, 2),
        "threads": {"parity": parity_runs[0]["threads"], "trl": trl["threads"], "floor": floor["threads"]},
        "startup_s": {"parity": parity_runs[0]["startup_s"], "trl": trl["startup_s"]},
        "parity_variants": variants,
        "contended": any(r["contended"] for r in (floor, trl, trl_gomp, *parity_runs)),
        "runs": log,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="16,64", help="comma-separated new-token budgets")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--attempts", type=int, default=3, help="runs of one kind at most, while the host is busy")
    ap.add_argument("--max-foreign", type=float, default=0.25, help="cores of foreign load a clean run may see")
    ap.add_argument("--variant", action="append", default=[],
                    help="also time parity with these overrides (space-separated), e.g. 'trainer.shared_prefix=off'")
    ap.add_argument("--worker", choices=["floor", "parity"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--prompts", help=argparse.SUPPRESS)
    ap.add_argument("--run-name", default="bench_vs_trl", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for parity (after --)")
    a = ap.parse_args()
    if a.worker:
        a.tokens = int(a.tokens)
        res = worker_floor(a) if a.worker == "floor" else worker_parity(a)
        Path(a.out).write_text(json.dumps(res))
        return
    outputs = Path(os.environ.get("PARITY_OUTPUTS", ROOT / "outputs"))
    work = outputs / "bench" / "vs_trl"
    work.mkdir(parents=True, exist_ok=True)
    env = ensure_trl_env(outputs / "bench" / "trl-venv")
    t0 = time.time()
    result: dict = {"bench": "vs_trl", "date": time.strftime("%Y-%m-%d"), "host": host_description(),
                    "settings": f"{PROMPTS} prompts x {N_RESP} responses, lr {LR}, {a.steps} steps, median of steps "
                                f"{FIRST_TIMED}-{a.steps}", "overrides": a.overrides, "trl_env": env}
    for tokens in (int(t) for t in a.tokens.split(",")):
        r = _side_by_side(a, tokens, a.overrides, Path(env["venv"]) / "bin" / "python", work)
        result[f"tokens_{tokens}"] = r
    result["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
