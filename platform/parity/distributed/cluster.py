"""Ray: join a cluster or start a local one, and place the actors with one placement group.

`distributed.address` empty starts a local Ray sized from the config and shuts it down at the end; `auto` or
`ray://host:port` (or a GCS address host:port) joins an existing cluster, which is left running. When Ray is
already initialised in this process (tests, notebooks) it is used as it is."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from parity.config.distributed import check_distributed, trainer_workers
from parity.errors import ParityError

if TYPE_CHECKING:
    from parity.config.schema import DistributedConfig

log = logging.getLogger(__name__)

# NVLink multicast off (NCCL, PyTorch symmetric memory, NVSHMEM) in every process that may run NCCL
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def bundles(dcfg: DistributedConfig) -> list[dict[str, float]]:
    """One bundle per rollout worker, then one per trainer worker (rank 0 first); zero GPU counts are left out
    (a CPU node has none). With GPUs each trainer worker's bundle holds whole GPUs of its own, so the rollout
    workers' GPUs are others."""
    def bundle(cpus: float, gpus: float) -> dict[str, float]:
        b = {"CPU": float(cpus)}
        if gpus:
            b["GPU"] = float(gpus)
        return b
    return ([bundle(dcfg.rollout_cpus, dcfg.rollout_gpus) for _ in range(dcfg.num_rollout_workers)]
            + [bundle(dcfg.trainer_cpus, dcfg.trainer_gpus) for _ in range(trainer_workers(dcfg))])


def weight_sync(dcfg: DistributedConfig) -> str:
    """object_store or broadcast (auto = object_store: the path run end to end on every machine so far)."""
    mode = str(dcfg.weight_sync)
    return "object_store" if mode == "auto" else mode


def _local_env() -> dict[str, str]:
    """Environment for the Ray processes we start (they inherit ours at start).

    OMP_WAIT_POLICY=PASSIVE: busy-waiting OpenMP threads slow shared CPUs 10-30x. Bytecode caching: when
    PYTHONDONTWRITEBYTECODE is set every Ray agent and worker compiles ray/torch from source at start, which on a
    loaded 2-core machine overruns the raylet's fixed 15 s wait for its agents; a private cache folder avoids
    that without writing into the installed packages."""
    env = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
           "MKL_CBWR": os.environ.get("MKL_CBWR", "AUTO,STRICT"),  # as parity/__init__ sets it, before any product
           "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM", "false"),
           "RAY_USAGE_STATS_ENABLED": "0",
           # a local Ray listens on 127.0.0.1 only (Ray otherwise binds the machine's address on every
           # interface); a Ray that other machines join is started with `ray start` and joined through
           # distributed.address
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    # NVLink multicast off for NCCL, PyTorch's symmetric memory and NVSHMEM (sharded trainer, weight broadcast):
    # on a shared multi-GPU host it can take the GPUs out of service
    env.update({k: os.environ.get(k, v) for k, v in NO_MULTICAST.items()})
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        env["PYTHONPYCACHEPREFIX"] = os.environ.get(
            "PYTHONPYCACHEPREFIX", os.path.join(tempfile.gettempdir(), f"parity-pycache-{os.getuid()}"))
    return env


@contextlib.contextmanager
def _patched_env(set_vars: dict[str, str], unset: tuple[str, ...]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in (*set_vars, *unset)}
    os.environ.update(set_vars)
    for k in unset:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def local_num_cpus(dcfg: DistributedConfig) -> int:
    return int(dcfg.num_cpus) if dcfg.num_cpus else max(1, math.ceil(sum(b["CPU"] for b in bundles(dcfg))))


@contextlib.contextmanager
def ray_session(dcfg: DistributedConfig) -> Iterator[dict]:
    """Connect (or start) Ray for the duration of the block; yields a description of the cluster."""
    import ray

    check_distributed(dcfg)
    if ray.is_initialized():
        yield {"address": "existing", "started": False}
        return
    address = str(dcfg.address or "")
    common = {"include_dashboard": False, "log_to_driver": True, "logging_level": logging.WARNING,
              "configure_logging": True}
    if address:
        # a driver joining a Ray that listens on loopback (one `distributed.enabled=true` started on this machine)
        # must take 127.0.0.1 as its own node's address too, or Ray looks for it under the machine's address
        with _loopback_node() if _is_loopback(address) else contextlib.nullcontext():
            ray.init(address=address, **common)
        info = {"address": address, "started": False}
    else:
        env = _local_env()
        unset = ("PYTHONDONTWRITEBYTECODE",) if "PYTHONPYCACHEPREFIX" in env else ()
        with _patched_env(env, unset):
            _start_local(ray, dcfg, common)
        info = {"address": ray.get_runtime_context().gcs_address, "started": True}
    try:
        yield info
    finally:
        ray.shutdown()  # stops the local Ray we started; only disconnects from a joined cluster


@contextlib.contextmanager
def _loopback_node() -> Iterator[None]:
    """Ray reads this flag (from the environment, when ray is imported) to pick this node's address: off, the
    node is 127.0.0.1 and every Ray server started here binds loopback. Set on the module, since ray may have
    been imported before the environment was."""
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def _is_loopback(address: str) -> bool:
    """Whether a Ray address (host:port, or `auto`: the Ray running on this machine) is on loopback."""
    if address.startswith("ray://"):
        return False
    if address == "auto":
        try:
            from ray._private.services import get_ray_address_from_environment

            address = get_ray_address_from_environment("auto", None) or ""
        except Exception:  # no Ray found: ray.init reports it
            return False
    return address.rsplit(":", 1)[0].strip("[]") in ("127.0.0.1", "localhost", "::1")


def _start_local(ray: Any, dcfg: DistributedConfig, common: dict) -> None:
    with _loopback_node():
        _start_local_attempts(ray, dcfg, common)


def _start_local_attempts(ray: Any, dcfg: DistributedConfig, common: dict) -> None:
    last: Exception | None = None
    for attempt in range(1, int(dcfg.start_attempts) + 1):
        try:
            ray.init(num_cpus=local_num_cpus(dcfg), num_gpus=None, object_store_memory=int(dcfg.object_store_mb) << 20,
                     **common)
            return
        except Exception as e:  # Ray raises a bare Exception when its node misses the start deadline
            last = e
            log.warning("local Ray did not start (attempt %d of %d): %s", attempt, dcfg.start_attempts, e)
            with contextlib.suppress(Exception):
                ray.shutdown()
    raise ParityError(f"could not start a local Ray in {dcfg.start_attempts} attempts "
                      f"(config key `distributed.start_attempts`): {last}")


def placement(dcfg: DistributedConfig, timeout_s: float = 300.0) -> Any:
    """Reserve every actor's resources at once, so a run never starts with only part of its workers."""
    import ray
    from ray.util.placement_group import placement_group

    pg = placement_group(bundles(dcfg), strategy=str(dcfg.placement_strategy), name="")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        avail = ray.available_resources()
        raise ParityError(f"the placement group {bundles(dcfg)} ({dcfg.placement_strategy}) could not be placed in "
                          f"{timeout_s:.0f} s; the cluster has {avail} free (config keys distributed.rollout_cpus, "
                          "distributed.rollout_gpus, distributed.trainer_cpus, distributed.trainer_gpus)")
    return pg


def in_bundle(pg: Any, index: int) -> Any:
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index,
                                            placement_group_capture_child_tasks=False)
