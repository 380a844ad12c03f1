"""`prepare`: build (or locate) the model a run starts from. The tiny default is built from its config,
warm-started on its task (arithmetic, countdown) and cached under outputs/models/<name>-<hash of its config>/.
With `model.tokenizer=bpe` a byte-level BPE is first trained on the task's corpus (prompts and teacher
responses) and cached under outputs/tokenizers/bpe-<hash of what it was trained on>/."""

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
PREPARE_VERSION = 2  # bump when the warm-start recipe changes, so caches are rebuilt


def _task(cfg: Any) -> Any:
    from parity.data.tasks import synthetic_task
    return synthetic_task(cfg.data, cfg.model.warm_start)


def tokenizer_payload(cfg: Any) -> dict | None:
    """What a BPE tokenizer is a function of (None for the character tokenizer)."""
    if str(cfg.model.tokenizer) == "char":
        return None
    return {"kind": str(cfg.model.tokenizer), "vocab_size": int(cfg.model.tokenizer_vocab_size),
            "corpus_size": int(cfg.model.tokenizer_corpus_size), "template": cfg.data.prompt_template,
            **_task(cfg).config_payload()}


def tiny_model_dir(cfg: Any) -> Path:
    from parity.models.tiny import config_hash
    payload = {"v": PREPARE_VERSION, "arch": cfg.model.arch,
               "tiny": OmegaConf.to_container(cfg.model.tiny, resolve=True),
               "warm_start": OmegaConf.to_container(cfg.model.warm_start, resolve=True),
               "arith": OmegaConf.to_container(cfg.data.arithmetic, resolve=True),
               "template": cfg.data.prompt_template}
    task = _task(cfg)
    if task.name != "arithmetic":  # (the arithmetic default keeps the cache key it always had)
        payload["task"] = task.config_payload()
    if (tp := tokenizer_payload(cfg)) is not None:
        payload["tokenizer"] = tp
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


def tokenizer_corpus(cfg: Any) -> list[str]:
    """The BPE's training texts: rendered prompts and the teacher's responses of train problems (a stream
    seed of their own, so the corpus is not the warm start's batches)."""
    import random

    from parity.data.prompts import render_prompt

    task = _task(cfg)
    problems = task.stream(seed=20_000).take(int(cfg.model.tokenizer_corpus_size))
    rng = random.Random("tokenizer-corpus")
    return [render_prompt(cfg.data.prompt_template, p.problem) + task.demonstration(p, rng) for p in problems]


def prepare_tokenizer(cfg: Any) -> Any:
    """The run's tokenizer (character-level, or the cached BPE trained on the task's corpus)."""
    from transformers import AutoTokenizer

    from parity.models.tiny import config_hash
    from parity.models.tokenizer import build_bpe_tokenizer, build_char_tokenizer

    payload = tokenizer_payload(cfg)
    if payload is None:
        return build_char_tokenizer()
    if payload["kind"] != "bpe":
        raise ParityError(f"config key `model.tokenizer`: unknown tokenizer {payload['kind']!r}; known: char, bpe")
    target = Path(cfg.outputs_dir) / "tokenizers" / f"bpe-{config_hash(payload)}"
    if (target / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(target))
    t0 = time.time()
    tok = build_bpe_tokenizer(tokenizer_corpus(cfg), payload["vocab_size"])
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tok.save_pretrained(str(tmp))
    (tmp / "corpus.json").write_text(json.dumps({**payload, "vocab": len(tok), "seconds": round(time.time() - t0, 1)},
                                                indent=1))
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    log.info("trained %s: %d tokens", target, len(tok))
    return AutoTokenizer.from_pretrained(str(target))


def _file_sha256(path: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _build_tiny(cfg: Any, target: Path) -> dict:
    from parity.models.tiny import build_tiny_model, count_params
    from parity.rewards.grader import GraderPool
    from parity.rollout import compute_dtype, engine_lanes, resolve_device
    from parity.rollout.torch_engine import TorchEngine
    from parity.training.heldout import eval_settings, heldout_accuracy
    from parity.training.sft import warm_start

    t0 = time.time()
    device = resolve_device(cfg.trainer.device)
    ws = cfg.model.warm_start
    tok = prepare_tokenizer(cfg)
    model = build_tiny_model(cfg.model.arch, cfg.model.tiny, seed=ws.seed, tok=tok)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok.save_pretrained(str(tmp))
    dtype = compute_dtype(cfg, device)
    task = _task(cfg)
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
            "weights_sha256": _file_sha256(tmp / "model.safetensors"),
            "warm_start_steps": ws.steps, "final_sft_loss": losses[-1] if losses else None,
            "heldout_accuracy": acc, "heldout_problems": len(problems),
            "heldout_temperature": float(cfg.trainer.eval_temperature), "heldout_samples": int(cfg.trainer.eval_samples), "seconds": round(time.time() - t0, 1)}
    (tmp / "prepare.json").write_text(json.dumps(info, indent=1))
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    log.info("prepared %s: %s", target, info)
    return {"model_dir": str(target), "cached": False, **info}
