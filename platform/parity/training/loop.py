"""The RL loop, top to bottom: rollout -> grade -> update -> weight sync -> (eval, checkpoint, log).

Everything a run writes goes to <outputs>/runs/<run_name>/: metrics.jsonl (one line per step, written once
per step even across resumes), checkpoints/, summary.json. Callbacks (e.g. MLflow logging) receive the
same per-step metrics."""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from parity.data.prompts import build_train_stream, render_prompt
from parity.data.tasks import heldout_problems
from parity.errors import ParityError
from parity.models.prepare import prepare_model
from parity.paths import plain_name
from parity.rollout import (
    build_engine,
    compute_dtype,
    is_perturbed,
    resolve_device,
    rollout_precision,
    sampling_spec,
)
from parity.training.checkpoint import CheckpointManager
from parity.training.collapse import CollapseAlarm
from parity.training.heldout import eval_settings, heldout_accuracy
from parity.training.trainer import Trainer

log = logging.getLogger(__name__)


class Callback(Protocol):
    def on_step(self, step: int, metrics: dict[str, float]) -> None: ...


def safe_run_name(name: str) -> str:
    """Run names become folder names under outputs/runs: no separators, no traversal."""
    return plain_name(name, "trainer.run_name")


def run_dir_of(cfg: Any) -> Path:
    return Path(cfg.outputs_dir) / "runs" / safe_run_name(str(cfg.trainer.run_name))


class MetricsLog:
    """metrics.jsonl with exactly one line per step: on resume, lines past the checkpoint are dropped."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def truncate_after(self, step: int) -> None:
        if not self.path.is_file():
            return
        keep = [ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
        self.path.write_text("".join(ln + "\n" for ln in keep))

    def append(self, step: int, metrics: dict[str, float]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    def read(self) -> list[dict]:
        if not self.path.is_file():
            return []
        return [json.loads(ln) for ln in self.path.read_text().splitlines() if ln.strip()]


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])


def _quantized(precision: Any) -> bool:
    """Whether a rollout precision changes any number the engine computes (weights, activations or KV cache,
    or a perturbation of the weights)."""
    return (any(str(getattr(precision, k, "bf16")) != "bf16" for k in ("weights", "activations", "kv_cache"))
            or is_perturbed(precision))


def train(cfg: Any, callbacks: list[Callback] | None = None) -> dict:
    from parity.rewards.grader import GraderPool

    callbacks = list(callbacks or [])
    t_start = time.time()
    seed = int(cfg.trainer.seed)
    random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
    device = resolve_device(cfg.trainer.device)
    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    from parity.tracking.secrets import masked_config_yaml
    (run_dir / "config.yaml").write_text(masked_config_yaml(cfg))  # no registry/MLflow passwords on disk

    # 1. starting weights: the latest valid checkpoint of this run when resuming, else the prepared model
    ckpts = CheckpointManager(run_dir, keep=cfg.trainer.keep_checkpoints)
    resume_from = ckpts.latest_valid() if cfg.trainer.resume else None
    if not cfg.trainer.resume and ckpts.list():
        raise ParityError(f"run {run_dir} already has checkpoints; set trainer.resume=true to continue it or "
                          "choose another trainer.run_name")
    base = prepare_model(cfg)["model_dir"]
    start_dir = resume_from or base
    tok = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(start_dir), dtype=torch.float32)
    stream = build_train_stream(cfg.data, seed=seed)
    trainer = Trainer(model, cfg, device, reference_dir=str(base))
    start_step = 0
    metrics_log = MetricsLog(run_dir / "metrics.jsonl")
    if resume_from is not None:
        state = torch.load(resume_from / "state.pt", weights_only=False)
        trainer.load_state_dict(state["trainer"])
        stream.load_state_dict(state["data"])
        _set_rng_state(state["rng"])
        start_step = int(state["step"])
        log.info("resumed %s from %s (step %d)", run_dir.name, resume_from, start_step)
    metrics_log.truncate_after(start_step)
    alarm = CollapseAlarm.from_config(cfg)
    alarm.replay(metrics_log.read())  # a resumed run's alarm state is that of its logged rewards

    # 2. the rollout engine starts from the trainer's weights (re-quantized where its precision says so)
    engine = build_engine(cfg, start_dir, reference_dir=base, syncs=start_step)
    # long prompts (MATH with the tiny model's 256 positions) keep their end, where the question is
    max_prompt = model.config.max_position_embeddings - cfg.rollout.max_new_tokens
    test_problems = heldout_problems(cfg, cfg.trainer.eval_problems)
    summary: dict[str, Any] = {"run_dir": str(run_dir), "start_step": start_step, "engine": engine.describe()}
    # the same weights without the rollout's quantization, evaluated beside it (trainer.eval_unquantized)
    plain = None
    if cfg.trainer.eval_unquantized and cfg.trainer.eval_every and _quantized(rollout_precision(cfg)):
        from parity.rollout.torch_engine import TorchEngine
        plain = TorchEngine(start_dir, device=str(device), dtype=compute_dtype(cfg, device))
    with GraderPool(workers=cfg.eval.grade_workers, timeout_s=cfg.eval.grade_timeout_s) as grader:
        def evaluate() -> dict[str, float]:
            out = {"eval/accuracy": heldout_accuracy(engine, tok, test_problems, cfg.data.prompt_template, grader,
                                                     cfg.rollout.max_new_tokens, **eval_settings(cfg))}
            if plain is not None:
                plain.update_weights(trainer.sync_weights())
                out["eval/accuracy_unquantized"] = heldout_accuracy(plain, tok, test_problems,
                                                                    cfg.data.prompt_template, grader,
                                                                    cfg.rollout.max_new_tokens, **eval_settings(cfg))
            return out

        if start_step == 0:
            first = evaluate()
            summary["initial_accuracy"] = first["eval/accuracy"]
            if plain is not None:
                summary["initial_accuracy_unquantized"] = first["eval/accuracy_unquantized"]
            _emit(metrics_log, callbacks, 0, first)
        bar = tqdm(range(start_step, cfg.trainer.total_steps), desc=f"train {run_dir.name}", unit="step",
                   initial=start_step, total=cfg.trainer.total_steps, mininterval=2.0)
        for step in bar:
            t0 = time.perf_counter()
            problems = stream.take(cfg.trainer.prompts_per_step)
            prompt_ids, n_cut = encode_prompts(tok, cfg.data.prompt_template, problems, max_prompt)
            batch = engine.generate(prompt_ids, sampling_spec(cfg, seed=seed * 1_000_003 + step),
                                    prompt_ids=list(range(len(problems))))
            t_roll = time.perf_counter()
            batch.texts = tok.batch_decode(batch.responses, skip_special_tokens=True)
            batch.answers = [problems[int(g)].answer for g in batch.group_ids]
            batch.rewards = grader.grade(batch.texts, batch.answers, batch.truncated.tolist())
            t_grade = time.perf_counter()
            metrics = trainer.step(batch)
            t_train = time.perf_counter()
            metrics["perf/sync_s"] = engine.update_weights(trainer.sync_weights())
            metrics["data/prompt_truncated_frac"] = n_cut / max(1, len(problems))
            metrics["train/collapsed"] = alarm.update(step + 1, metrics["reward/mean"])
            n_tok = int(batch.response_mask.sum())
            metrics.update({"perf/rollout_s": t_roll - t0, "perf/grade_s": t_grade - t_roll,
                            "perf/train_s": t_train - t_grade, "perf/step_s": time.perf_counter() - t0,
                            "perf/rollout_tokens_per_s": n_tok / max(1e-9, t_roll - t0),
                            "perf/train_tokens_per_s": n_tok / max(1e-9, t_train - t_grade)})
            done = step + 1
            if cfg.trainer.eval_every and (done % cfg.trainer.eval_every == 0 or done == cfg.trainer.total_steps):
                metrics.update(evaluate())
            if cfg.trainer.checkpoint_every and (done % cfg.trainer.checkpoint_every == 0
                                                 or done == cfg.trainer.total_steps):
                ckpts.save(done, trainer.model, tok, {"step": done, "trainer": trainer.state_dict(),
                                                      "data": stream.state_dict(), "rng": _rng_state()})
            _emit(metrics_log, callbacks, done, metrics)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", acc=metrics.get("eval/accuracy", ""))
    engine.close()
    if plain is not None:
        plain.close()
    rows = metrics_log.read()
    accs = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    summary.update({"steps": cfg.trainer.total_steps, "final_accuracy": accs[-1] if accs else None,
                    "initial_accuracy": summary.get("initial_accuracy", rows[0].get("eval/accuracy") if rows else None),
                    "final_reward": next((r["reward/mean"] for r in reversed(rows) if "reward/mean" in r), None),
                    "latest_checkpoint": str(ckpts.list()[-1]) if ckpts.list() else None,
                    "seconds": round(time.time() - t_start, 1)})
    summary["collapse_step"] = alarm.fired_at
    summary["tolerance"] = {"value": trainer.corrections.tolerance, "source": trainer.tolerance_source}
    plain_accs = [r["eval/accuracy_unquantized"] for r in rows if "eval/accuracy_unquantized" in r]
    if plain_accs:
        summary["final_accuracy_unquantized"] = plain_accs[-1]
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def encode_prompts(tok: Any, template: str, problems: list, max_prompt: int) -> tuple[list[list[int]], int]:
    """Token ids of each rendered prompt, left-truncated to `max_prompt`; and how many were cut."""
    out, cut = [], 0
    for p in problems:
        ids = tok(render_prompt(template, p.problem))["input_ids"]
        if len(ids) > max_prompt:
            ids, cut = ids[-max_prompt:], cut + 1
        out.append(ids)
    return out, cut


def _emit(metrics_log: MetricsLog, callbacks: list, step: int, metrics: dict[str, float]) -> None:
    metrics_log.append(step, metrics)
    for cb in callbacks:
        cb.on_step(step, metrics)
