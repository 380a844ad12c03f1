"""The checks of the `distributed` section, which the config validation and the Ray runner both apply."""

from __future__ import annotations

from typing import TYPE_CHECKING

from parity.errors import ParityError

if TYPE_CHECKING:
    from parity.config.schema import DistributedConfig

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
BACKENDS = ("auto", "gloo", "nccl")
WEIGHT_SYNCS = ("auto", "object_store", "broadcast")


def trainer_workers(dcfg: DistributedConfig) -> int:
    return int(dcfg.trainer_workers)


def check_distributed(dcfg: DistributedConfig) -> None:
    """The `distributed` section's ranges and combinations (no Ray needed); ParityError names the key."""
    def need(ok: bool, key: str, msg: str) -> None:
        if not ok:
            raise ParityError(f"config key `distributed.{key}`: {msg}")
    need(dcfg.num_rollout_workers >= 1, "num_rollout_workers", f"must be >= 1, got {dcfg.num_rollout_workers}")
    for key in ("rollout_cpus", "rollout_gpus", "trainer_cpus", "trainer_gpus"):
        need(float(getattr(dcfg, key)) >= 0, key, f"must be >= 0, got {getattr(dcfg, key)}")
    need(dcfg.rollout_cpus > 0 or dcfg.rollout_gpus > 0, "rollout_cpus", "a rollout worker needs some CPU or GPU")
    need(dcfg.max_worker_restarts >= 0, "max_worker_restarts", f"must be >= 0, got {dcfg.max_worker_restarts}")
    need(dcfg.max_shard_retries >= 0, "max_shard_retries", f"must be >= 0, got {dcfg.max_shard_retries}")
    need(dcfg.placement_strategy in STRATEGIES, "placement_strategy",
         f"must be one of {', '.join(STRATEGIES)}, got {dcfg.placement_strategy!r}")
    need(dcfg.start_attempts >= 1, "start_attempts", f"must be >= 1, got {dcfg.start_attempts}")
    need(dcfg.num_cpus is None or dcfg.num_cpus >= 1, "num_cpus", f"must be >= 1 or null, got {dcfg.num_cpus}")
    workers, backend = trainer_workers(dcfg), str(dcfg.backend)
    need(workers >= 1, "trainer_workers", f"must be >= 1, got {workers}")
    need(backend in BACKENDS, "backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
    sync = str(dcfg.weight_sync)
    need(sync in WEIGHT_SYNCS, "weight_sync", f"must be one of {', '.join(WEIGHT_SYNCS)}, got {sync!r}")
    timeout = float(dcfg.init_timeout_s)
    need(timeout > 0, "init_timeout_s", f"must be > 0, got {timeout}")
    gpus = float(dcfg.trainer_gpus)
    need(backend != "nccl" or gpus > 0, "backend",
         "nccl needs the trainer workers on GPUs (distributed.trainer_gpus=1); use gloo or auto on CPU")
    need(backend != "gloo" or gpus == 0 or (workers == 1 and sync == "object_store"), "backend",
         "gloo runs the sharded trainer and the weight broadcast on CPU only; with distributed.trainer_gpus > 0 use "
         "nccl or auto")
    need(workers == 1 or gpus in (0.0, 1.0), "trainer_gpus",
         f"a sharded trainer worker (distributed.trainer_workers={workers}) takes 0 or exactly 1 GPU, got {gpus}")
    need(sync != "broadcast" or (gpus > 0) == (float(dcfg.rollout_gpus) > 0), "weight_sync",
         "broadcast needs the trainer and the rollout workers on the same kind of device (both on GPUs: nccl, "
         f"both on CPUs: gloo); got trainer_gpus={gpus}, rollout_gpus={dcfg.rollout_gpus}")
