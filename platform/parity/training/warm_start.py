"""The warm start of the tiny default model (`python -m parity prepare`): build it from its config with its
tokenizer, train it supervised on its task (parity.training.sft), measure its held-out accuracy through the torch
engine, and cache it under the folder parity.models.prepare names (outputs/models/<name>-<hash of its config>/).
A Hugging Face checkpoint (model.source=hf or model.path) is used as it is."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from parity.core.device import compute_dtype, resolve_device
from parity.models.prepare import prepare_tokenizer, resolve_model_dir, task_of
from parity.models.tiny import build_tiny_model, count_params
from parity.rewards.grader import GraderPool
from parity.rollout import engine_lanes
from parity.rollout.torch_engine import TorchEngine
from parity.training.checkpoint import file_sha256
from parity.training.heldout import eval_settings, heldout_accuracy
from parity.training.sft import warm_start

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig

log = logging.getLogger(__name__)


def built_model(cfg: ParityConfig) -> dict | None:
    """The run's starting model when nothing has to be built (a checkpoint given, or a warm start already
    cached): {"model_dir", "cached": True, ...prepare.json}; None when the warm start is still to build."""
    target = resolve_model_dir(cfg)
    if cfg.model.source == "hf" or cfg.model.path:
        return {"model_dir": str(target), "cached": True}
    done = Path(target) / "prepare.json"
    if done.is_file():
        return {"model_dir": str(target), "cached": True, **json.loads(done.read_text())}
    return None


def prepare_model(cfg: ParityConfig) -> dict:
    """The run's starting model: {"model_dir", "cached", ...the warm start's record (prepare.json)}."""
    built = built_model(cfg)
    return built if built is not None else _build_tiny(cfg, Path(resolve_model_dir(cfg)))


def _build_tiny(cfg: ParityConfig, target: Path) -> dict:
    t0 = time.time()
    device = resolve_device(cfg.trainer.device)
    ws = cfg.model.warm_start
    tok = prepare_tokenizer(cfg)
    model = build_tiny_model(cfg.model.arch, cfg.model.tiny, seed=ws.seed, tok=tok)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok.save_pretrained(str(tmp))
    dtype = compute_dtype(cfg.model.dtype, device)
    task = task_of(cfg)
    problems = task.test_problems(int(ws.eval_problems))  # a task that cannot give them fails before the warm start
    losses = warm_start(model, tok, task, cfg.data.prompt_template, ws, dtype, device)
    model.save_pretrained(str(tmp), safe_serialization=True)
    engine = TorchEngine(tmp, device=str(device), dtype=dtype, cpu_lanes=engine_lanes(cfg))
    with GraderPool(workers=cfg.eval.grade_workers, timeout_s=cfg.eval.grade_timeout_s) as grader:
        acc = heldout_accuracy(engine, tok, problems, cfg.data.prompt_template, grader, cfg.rollout.max_new_tokens,
                               **eval_settings(cfg))
    engine.close()
    info = {"params": count_params(model), "vocab": len(tok), "task": task.name,
            # whether two builds of one recipe (another machine, another job) made the same weights
            "weights_sha256": file_sha256(tmp / "model.safetensors"),
            "warm_start_steps": ws.steps, "final_sft_loss": losses[-1] if losses else None,
            "heldout_accuracy": acc, "heldout_problems": len(problems),
            "heldout_temperature": float(cfg.trainer.eval_temperature), "heldout_samples": int(cfg.trainer.eval_samples), "seconds": round(time.time() - t0, 1)}
    (tmp / "prepare.json").write_text(json.dumps(info, indent=1))
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    log.info("prepared %s: %s", target, info)
    return {"model_dir": str(target), "cached": False, **info}
