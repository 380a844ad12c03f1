"""The two Ray actors of the loop. Plain classes here; parity.distributed.driver wraps them with ray.remote and
the resources of the config.

RolloutWorker holds one engine (build_engine: torch or vLLM) and samples a shard of a step's prompts.
TrainerWorker holds the policy, its optimizer and the correction state; after each step it publishes the new
weights to the object store once (one ray.put) and the driver hands that reference to every worker. It also
writes checkpoints, in the layout and with the state of parity.training.loop, so a run can resume either way."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _threads(cpus: float) -> None:
    torch.set_num_threads(max(1, int(cpus)))


def _cfg(cfg: Any) -> Any:
    from omegaconf import OmegaConf
    return OmegaConf.create(cfg) if isinstance(cfg, dict) else cfg


def rng_state() -> dict:
    """Same layout as the in-process loop's checkpoints."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(s: dict) -> None:
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    torch.set_rng_state(s["torch"])


class RolloutWorker:
    def __init__(self, cfg: Any, model_dir: str, version: int, cpus: float = 1.0) -> None:
        from parity.rollout import build_engine

        _threads(cpus)
        self.cfg = _cfg(cfg)
        self.engine = build_engine(self.cfg, model_dir)
        self.version = version  # trainer steps behind the weights this engine holds

    def ready(self) -> dict:
        return {"pid": os.getpid(), "version": self.version, "engine": self.engine.describe()}

    def generate(self, prompt_token_ids: list[list[int]], spec: Any, prompt_ids: list[int]) -> tuple[Any, int]:
        batch = self.engine.generate(prompt_token_ids, spec, prompt_ids=prompt_ids)
        return batch, self.version

    def update_weights(self, packed: dict, version: int) -> float:
        """`packed` arrives resolved from the object store (parity.distributed.weights)."""
        from parity.distributed.weights import unpack_weights

        seconds = self.engine.update_weights(unpack_weights(packed))
        self.version = version
        return seconds

    def close(self) -> None:
        self.engine.close()


class TrainerWorker:
    def __init__(self, cfg: Any, base_dir: str, resume_from: str | None, cpus: float = 1.0) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from parity.rollout import resolve_device
        from parity.training.trainer import Trainer

        _threads(cpus)
        self.cfg = cfg = _cfg(cfg)
        seed = int(cfg.trainer.seed)
        random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
        self.tok = AutoTokenizer.from_pretrained(base_dir)
        model = AutoModelForCausalLM.from_pretrained(resume_from or base_dir, dtype=torch.float32)
        self.trainer = Trainer(model, cfg, resolve_device(cfg.trainer.device))
        self.step_count = 0
        if cfg.rollout.capture_routing:
            from parity.moe.replay import TrainerReplay
            self.trainer.replay = TrainerReplay(self.trainer.model)
        if resume_from is not None:
            state = torch.load(Path(resume_from) / "state.pt", weights_only=False)
            self.trainer.load_state_dict(state["trainer"])
            set_rng_state(state["rng"])
            self.step_count = int(state["step"])

    def ready(self) -> dict:
        return {"pid": os.getpid(), "step": self.step_count}

    def step(self, batch: Any) -> tuple[dict[str, float], list]:
        """One RL update, then the new weights into the object store. The reference comes back inside a list so
        the driver passes it on without fetching the weights itself."""
        import ray

        from parity.distributed.weights import pack_weights

        t0 = time.perf_counter()
        metrics = self.trainer.step(batch)
        t1 = time.perf_counter()
        ref = ray.put(pack_weights(self.trainer.sync_weights()))
        self.step_count += 1
        metrics.update({"perf/train_s": t1 - t0, "perf/publish_s": time.perf_counter() - t1})
        return metrics, [ref]

    def save_checkpoint(self, run_dir: str, step: int, data_state: dict, keep: int) -> str:
        from parity.training.checkpoint import CheckpointManager

        state = {"step": step, "trainer": self.trainer.state_dict(), "data": data_state, "rng": rng_state()}
        return str(CheckpointManager(run_dir, keep=keep).save(step, self.trainer.model, self.tok, state))
