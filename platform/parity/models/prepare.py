"""`prepare`: build (or locate) the model a run starts from. The tiny default is built from its config,
warm-started on arithmetic and cached under outputs/models/<name>-<hash of its config>/."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from parity.errors import ParityError

log = logging.getLogger(__name__)
PREPARE_VERSION = 1  # bump when the warm-start recipe changes, so caches are rebuilt


def tiny_model_dir(cfg: Any) -> Path:
    from parity.models.tiny import config_hash
    payload = {"v": PREPARE_VERSION, "arch": cfg.model.arch,
               "tiny": OmegaConf.to_container(cfg.model.tiny, resolve=True),
               "warm_start": OmegaConf.to_container(cfg.model.warm_start, resolve=True),
               "arith": OmegaConf.to_container(cfg.data.arithmetic, resolve=True),
               "template": cfg.data.prompt_template}
    from parity.paths import plain_name

    return Path(cfg.outputs_dir) / "models" / f"{plain_name(cfg.model.name, 'model.name')}-{config_hash(payload)}"


def resolve_model_dir(cfg: Any) -> Path | str:
    """Where the run's starting weights are, without building anything."""
    if cfg.model.source == "hf":
        path = cfg.model.path
        if not path:
            raise ParityError("config key `model.path`: required when model.source=hf")
        if Path(path).exists() or (path.startswith(("/", ".", "~"))):
            p = Path(path).expanduser()
            if not (p / "config.json").is_file():
                raise ParityError(f"config key `model.path`: no Hugging Face checkpoint at {p} (config.json missing)")
            return p
        return path  # a hub id
    if cfg.model.path:
        p = Path(cfg.model.path)
        if not (p / "config.json").is_file():
            raise ParityError(f"config key `model.path`: no model at {p} (config.json missing)")
        return p
    return tiny_model_dir(cfg)


def prepare_model(cfg: Any) -> dict:
    target = resolve_model_dir(cfg)
    if cfg.model.source == "hf" or cfg.model.path:
        return {"model_dir": str(target), "cached": True}
    target = Path(target)
    done = target / "prepare.json"
    if done.is_file():
        info = json.loads(done.read_text())
        return {"model_dir": str(target), "cached": True, **info}
    return _build_tiny(cfg, target)


def _build_tiny(cfg: Any, target: Path) -> dict:
    from parity.data.arithmetic import arithmetic_problems
    from parity.models.tiny import build_tiny_model, count_params
    from parity.models.tokenizer import save_char_tokenizer
    from parity.rewards.grader import GraderPool
    from parity.rollout import compute_dtype, resolve_device
    from parity.rollout.torch_engine import TorchEngine
    from parity.training.heldout import heldout_accuracy
    from parity.training.sft import warm_start

    t0 = time.time()
    device = resolve_device(cfg.trainer.device)
    ws = cfg.model.warm_start
    model = build_tiny_model(cfg.model.arch, cfg.model.tiny, seed=ws.seed)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = save_char_tokenizer(tmp)
    dtype = compute_dtype(cfg, device)
    losses = warm_start(model, tok, cfg.data, ws, dtype, device)
    model.save_pretrained(str(tmp), safe_serialization=True)
    problems = arithmetic_problems("test", ws.eval_problems, cfg.data.arithmetic)
    engine = TorchEngine(tmp, device=str(device), dtype=dtype)
    with GraderPool(workers=cfg.eval.grade_workers, timeout_s=cfg.eval.grade_timeout_s) as grader:
        acc = heldout_accuracy(engine, tok, problems, cfg.data.prompt_template, grader, cfg.rollout.max_new_tokens)
    engine.close()
    info = {"params": count_params(model), "warm_start_steps": ws.steps, "final_sft_loss": losses[-1] if losses else None,
            "heldout_accuracy": acc, "heldout_problems": len(problems), "seconds": round(time.time() - t0, 1)}
    (tmp / "prepare.json").write_text(json.dumps(info, indent=1))
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    log.info("prepared %s: %s", target, info)
    return {"model_dir": str(target), "cached": False, **info}
