"""N rollout worker actors as the loop's rollout side (parity.training.runner.RolloutSide) and behind the Engine
interface: a call is sharded over the workers, and the shards' batches are merged into the batch one engine would
have produced (parity.rollout.sharding).

Weights arrive either as one object-store reference that every worker reads (weight_sync=object_store) or by the
trainer's collective broadcast (`Broadcast`: the trainer ranks' send calls, which the workers' receives pair).

Faults: a worker that dies is restarted by Ray (`max_restarts`); the pool waits for it, pushes it the latest
weights (a restarted actor starts again from the run's starting weights) and retries the shard, at most
`distributed.max_shard_retries` times. Restarts are counted for the run's metrics (faults/worker_restarts)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from parity.core.sampling import SamplingSpec
from parity.distributed.weights import pack_weights
from parity.errors import ParityError
from parity.rollout.sharding import Shard, global_spec, merge_batches, shard_prompts
from parity.training.runner import RolloutResult
from parity.types import RolloutBatch

if TYPE_CHECKING:
    from parity.config.schema import DistributedConfig

log = logging.getLogger(__name__)


@dataclass
class PendingRollout:
    """A submitted rollout call: one object ref per shard, plus what is needed to retry a shard."""

    prompt_token_ids: list[list[int]]
    prompt_ids: list[int]
    spec: SamplingSpec
    shards: list[Shard]
    refs: list[Any]


@dataclass
class Broadcast:
    """weight_sync=broadcast: the trainer ranks' send_weights calls, already submitted."""

    sends: list[Any]


class RolloutPool:
    name = "ray"

    def __init__(self, workers: list[Any], pad_token_id: int, dcfg: DistributedConfig, version: int = 0) -> None:
        self.workers = workers
        self.pad_token_id = pad_token_id
        self.max_retries = int(dcfg.max_shard_retries)
        self.restart_timeout_s = float(dcfg.restart_timeout_s)
        self.latest: list[Any] | None = None  # [ObjectRef] of the newest published weights (kept alive here)
        self.latest_version = version
        self.pending_updates: list[Any] = []
        self.pending_sends: list[Any] = []  # weight_sync=broadcast: the trainer ranks' send_weights calls
        self.collective = False  # weights arrive by broadcast: a restarted worker cannot rejoin the group
        self.restarts_total = 0
        self._restarts_since = 0

    # ---- the Engine interface ----

    def generate(self, prompt_token_ids: list[list[int]], spec: SamplingSpec,
                 prompt_ids: list[int] | None = None) -> RolloutBatch:
        return self.collect(self.submit(prompt_token_ids, spec, prompt_ids)).batch

    def update_weights(self, named_tensors: Any) -> float:
        import ray

        t0 = time.perf_counter()
        self.broadcast([ray.put(pack_weights(named_tensors))], self.latest_version + 1, wait=True)
        return time.perf_counter() - t0

    def load(self, weights: list[Any] | Broadcast, version: int, wait: bool) -> float:
        """The loop's weight sync: the trainer's object-store reference ([ObjectRef]) or its broadcast."""
        if isinstance(weights, Broadcast):
            return self.receive_broadcast(weights.sends, version, wait)
        return self.broadcast(weights, version, wait)

    def step_metrics(self) -> dict[str, float]:
        return {"faults/worker_restarts": float(self.pop_restarts())}

    def describe(self) -> dict:
        import ray
        info = ray.get(self.workers[0].ready.remote())
        return {**info["engine"], "rollout_workers": len(self.workers)}

    def close(self) -> None:
        import ray
        for w in self.workers:
            ray.kill(w, no_restart=True)

    # ---- sharded calls ----

    def submit(self, prompt_token_ids: list[list[int]], spec: SamplingSpec,
               prompt_ids: list[int] | None = None) -> PendingRollout:
        ids = list(range(len(prompt_token_ids))) if prompt_ids is None else list(prompt_ids)
        if len(ids) != len(prompt_token_ids):
            raise ValueError(f"{len(prompt_token_ids)} prompts but {len(ids)} prompt ids")
        spec = global_spec(spec, prompt_token_ids)
        shards = shard_prompts(len(prompt_token_ids), len(self.workers))
        pending = PendingRollout(prompt_token_ids, ids, spec, shards, [None] * len(shards))
        for i, s in enumerate(shards):
            pending.refs[i] = self._call_shard(pending, s)
        return pending

    def _call_shard(self, p: PendingRollout, s: Shard) -> Any:
        return self.workers[s.worker].generate.remote(p.prompt_token_ids[s.start:s.stop], p.spec,
                                                      p.prompt_ids[s.start:s.stop])

    def begin(self, pending: PendingRollout) -> None:
        """Nothing to start: `submit` already sent every shard to its worker."""

    def collect(self, pending: PendingRollout) -> RolloutResult:
        import ray
        from ray.exceptions import RayActorError

        parts, versions = [], []
        for i, s in enumerate(pending.shards):
            for attempt in range(self.max_retries + 1):
                try:
                    batch, version = ray.get(pending.refs[i])
                    break
                except RayActorError as e:
                    if attempt == self.max_retries:
                        raise ParityError(f"rollout worker {s.worker} failed on prompts {s.start}-{s.stop - 1} "
                                          f"{attempt + 1} times (config key `distributed.max_shard_retries`="
                                          f"{self.max_retries}): {e}") from e
                    log.warning("rollout worker %d died during its shard (%s); restarting and retrying", s.worker,
                                type(e).__name__)
                    self.recover(s.worker)
                    pending.refs[i] = self._call_shard(pending, s)
            parts.append((s.start, batch))
            versions.append(version)
        return RolloutResult(merge_batches(parts, self.pad_token_id), min(versions))

    # ---- weights and faults ----

    def broadcast(self, weights: list[Any], version: int, wait: bool) -> float:
        """Every worker loads the published weights; `weights` is [ObjectRef], read by each worker from the object
        store. With wait=False the loads queue behind calls already submitted (off-policy overlap) and their times
        are collected at the next broadcast. Returns the slowest worker's load time of what was collected."""
        seconds = self._settle_updates()
        self.latest, self.latest_version = weights, version
        self.pending_updates = [(i, w.update_weights.remote(weights[0], version)) for i, w in enumerate(self.workers)]
        if wait:
            seconds = self._settle_updates()
        return seconds

    def receive_broadcast(self, sends: list[Any], version: int, wait: bool) -> float:
        """weight_sync=broadcast: every worker receives the trainer's broadcast (`sends` are the trainer ranks'
        send_weights calls, already submitted); otherwise as `broadcast`."""
        seconds = self._settle_updates()
        self.collective, self.latest, self.latest_version = True, None, version
        self.pending_updates = [(i, w.receive_weights.remote(version)) for i, w in enumerate(self.workers)]
        self.pending_sends = list(sends)
        if wait:
            seconds = self._settle_updates()
        return seconds

    def _settle_updates(self) -> float:
        import ray
        from ray.exceptions import RayActorError

        slowest = 0.0
        for i, ref in self.pending_updates:
            try:
                slowest = max(slowest, float(ray.get(ref)))
            except RayActorError:
                log.warning("rollout worker %d died while loading weights; restarting it", i)
                self.recover(i)
        self.pending_updates = []
        ray.get(self.pending_sends)
        self.pending_sends = []
        return slowest

    def recover(self, index: int) -> None:
        """Wait for Ray to bring worker `index` back, then give it the newest weights."""
        import ray
        from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

        if self.collective:
            raise ParityError(f"rollout worker {index} died, and with distributed.weight_sync=broadcast a restarted "
                              "worker cannot rejoin the weight group: rerun with trainer.resume=true (it continues from "
                              "the last checkpoint), or use distributed.weight_sync=object_store")
        self.restarts_total += 1
        self._restarts_since += 1
        # a queued weight load of the dead process is moot: the newest weights are pushed below
        self.pending_updates = [(i, ref) for i, ref in self.pending_updates if i != index]
        worker, deadline = self.workers[index], time.monotonic() + self.restart_timeout_s
        while True:
            try:
                ray.get(worker.ready.remote(), timeout=max(1.0, deadline - time.monotonic()))
                break
            except ActorDiedError as e:  # Ray says DEAD (out of restarts); a restarting actor is "unavailable"
                raise ParityError(f"rollout worker {index} is dead and out of restarts (config key "
                                  f"`distributed.max_worker_restarts`): {e}") from e
            except (RayActorError, GetTimeoutError) as e:
                if time.monotonic() > deadline:
                    raise ParityError(f"rollout worker {index} did not come back within "
                                      f"{self.restart_timeout_s:.0f} s (config key `distributed.restart_timeout_s`)"
                                      ) from e
                time.sleep(0.5)
        if self.latest is not None:
            ray.get(worker.update_weights.remote(self.latest[0], self.latest_version))

    def pop_restarts(self) -> int:
        """Restarts since the last call (one step's worth in the driver)."""
        n, self._restarts_since = self._restarts_since, 0
        return n

