"""The two Ray actors of the loop. Plain classes here; parity.distributed.driver wraps them with ray.remote and
the resources of the config.

RolloutWorker holds one engine (build_engine: torch or vLLM; capturing MoE routing where rollout.capture_routing
says so) and samples a shard of a step's prompts. TrainerWorker holds the policy (parity.training.trainer.Trainer:
routing replay, corrections and their state, drift telemetry as in one process); after each step it publishes
the new weights to the object store once (one ray.put) and the driver hands that reference to every worker. It
also writes checkpoints, in the layout and with the state the in-process runner writes, so a run can resume
either way.

With distributed.trainer_workers = W > 1 there are W TrainerWorkers, ranks 0..W-1 of one torch.distributed
group (rank 0 picks the rendezvous address, the driver passes it to all: `rendezvous`, then `join`), each holding
a shard of the policy (parity.training.sharded). Every rank receives every step and checkpoint call (they are
collectives); rank 0 publishes the gathered weights and writes the checkpoint.

With distributed.weight_sync=broadcast the weights go from trainer rank 0 to the rollout workers over a process
group of their own (parity.distributed.weight_broadcast): `send_weights` on every trainer rank paired with
`receive_weights` on every rollout worker. Over NCCL this path has not been run yet (no multi-GPU host has);
over gloo it runs in tests/test_distributed_fsdp.py."""

from __future__ import annotations

import os
import random
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch

from parity.config import ParityConfig, from_plain
from parity.distributed.cluster import NO_MULTICAST, weight_sync
from parity.distributed.weight_broadcast import WeightBroadcast, free_port, node_address
from parity.distributed.weights import pack_weights, unpack_weights
from parity.rollout import build_engine, resolve_device
from parity.training.checkpoint import CheckpointManager, read_state, set_rng_state, training_state
from parity.training.local import sync_engine
from parity.training.sharded import GatheredModel, ShardedTrainer
from parity.training.trainer import build_trainer


def _threads(cpus: float) -> None:
    torch.set_num_threads(max(1, int(cpus)))


def _cfg(cfg: ParityConfig | dict) -> ParityConfig:
    return from_plain(cfg) if isinstance(cfg, dict) else cfg


class RolloutWorker:
    def __init__(self, cfg: ParityConfig, model_dir: str, version: int, cpus: float = 1.0, base_dir: str | None = None) -> None:
        """`base_dir`: the run's starting model, theta_0 of a rollout perturbation (parity.rollout.perturbed)."""
        _threads(cpus)
        self.cfg = _cfg(cfg)
        self.engine = build_engine(self.cfg, model_dir, reference_dir=base_dir, syncs=version)
        self.version = version  # trainer steps behind the weights this engine holds

    def ready(self) -> dict:
        return {"pid": os.getpid(), "version": self.version, "engine": self.engine.describe()}

    def generate(self, prompt_token_ids: list[list[int]], spec: Any, prompt_ids: list[int]) -> tuple[Any, int]:
        batch = self.engine.generate(prompt_token_ids, spec, prompt_ids=prompt_ids)
        return batch, self.version

    def update_weights(self, packed: dict, version: int) -> float:
        """`packed` arrives resolved from the object store (parity.distributed.weights)."""
        seconds = sync_engine(self.engine, unpack_weights(packed), version)
        self.version = version
        return seconds

    def join_weight_group(self, address: str, port: int, rank: int, world: int, backend: str, meta: list,
                          timeout_s: float) -> dict:
        for k, v in NO_MULTICAST.items():
            os.environ.setdefault(k, v)
        self.weight_device = resolve_device(self.cfg.trainer.device)
        if self.weight_device.type == "cuda":
            torch.cuda.set_device(self.weight_device.index or 0)
        self.weight_group = WeightBroadcast(address, port, rank, world, backend, timeout_s)
        self.weight_meta = meta
        return {"rank": rank, "backend": backend}

    def receive_weights(self, version: int) -> float:
        """The trainer's broadcast, loaded as it arrives (one tensor at a time)."""
        t0 = time.perf_counter()
        named = self.weight_group.receive(self.weight_meta, self.weight_device)
        sync_engine(self.engine, named, version)
        for _ in named:  # every tensor is a collective: take the rest even if the engine stopped early
            pass
        self.version = version
        return time.perf_counter() - t0

    def close(self) -> None:
        self.engine.close()


def resolve_backend(name: str, device: torch.device) -> str:
    if name == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return name


class TrainerWorker:
    def __init__(self, cfg: ParityConfig, base_dir: str, resume_from: str | None, cpus: float = 1.0, rank: int = 0,
                 world: int = 1, measured_discrepancy: float | None = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        _threads(cpus)
        self.cfg = cfg = _cfg(cfg)
        self.rank, self.world = int(rank), int(world)
        self.device = resolve_device(cfg.trainer.device)
        self.weight_sync = weight_sync(cfg.distributed)
        self.weight_group: Any = None
        seed = int(cfg.trainer.seed)
        random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
        self.tok = AutoTokenizer.from_pretrained(base_dir)
        self.resume_from, self.base_dir = resume_from, base_dir
        self.measured_discrepancy = measured_discrepancy  # for tolerance=auto (parity.training.tolerance)
        self.step_count = 0
        model = AutoModelForCausalLM.from_pretrained(resume_from or base_dir, dtype=torch.float32)
        if self.world == 1:
            self._build(model)
        else:
            self._model = model  # sharded in join(), once the process group exists

    def _build(self, model: Any) -> None:
        if self.world == 1:  # routing replay (R3) happens inside the Trainer's step when the batch carries routing
            self.trainer = build_trainer(model, self.cfg, self.device, reference_dir=self.base_dir,
                                   measured_discrepancy=self.measured_discrepancy)
        else:
            self.trainer = ShardedTrainer(model, self.cfg, self.device, self.measured_discrepancy)
        if self.resume_from is not None:  # every rank reads the single-process layout and keeps its shard
            state = read_state(Path(self.resume_from))
            self.trainer.load_state_dict(state["trainer"])
            set_rng_state(state["rng"])
            self.step_count = int(state["step"])

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: an address and a free port of this node for a process group's store."""
        return node_address(), free_port()

    def join(self, address: str, port: int, timeout_s: float) -> dict:
        """Form the trainer ranks' process group (all ranks call this at once), then shard the policy."""
        import torch.distributed as dist

        for k, v in NO_MULTICAST.items():
            os.environ.setdefault(k, v)
        backend = resolve_backend(str(self.cfg.distributed.backend), self.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)  # Ray shows each actor its own GPU as cuda:0
        dist.init_process_group(backend, init_method=f"tcp://{address}:{port}", rank=self.rank,
                                world_size=self.world, timeout=timedelta(seconds=timeout_s))
        self._build(self._model)
        del self._model
        return {"rank": self.rank, "backend": backend}

    def ready(self) -> dict:
        return {"pid": os.getpid(), "step": self.step_count, "rank": self.rank}

    def step(self, batch: Any) -> tuple[dict[str, float], list]:
        """One RL update, then (object_store) the new weights into the object store: gathered over the ranks,
        put by rank 0. The reference comes back inside a list so the driver passes it on without fetching the
        weights itself; other ranks return [None]."""
        import ray

        t0 = time.perf_counter()
        metrics = self.trainer.step(batch)
        t1 = time.perf_counter()
        ref = None
        if self.weight_sync == "object_store":
            named = self.trainer.sync_weights()  # a generator of collectives when sharded: every rank drains it
            if self.rank == 0:
                ref = ray.put(pack_weights(named))
            else:
                for _ in named:
                    pass
        self.step_count += 1
        metrics.update({"perf/train_s": t1 - t0, "perf/publish_s": time.perf_counter() - t1})
        return metrics, [ref]

    # ---- weight broadcast (distributed.weight_sync=broadcast) ----

    def weight_meta(self) -> tuple[list, str]:
        """What the rollout workers must allocate, in send order, and the broadcast backend."""
        dtype = str(self.trainer.compute_dtype).removeprefix("torch.")
        meta = [(n, tuple(p.shape), dtype) for n, p in self.trainer.model.named_parameters()]
        return meta, ("nccl" if self.device.type == "cuda" else "gloo")

    def join_weight_group(self, address: str, port: int, world: int, timeout_s: float) -> dict:
        """Rank 0: the sender (rank 0) of the weight group; the rollout workers join as ranks 1..world-1."""
        _, backend = self.weight_meta()
        self.weight_group = WeightBroadcast(address, port, 0, world, backend, timeout_s)
        return {"rank": 0, "backend": backend}

    def send_weights(self) -> float:
        """Every trainer rank takes part in the gathers; rank 0 broadcasts each full tensor as it is gathered."""
        t0 = time.perf_counter()
        named = self.trainer.sync_weights()
        if self.rank == 0:
            self.weight_group.send(named)
        else:
            for _ in named:
                pass
        return time.perf_counter() - t0

    def publish(self) -> list:
        """The current weights into the object store outside a step (collective when sharded): [ObjectRef] from
        rank 0, [None] from the others."""
        import ray

        named = self.trainer.sync_weights()
        if self.rank == 0:
            return [ray.put(pack_weights(named))]
        for _ in named:
            pass
        return [None]

    def save_checkpoint(self, run_dir: str, step: int, data_state: dict, keep: int) -> str:
        """Sharded: every rank gathers (collectives), rank 0 writes the single-process layout; others return ""."""
        state = training_state(step, self.trainer, data_state)
        model: Any = self.trainer.model
        if self.world > 1:
            model = GatheredModel(self.trainer.model, self.trainer.full_model_state())
            if self.rank != 0:
                return ""
        return str(CheckpointManager(run_dir, keep=keep).save(step, model, self.tok, state))
