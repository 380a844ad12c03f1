"""The distributed loop on a real local Ray (one per module): sharded rollouts equal one worker's, a rollout
worker killed mid-rollout is restarted and its shard retried with the newest weights, and a whole run over Ray,
with a worker killed in the middle, reproduces the in-process loop's metrics and weights."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from parity.config import as_plain

ray = pytest.importorskip("ray")

from parity.core.sampling import SamplingSpec  # noqa: E402
from parity.distributed.actors import RolloutWorker  # noqa: E402
from parity.distributed.cluster import ray_session  # noqa: E402
from parity.distributed.rollout_pool import RolloutPool  # noqa: E402
from parity.distributed.weights import pack_weights  # noqa: E402
from parity.rollout import build_engine  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the Ray actors run one OpenMP thread each

# dual correction: its advantage shift makes every step move the weights even when all rewards are 0 (the quick
# model rarely answers right), and its lambda is correction state that checkpoints must carry
DIST = ["algorithm.correction.name=dual", "distributed.enabled=true", "distributed.num_rollout_workers=2",
        "distributed.rollout_cpus=1", "distributed.trainer_cpus=1", "distributed.num_cpus=6",
        "distributed.max_worker_restarts=2"]


@pytest.fixture(scope="module")
def ray_cluster(quick_cfg):
    with ray_session(quick_cfg(*DIST).distributed) as info:
        yield info


@pytest.fixture(scope="module")
def workers(ray_cluster, quick_cfg, prepared_model):
    plain = as_plain(quick_cfg(*DIST))
    remote = ray.remote(RolloutWorker).options(num_cpus=1, max_restarts=2, max_task_retries=0)
    ws = [remote.remote(plain, str(prepared_model), 0, 1.0) for _ in range(2)]
    ray.get([w.ready.remote() for w in ws])
    yield ws
    for w in ws:
        ray.kill(w, no_restart=True)


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14], [15], [16, 17, 18]]  # uneven lengths, uneven shards
SPEC = SamplingSpec(temperature=1.0, max_new_tokens=8, n=3, topk_logprobs=4, seed=11)


def _pool(ws, quick_cfg):
    return RolloutPool(ws, pad_token_id=0, dcfg=quick_cfg(*DIST).distributed)


def _assert_same(a, b) -> None:
    for f in ("prompts", "prompt_mask", "responses", "response_mask", "rollout_logprobs", "truncated", "group_ids",
              "prompt_ids", "topk_ids", "topk_logprobs"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f


def test_two_workers_give_the_one_worker_batch_bit_for_bit(workers, quick_cfg, prepared_model) -> None:
    two = _pool(workers, quick_cfg).generate(PROMPTS, SPEC)
    one = _pool(workers[:1], quick_cfg).generate(PROMPTS, SPEC)
    assert two.batch_size == 15 and two.group_ids.tolist() == [g for g in range(5) for _ in range(3)]
    _assert_same(two, one)
    # and both equal the engine called in this process on the whole batch
    local = build_engine(quick_cfg(), prepared_model).generate(PROMPTS, SPEC)
    _assert_same(two, local)
    other_seed = _pool(workers, quick_cfg).generate(PROMPTS, SamplingSpec(**{**SPEC.__dict__, "seed": 12}))
    assert not torch.equal(other_seed.responses, two.responses)  # the comparison can fail


def test_worker_killed_mid_rollout_is_restarted_with_latest_weights(workers, quick_cfg, prepared_model) -> None:
    pool = _pool(workers, quick_cfg)
    before = pool.generate(PROMPTS, SPEC)
    # new weights (perturbed) go to both workers through the object store
    engine = build_engine(quick_cfg(), prepared_model)
    g = torch.Generator().manual_seed(0)
    new = [(n, (p.detach() + 0.05 * torch.randn(p.shape, generator=g)).to(torch.bfloat16))
           for n, p in engine.model.named_parameters()]
    pool.broadcast([ray.put(pack_weights(new))], version=1, wait=True)
    expected = _pool(workers[:1], quick_cfg).generate(PROMPTS, SPEC)  # worker 0 alone, new weights
    assert not torch.equal(expected.rollout_logprobs, before.rollout_logprobs)

    victim = ray.get(workers[1].ready.remote())["pid"]
    pending = pool.submit(PROMPTS, SPEC)
    os.kill(victim, signal.SIGKILL)  # dies while (or before) sampling its shard
    result = pool.collect(pending)
    assert pool.restarts_total == 1 and pool.pop_restarts() == 1 and pool.pop_restarts() == 0
    assert ray.get(workers[1].ready.remote())["pid"] != victim
    assert result.min_version == 1  # the restarted worker got the newest weights before the retry
    _assert_same(result.batch, expected)


def _non_perf(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("perf/", "faults/", "data/"))} for r in rows]


def _rows(run_dir: str) -> list[dict]:
    from parity.training.loop import MetricsLog
    return MetricsLog(Path(run_dir) / "metrics.jsonl").read()


def _weights(ckpt: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(ckpt) / "model.safetensors"))


class KillWorker:
    """Kills rollout worker 1 of the run after step 1: step 2's shard meets a dead worker."""

    def __init__(self, run_name: str) -> None:
        self.run_name, self.killed = run_name, None

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        if step == 1:
            w = ray.get_actor(f"parity-{self.run_name}-rollout-1")
            self.killed = ray.get(w.ready.remote())["pid"]
            os.kill(self.killed, signal.SIGKILL)


def test_distributed_run_with_a_killed_worker_matches_the_in_process_loop(ray_cluster, quick_cfg,
                                                                          prepared_model) -> None:
    from parity.commands.train import train

    steps = ["trainer.total_steps=3", "trainer.eval_every=3"]
    kill = KillWorker("ray3")
    dist = train(quick_cfg(*DIST, *steps, "trainer.run_name=ray3"), callbacks=[kill])
    local = train(quick_cfg(*DIST[:1], *steps, "trainer.run_name=local3"))
    assert kill.killed is not None and dist["distributed"]["worker_restarts"] == 1
    rows, ref = _rows(dist["run_dir"]), _rows(local["run_dir"])
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert [r.get("faults/worker_restarts") for r in rows] == [None, 0.0, 1.0, 0.0]
    assert all(r["perf/staleness"] == 0.0 for r in rows[1:])
    got, want = _non_perf(rows), _non_perf(ref)
    assert [sorted(r) for r in got] == [sorted(r) for r in want]
    # mismatch statistics of ~1e-8 are float noise of two processes' reductions; everything else is exact
    assert got == [pytest.approx(r, rel=1e-6, abs=1e-6) for r in want]
    assert rows[-1]["correction/lambda"] != rows[1]["correction/lambda"]  # correction state moves step to step
    w_dist, w_ref = _weights(dist["latest_checkpoint"]), _weights(local["latest_checkpoint"])
    w0 = _weights(str(prepared_model))
    assert w_dist.keys() == w_ref.keys()
    assert all(torch.equal(w_dist[k], w_ref[k]) for k in w_ref)
    assert any(not torch.equal(w_dist[k], w0[k]) for k in w0)  # training moved the weights
    for key in ("run_dir", "initial_accuracy", "final_accuracy", "final_reward", "latest_checkpoint", "steps"):
        assert key in dist


def test_off_policy_overlap_logs_staleness_and_checkpoints_the_step_data_position(ray_cluster, quick_cfg,
                                                                                  prepared_model) -> None:
    from parity.commands.train import train
    from parity.data.prompts import build_train_stream

    cfg = quick_cfg(*DIST, "trainer.total_steps=3", "trainer.keep_checkpoints=3", "distributed.off_policy_overlap=true",
                    "trainer.run_name=overlap3")
    out = train(cfg)
    rows = _rows(out["run_dir"])
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    # step t+1 was sampled before the trainer's step t: one update behind, except the first step
    assert [r["perf/staleness"] for r in rows[1:]] == [0.0, 1.0, 1.0]
    stream = build_train_stream(cfg.data, seed=int(cfg.trainer.seed))
    for step in (1, 2):  # the prefetch of step+1 must not leak into the checkpoint of step
        stream.take(cfg.trainer.prompts_per_step)
        state = torch.load(Path(out["run_dir"]) / "checkpoints" / f"step_{step:06d}" / "state.pt", weights_only=False)
        assert state["data"] == stream.state_dict()
