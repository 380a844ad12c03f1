"""`python -m parity evaluate [overrides]`: evaluate a model on a benchmark suite.

The model is one of: `eval.model_path` (a checkpoint folder, or a run folder whose latest valid
checkpoint is taken), `eval.run_name` (the latest valid checkpoint of outputs/runs/<run_name>; `latest`:
of the run under outputs/runs whose latest valid checkpoint is the newest),
`eval.registered_model` (NAME or NAME:VERSION, default the latest version, of a model the train-and-eval
flow registered: its checkpoint from the registry DB, else the MLflow model version's copy), or, when
none is set, the run's prepared starting model (`prepare`), which the command says on stderr. The summary (and metrics.json) record which
model, and which registered version, was evaluated. The engine is the configured rollout engine at the
configured rollout precision, so "train in BF16, deploy in FP8" is the same command with
`rollout.precision.weights=fp8 rollout.precision.activations=fp8`.

Presets: `eval=dcmdp` (the DCMDP paper's protocol), `eval=quick` (a smoke run on the tiny model).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from parity.errors import ParityError
from parity.evaluation.runner import evaluate
from parity.paths import inside_outputs
from parity.rollout import build_engine
from parity.tracking.naming import benchmark_problems, benchmark_set
from parity.tracking.registered import resolve_registered_model
from parity.training.checkpoint import CheckpointManager
from parity.training.warm_start import prepare_model

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig

GROUPS = ["eval", "model", "rollout", "precision"]
KEYS = [
    "eval.model_path | eval.run_name | eval.registered_model: the model (none: the prepared default)",
    "eval.run_name=latest: the newest training run under outputs/runs",
    "eval.suite: benchmarks (arithmetic, aime24, aime25, amc23, math500, minerva_math, olympiadbench)",
    "eval.k, eval.temperature, eval.max_new_tokens, eval.limit: sampling and size",
    "eval.benchmarks.<name>.<key>: one benchmark's own k, temperature, limit, ...",
    "eval.source: local (data.datasets_dir, ../shared/datasets or $PARITY_DATASETS) | hub",
]
EXAMPLES = [
    "python -m parity evaluate eval=quick",
    "python -m parity evaluate eval.run_name=latest",
    "python -m parity evaluate eval=dcmdp eval.model_path=outputs/runs/my_run",
    "python -m parity evaluate eval.run_name=latest rollout.precision.weights=int8 rollout.precision.activations=int8",
]


def _checkpoint_of_run(run_dir: Path, key: str) -> Path:
    if not run_dir.is_dir():
        raise ParityError(f"config key `{key}`: no training run at {run_dir}")
    latest = CheckpointManager(run_dir).latest_valid()
    if latest is None:
        raise ParityError(f"config key `{key}`: run {run_dir} has no valid checkpoint under {run_dir / 'checkpoints'}")
    return latest


LATEST = "latest"


def newest_run(runs_dir: Path) -> tuple[Path, Path]:
    """(run folder, its latest valid checkpoint) of the run whose checkpoint was written last
    (`eval.run_name=latest`); runs are tried newest first, so a corrupt newest one falls back."""
    candidates = []
    for run_dir in runs_dir.iterdir() if runs_dir.is_dir() else []:
        ckpts = CheckpointManager(run_dir).list() if (run_dir / "checkpoints").is_dir() else []
        if ckpts:
            candidates.append((ckpts[-1].stat().st_mtime, run_dir))
    for _, run_dir in sorted(candidates, key=lambda c: c[0], reverse=True):
        ckpt = CheckpointManager(run_dir).latest_valid()
        if ckpt is not None:
            return run_dir, ckpt
    raise ParityError(f"config key `eval.run_name`: `{LATEST}` found no training run with a valid checkpoint "
                      f"under {runs_dir}")


def resolve_eval_model_info(cfg: ParityConfig) -> tuple[Path | str, str, dict | None]:
    """(model folder or hub id, how it was chosen, the registered model's name/version/source or None)."""
    e = cfg.eval
    registered = e.registered_model
    if registered not in (None, ""):
        others = [k for k in ("model_path", "run_name") if getattr(e, k)]
        if others:
            raise ParityError(f"config key `eval.registered_model`: set it or `eval.{others[0]}`, not both")

        info = resolve_registered_model(str(registered), str(cfg.tracking.registry_url),
                                        str(cfg.tracking.tracking_uri),
                                        Path(str(cfg.outputs_dir)) / "registered_models")
        return Path(info["path"]), f"eval.registered_model ({info['name']} version {info['version']}, " \
                                   f"{info['source']})", info
    if e.model_path:
        p = Path(str(e.model_path)).expanduser()
        if (p / "config.json").is_file():
            return p, "eval.model_path", None
        if (p / "checkpoints").is_dir():
            return _checkpoint_of_run(p, "eval.model_path"), "eval.model_path (latest checkpoint)", None
        raise ParityError(f"config key `eval.model_path`: {p} is neither a checkpoint (config.json) nor a run "
                          "folder (checkpoints/)")
    if e.run_name:
        name = str(e.run_name)
        if name in (".", "..") or any(c in name for c in "/\\\0") or name.startswith("."):
            raise ParityError(f"config key `eval.run_name`: {name!r} is not a valid run name")
        runs = Path(cfg.outputs_dir) / "runs"
        if name == LATEST:
            run_dir, ckpt = newest_run(runs)
            return ckpt, f"eval.run_name=latest (run {run_dir.name})", None
        return _checkpoint_of_run(runs / name, "eval.run_name"), "eval.run_name", None

    return Path(prepare_model(cfg)["model_dir"]), "prepared default", None


def _out_dir(cfg: ParityConfig, model: Path | str, registered: dict | None = None) -> Path:
    if cfg.eval.out_dir:
        return inside_outputs(cfg.eval.out_dir, cfg.outputs_dir, "eval.out_dir")
    if registered is not None:
        label = f"{registered['name']}-v{registered['version']}"
    else:
        run_name = str(cfg.eval.run_name) if cfg.eval.run_name else None
        # latest: <outputs>/runs/<run>/checkpoints/step_N -> <run>
        label = Path(str(model)).parents[1].name if run_name == LATEST else run_name or Path(str(model)).name
    return Path(cfg.outputs_dir) / "eval" / f"{label}-{time.strftime('%Y%m%d-%H%M%S')}"


def run(cfg: ParityConfig) -> dict:
    from transformers import AutoTokenizer

    model, chosen, registered = resolve_eval_model_info(cfg)
    if chosen == "prepared default":
        print(f"evaluate: no eval.model_path, eval.run_name or eval.registered_model given: evaluating the "
              f"prepared default model {model}", file=sys.stderr, flush=True)
    else:
        print(f"evaluate: model {model} (from {chosen})", file=sys.stderr, flush=True)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    engine = build_engine(cfg, model)
    eval_cfg = cfg.eval
    if not eval_cfg.max_model_len and cfg.rollout.name == "vllm":
        eval_cfg = cfg.eval.copy()
        eval_cfg.max_model_len = int(cfg.rollout.max_model_len)  # the limit vLLM was built with
    try:
        summary = evaluate(engine, tokenizer, list(cfg.eval.suite), eval_cfg, _out_dir(cfg, model, registered),
                           data_cfg=cfg.data, model_info={"path": str(model), "chosen_by": chosen,
                                                          "registered_model": registered})
    finally:
        engine.close()
    problems = benchmark_problems(summary["benchmarks"])
    print(f"evaluate: {benchmark_set(problems)}; percent, [{eval_cfg.ci_level:.0%} bootstrap interval]"
          + ("; the macro average counts each benchmark once" if len(problems) > 1 else ""),
          file=sys.stderr, flush=True)
    print(summary["table"], file=sys.stderr, flush=True)
    return {
        "command": "evaluate", "model": str(model), "model_from": chosen, "registered_model": registered,
        "engine": summary["engine"],
        "out_dir": summary["out_dir"], "samples": summary["samples_path"],
        "macro": {m: round(v["value"], 4) for m, v in summary["macro"].items()},
        "benchmarks": {n: {"k": r["k"], "problems": r["problems"],
                           **{m: round(v["value"], 4) for m, v in r["metrics"].items()},
                           "prompts_truncated": r["prompts_truncated"]}
                       for n, r in summary["benchmarks"].items()},
        "grading": summary["grading"], "seconds": summary["seconds"],
    }
