"""Where the model a run starts from is, and its tokenizer. A Hugging Face checkpoint is a folder or a hub id
(model.path); the tiny default lives under outputs/models/<name>-<hash of its config>/, built and warm-started
there by parity.training.warm_start. With `model.tokenizer=bpe` a byte-level BPE is trained on the task's corpus
(prompts and teacher responses) and cached under outputs/tokenizers/bpe-<hash of what it was trained on>/."""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import AutoTokenizer

from parity.config import as_plain
from parity.data.prompts import render_prompt
from parity.data.tasks import synthetic_task
from parity.errors import ParityError
from parity.models.tiny import config_hash
from parity.models.tokenizer import build_bpe_tokenizer, build_char_tokenizer
from parity.paths import plain_name

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig

log = logging.getLogger(__name__)
PREPARE_VERSION = 2  # bump when the warm-start recipe changes, so caches are rebuilt


def task_of(cfg: ParityConfig) -> Any:
    """The synthetic task the tiny model is warm-started on (arithmetic, countdown)."""
    return synthetic_task(cfg.data, cfg.model.warm_start)


def tokenizer_payload(cfg: ParityConfig) -> dict | None:
    """What a BPE tokenizer is a function of (None for the character tokenizer)."""
    if str(cfg.model.tokenizer) == "char":
        return None
    return {"kind": str(cfg.model.tokenizer), "vocab_size": int(cfg.model.tokenizer_vocab_size),
            "corpus_size": int(cfg.model.tokenizer_corpus_size), "template": cfg.data.prompt_template,
            **task_of(cfg).config_payload()}


def tiny_model_dir(cfg: ParityConfig) -> Path:
    payload = {"v": PREPARE_VERSION, "arch": cfg.model.arch,
               "tiny": as_plain(cfg.model.tiny),
               "warm_start": as_plain(cfg.model.warm_start),
               "arith": as_plain(cfg.data.arithmetic),
               "template": cfg.data.prompt_template}
    task = task_of(cfg)
    if task.name != "arithmetic":  # (the arithmetic default keeps the cache key it always had)
        payload["task"] = task.config_payload()
    if (tp := tokenizer_payload(cfg)) is not None:
        payload["tokenizer"] = tp
    return Path(cfg.outputs_dir) / "models" / f"{plain_name(cfg.model.name, 'model.name')}-{config_hash(payload)}"


def resolve_model_dir(cfg: ParityConfig) -> Path | str:
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


def tokenizer_corpus(cfg: ParityConfig) -> list[str]:
    """The BPE's training texts: rendered prompts and the teacher's responses of train problems (a stream
    seed of their own, so the corpus is not the warm start's batches)."""
    task = task_of(cfg)
    problems = task.stream(seed=20_000).take(int(cfg.model.tokenizer_corpus_size))
    rng = random.Random("tokenizer-corpus")
    return [render_prompt(cfg.data.prompt_template, p.problem) + task.demonstration(p, rng) for p in problems]


def prepare_tokenizer(cfg: ParityConfig) -> Any:
    """The run's tokenizer (character-level, or the cached BPE trained on the task's corpus)."""
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
