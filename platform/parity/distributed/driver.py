"""The Ray runner of the RL loop (parity.training.loop; `python -m parity train distributed.enabled=true` picks it):
rollout worker actors as the rollout side
(parity.distributed.rollout_pool), trainer actor(s) as the learner side, placed with one placement group.

    per step:  rollout (sharded over N workers) -> grade (in the driver) -> trainer step (actor) -> publish weights
               (one ray.put, or a collective broadcast) -> every worker loads them -> (eval, checkpoint, log)

Resume: rerun the same command with trainer.resume=true; the trainer actors restore weights, optimizer, correction
state and RNG from the latest valid checkpoint, the loop the data position, and metrics.jsonl is cut back."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from parity.config import as_plain
from parity.config.distributed import trainer_workers
from parity.distributed.actors import RolloutWorker, TrainerWorker
from parity.distributed.cluster import in_bundle, placement, ray_session, weight_sync
from parity.distributed.rollout_pool import Broadcast, RolloutPool
from parity.distributed.weights import unpack_weights
from parity.training.checkpoint import CheckpointManager
from parity.training.runner import Sides

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig

log = logging.getLogger(__name__)


class TrainerGroup:
    """The trainer actor(s) as the learner side: every call goes to every rank (the sharded trainer's steps,
    gathers and checkpoints are collectives); rank 0's answer is the group's."""

    def __init__(self, actors: list[Any], sync: str) -> None:
        self.actors, self.sync = actors, sync
        self.latest: list[Any] = [None]  # [ObjectRef] of the weights rank 0 put after the last step (object_store)

    def _all(self, method: str, *args: Any) -> Any:
        import ray
        return ray.get([getattr(a, method).remote(*args) for a in self.actors])[0]

    def step(self, batch: Any) -> dict[str, float]:
        import ray
        t0 = time.perf_counter()
        ref = ray.put(batch) if len(self.actors) > 1 else batch  # one copy in the object store for all ranks
        metrics, self.latest = self._all("step", ref)
        metrics["perf/trainer_call_s"] = time.perf_counter() - t0
        return metrics

    def publish(self) -> list[Any] | Broadcast:
        if self.sync == "broadcast":
            return Broadcast([a.send_weights.remote() for a in self.actors])
        return self.latest

    def weights(self) -> Any:
        import ray

        if self.latest[0] is None:  # before the first step, or with weights broadcast: rank 0 puts them now
            self.latest = self._all("publish")
        return unpack_weights(ray.get(self.latest[0]))

    def save(self, ckpts: CheckpointManager, step: int, data_state: dict) -> None:
        self._all("save_checkpoint", str(ckpts.root.parent), step, data_state, ckpts.keep)

    def kill(self) -> None:
        import ray
        for a in self.actors:
            ray.kill(a)


def start_actors(cfg: ParityConfig, pg: Any, base_dir: str, start_dir: str, resume_from: str | None,
                 start_step: int, measured_discrepancy: float | None = None) -> tuple[TrainerGroup, list[Any]]:
    """Rollout worker i in bundle i, trainer rank r in the bundle after them; the rollout workers restart on their
    own (not with weight_sync=broadcast: a restarted worker cannot rejoin the weight group)."""
    import ray

    d, plain = cfg.distributed, as_plain(cfg)
    world, sync, timeout = trainer_workers(d), weight_sync(d), float(d.init_timeout_s)
    # named after the run: a second driver of the same run in the same namespace fails fast instead of
    # training alongside, and operators (and tests) can find a worker with ray.get_actor
    name = f"parity-{cfg.trainer.run_name}"
    remote_trainer = ray.remote(TrainerWorker)
    trainers = [remote_trainer.options(
        name=f"{name}-trainer" + (f"-{r}" if r else ""), num_cpus=d.trainer_cpus, num_gpus=d.trainer_gpus,
        max_restarts=0, scheduling_strategy=in_bundle(pg, d.num_rollout_workers + r)).remote(
            plain, base_dir, resume_from, d.trainer_cpus, r, world, measured_discrepancy) for r in range(world)]
    remote_worker = ray.remote(RolloutWorker)
    restarts = 0 if sync == "broadcast" else d.max_worker_restarts
    workers = [remote_worker.options(name=f"{name}-rollout-{i}", num_cpus=d.rollout_cpus, num_gpus=d.rollout_gpus,
                                     max_restarts=restarts, max_task_retries=0,
                                     scheduling_strategy=in_bundle(pg, i)).remote(plain, start_dir, start_step,
                                                                                  d.rollout_cpus, base_dir)
               for i in range(d.num_rollout_workers)]
    if world > 1:  # rank 0 chooses the rendezvous; every rank joins at once, then shards its policy
        address, port = ray.get(trainers[0].rendezvous.remote())
        ray.get([t.join.remote(address, port, timeout) for t in trainers])
    ray.get([*[t.ready.remote() for t in trainers], *[w.ready.remote() for w in workers]])
    if sync == "broadcast":
        meta, backend = ray.get(trainers[0].weight_meta.remote())
        address, port = ray.get(trainers[0].rendezvous.remote())
        n = len(workers) + 1
        ray.get([trainers[0].join_weight_group.remote(address, port, n, timeout),
                 *[w.join_weight_group.remote(address, port, i + 1, n, backend, meta, timeout)
                   for i, w in enumerate(workers)]])
    return TrainerGroup(trainers, sync), workers


@contextlib.contextmanager
def ray_runner(cfg: ParityConfig, base_dir: str, run: Any, measured_discrepancy: float | None = None) -> Iterator[Sides]:
    """A Ray session (joined or started), the placement group and the actors for the duration of the run."""
    import ray
    from transformers import AutoTokenizer

    resume_from = str(run.resume_from) if run.resume_from is not None else None
    pad_id = AutoTokenizer.from_pretrained(base_dir).pad_token_id
    with ray_session(cfg.distributed) as cluster:
        pg = placement(cfg.distributed)
        learner, workers = start_actors(cfg, pg, base_dir, resume_from or base_dir, resume_from, run.start_step,
                                        measured_discrepancy)
        pool = RolloutPool(workers, pad_id, cfg.distributed, version=run.start_step)
        summary: dict[str, Any] = {"engine": pool.describe(), "distributed": {
            **cluster, "rollout_workers": len(workers), "trainer_workers": len(learner.actors),
            "weight_sync": learner.sync, "off_policy_overlap": bool(cfg.distributed.off_policy_overlap)}}
        try:
            yield Sides(pool, learner, summary)
        finally:
            pool.close()
            learner.kill()
            ray.util.remove_placement_group(pg)
        summary["distributed"]["worker_restarts"] = pool.restarts_total


__all__ = ["ray_runner", "start_actors", "TrainerGroup"]
