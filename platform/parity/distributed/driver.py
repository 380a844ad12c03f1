"""The RL loop as a driver over Ray actors; same run folder, metrics.jsonl and summary as parity.training.loop.

    per step:  rollout (sharded over N workers) -> grade (here) -> trainer step (actor) -> publish weights
               (one ray.put) -> every worker loads them -> (eval, checkpoint, log)

With `distributed.off_policy_overlap` the rollout of step t+1 is submitted before the trainer's step t, so it is
sampled with weights one update old (perf/staleness = 1) while grading and training proceed. Resume: rerun the
same command with trainer.resume=true; the trainer actor restores weights, optimizer, correction state and RNG
from the latest valid checkpoint, the driver the data position, and metrics.jsonl is cut back to that step."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from omegaconf import OmegaConf

from parity.data.prompts import build_train_stream, render_prompt
from parity.data.tasks import heldout_problems
from parity.distributed.actors import RolloutWorker, TrainerWorker
from parity.distributed.cluster import in_bundle, placement, ray_session, trainer_workers, weight_sync
from parity.distributed.rollout_pool import PendingRollout, RolloutPool
from parity.errors import ParityError
from parity.models.prepare import prepare_model
from parity.rollout import sampling_spec
from parity.training.checkpoint import CheckpointManager
from parity.training.collapse import CollapseAlarm
from parity.training.heldout import eval_settings, heldout_accuracy
from parity.training.loop import Callback, MetricsLog, run_dir_of

log = logging.getLogger(__name__)


class TrainerGroup:
    """The trainer actor(s) as one: every call goes to every rank (the sharded trainer's steps, gathers and
    checkpoints are collectives); rank 0's answer is the group's."""

    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors

    def step(self, batch: Any) -> tuple[dict[str, float], list]:
        import ray
        ref = ray.put(batch) if len(self.actors) > 1 else batch  # one copy in the object store for all ranks
        return ray.get([a.step.remote(ref) for a in self.actors])[0]

    def send_weights(self) -> list[Any]:
        return [a.send_weights.remote() for a in self.actors]

    def save_checkpoint(self, run_dir: str, step: int, data_state: dict, keep: int) -> str:
        import ray
        return ray.get([a.save_checkpoint.remote(run_dir, step, data_state, keep) for a in self.actors])[0]

    def kill(self) -> None:
        import ray
        for a in self.actors:
            ray.kill(a)


def start_actors(cfg: Any, pg: Any, base_dir: str, start_dir: str, resume_from: str | None,
                 start_step: int) -> tuple[TrainerGroup, list[Any]]:
    """Rollout worker i in bundle i, trainer rank r in the bundle after them; the rollout workers restart on their
    own (not with weight_sync=broadcast: a restarted worker cannot rejoin the weight group)."""
    import ray

    d, plain = cfg.distributed, OmegaConf.to_container(cfg, resolve=True)
    world, sync, timeout = trainer_workers(d), weight_sync(d), float(d.init_timeout_s)
    # named after the run: a second driver of the same run in the same namespace fails fast instead of
    # training alongside, and operators (and tests) can find a worker with ray.get_actor
    name = f"parity-{cfg.trainer.run_name}"
    remote_trainer = ray.remote(TrainerWorker)
    trainers = [remote_trainer.options(
        name=f"{name}-trainer" + (f"-{r}" if r else ""), num_cpus=d.trainer_cpus, num_gpus=d.trainer_gpus,
        max_restarts=0, scheduling_strategy=in_bundle(pg, d.num_rollout_workers + r)).remote(
            plain, base_dir, resume_from, d.trainer_cpus, r, world) for r in range(world)]
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
    return TrainerGroup(trainers), workers


def train_distributed(cfg: Any, callbacks: list[Callback] | None = None) -> dict:
    import ray
    from transformers import AutoTokenizer

    from parity.rewards.grader import GraderPool

    callbacks = list(callbacks or [])
    t_start, seed, tc = time.time(), int(cfg.trainer.seed), cfg.trainer
    run_dir = run_dir_of(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    from parity.tracking.secrets import masked_config_yaml
    (run_dir / "config.yaml").write_text(masked_config_yaml(cfg))  # no registry/MLflow passwords on disk
    ckpts = CheckpointManager(run_dir, keep=tc.keep_checkpoints)
    if not tc.resume and ckpts.list():
        raise ParityError(f"run {run_dir} already has checkpoints; set trainer.resume=true to continue it or "
                          "choose another trainer.run_name")
    resume_from = ckpts.latest_valid() if tc.resume else None
    base = str(prepare_model(cfg)["model_dir"])
    start_dir = str(resume_from or base)
    tok = AutoTokenizer.from_pretrained(base)
    stream = build_train_stream(cfg.data, seed=seed)
    start_step = 0
    if resume_from is not None:
        import torch
        state = torch.load(resume_from / "state.pt", weights_only=False)
        stream.load_state_dict(state["data"])
        start_step = int(state["step"])
        log.info("resumed %s from %s (step %d)", run_dir.name, resume_from, start_step)
    metrics_log = MetricsLog(run_dir / "metrics.jsonl")
    metrics_log.truncate_after(start_step)
    test_problems = heldout_problems(cfg, tc.eval_problems)

    with ray_session(cfg.distributed) as cluster:
        pg = placement(cfg.distributed)
        trainer, workers = start_actors(cfg, pg, base, start_dir, str(resume_from) if resume_from else None,
                                        start_step)
        pool = RolloutPool(workers, tok.pad_token_id, cfg.distributed, version=start_step)
        summary: dict[str, Any] = {"run_dir": str(run_dir), "start_step": start_step, "engine": pool.describe(),
                                   "distributed": {**cluster, "rollout_workers": len(workers),
                                                   "trainer_workers": len(trainer.actors),
                                                   "weight_sync": weight_sync(cfg.distributed),
                                                   "off_policy_overlap": bool(cfg.distributed.off_policy_overlap)}}
        try:
            with GraderPool(workers=cfg.eval.grade_workers, timeout_s=cfg.eval.grade_timeout_s) as grader:
                loop = _Loop(cfg, tok, stream, pool, trainer, grader, ckpts, metrics_log, callbacks, test_problems)
                summary.update(loop.run(start_step))
                summary["collapse_step"] = loop.alarm.fired_at
        finally:
            pool.close()
            trainer.kill()
            ray.util.remove_placement_group(pg)
        summary["distributed"]["worker_restarts"] = pool.restarts_total

    rows = metrics_log.read()
    accs = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    summary.update({"steps": tc.total_steps, "final_accuracy": accs[-1] if accs else None,
                    "initial_accuracy": summary.get("initial_accuracy", rows[0].get("eval/accuracy") if rows else None),
                    "final_reward": next((r["reward/mean"] for r in reversed(rows) if "reward/mean" in r), None),
                    "latest_checkpoint": str(ckpts.list()[-1]) if ckpts.list() else None,
                    "seconds": round(time.time() - t_start, 1)})
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


class _Loop:
    """The per-step sequence; a class only so the pieces it shares stay named instead of passed around."""

    def __init__(self, cfg: Any, tok: Any, stream: Any, pool: RolloutPool, trainer: TrainerGroup, grader: Any,
                 ckpts: CheckpointManager, metrics_log: MetricsLog, callbacks: list, test_problems: list) -> None:
        self.cfg, self.tok, self.stream, self.pool, self.trainer, self.grader = cfg, tok, stream, pool, trainer, grader
        self.ckpts, self.metrics_log, self.callbacks, self.test_problems = ckpts, metrics_log, callbacks, test_problems
        self.overlap = bool(cfg.distributed.off_policy_overlap)
        self.broadcast = weight_sync(cfg.distributed) == "broadcast"
        self.alarm = CollapseAlarm.from_config(cfg)
        self.alarm.replay(metrics_log.read())

    def evaluate(self) -> float:
        c = self.cfg
        return heldout_accuracy(self.pool, self.tok, self.test_problems, c.data.prompt_template, self.grader,
                                c.rollout.max_new_tokens, **eval_settings(c))

    def launch(self, step: int) -> PendingRollout:
        """Take the step's prompts and submit their rollout; the data position after the take is what a
        checkpoint at the end of this step must record (overlap takes the next step's prompts earlier)."""
        c = self.cfg
        problems = self.stream.take(c.trainer.prompts_per_step)
        ids = [self.tok(render_prompt(c.data.prompt_template, p.problem))["input_ids"] for p in problems]
        pending = self.pool.submit(ids, sampling_spec(c, seed=int(c.trainer.seed) * 1_000_003 + step),
                                   prompt_ids=list(range(len(problems))))
        pending.extra = {"problems": problems, "data": dict(self.stream.state_dict()), "t_submit": time.perf_counter()}
        return pending

    def run(self, start_step: int) -> dict:
        tc, out = self.cfg.trainer, {}
        if start_step == 0:
            out["initial_accuracy"] = acc = self.evaluate()
            self.emit(0, {"eval/accuracy": acc})
        pending = self.launch(start_step) if start_step < tc.total_steps else None
        for step in range(start_step, tc.total_steps):
            t0 = time.perf_counter()
            result = self.pool.collect(pending)
            t_roll = time.perf_counter()
            batch, extra = result.batch, pending.extra
            nxt = self.launch(step + 1) if self.overlap and step + 1 < tc.total_steps else None
            problems = extra["problems"]
            batch.texts = self.tok.batch_decode(batch.responses, skip_special_tokens=True)
            batch.answers = [problems[int(g)].answer for g in batch.group_ids]
            batch.rewards = self.grader.grade(batch.texts, batch.answers, batch.truncated.tolist())
            t_grade = time.perf_counter()
            metrics, weights = self.trainer.step(batch)
            t_train = time.perf_counter()
            if self.broadcast:
                metrics["perf/sync_s"] = self.pool.receive_broadcast(self.trainer.send_weights(), step + 1,
                                                                     wait=not self.overlap)
            else:
                metrics["perf/sync_s"] = self.pool.broadcast(weights, step + 1, wait=not self.overlap)
            n_tok = int(batch.response_mask.sum())
            # rollout time counts from submission: with overlap most of it hid behind the previous step
            roll_s = t_roll - extra["t_submit"]
            metrics.update({"perf/rollout_s": roll_s, "perf/rollout_wait_s": t_roll - t0,
                            "perf/grade_s": t_grade - t_roll, "perf/trainer_call_s": t_train - t_grade,
                            "perf/step_s": time.perf_counter() - t0,
                            "perf/rollout_tokens_per_s": n_tok / max(1e-9, roll_s),
                            "perf/train_tokens_per_s": n_tok / max(1e-9, metrics["perf/train_s"]),
                            "perf/staleness": float(step - result.min_version),
                            "faults/worker_restarts": float(self.pool.pop_restarts()),
                            "train/collapsed": self.alarm.update(step + 1, metrics["reward/mean"])})
            done = step + 1
            if tc.eval_every and (done % tc.eval_every == 0 or done == tc.total_steps):
                metrics["eval/accuracy"] = self.evaluate()
            if tc.checkpoint_every and (done % tc.checkpoint_every == 0 or done == tc.total_steps):
                self.trainer.save_checkpoint(str(self.ckpts.root.parent), done, extra["data"],
                                             int(tc.keep_checkpoints))
            self.emit(done, metrics)
            pending = nxt if self.overlap else (self.launch(done) if done < tc.total_steps else None)
            log.info("step %d/%d reward %.3f", done, tc.total_steps, metrics["reward/mean"])
        return out

    def emit(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics_log.append(step, metrics)
        for cb in self.callbacks:
            cb.on_step(step, metrics)


__all__ = ["train_distributed", "start_actors", "TrainerGroup"]
