"""One RL loop, two runners: the same short experiment run in this process and over Ray actors (one local Ray for
the module) logs the same metric names with the same values, and ends on the same weights, feature by feature.
Both runs are deterministic on the CPU in float32 with one thread per process (per-row sampling seeds); only
perf/* (timings) and faults/* (Ray's worker restarts) are the runner's own. A checkpoint of either runner resumes
on the other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

from parity.commands.train import train  # noqa: E402
from parity.distributed.cluster import ray_session  # noqa: E402
from parity.training.loop import MetricsLog  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the Ray actors run one OpenMP thread each

RAY = ["distributed.enabled=true", "distributed.rollout_cpus=1", "distributed.trainer_cpus=1",
       "distributed.num_cpus=3", "model.dtype=float32"]
# each feature with the settings that exercise it; two rollout workers where shards must merge (routing too)
CASES = {
    "dense_overlap_truncation": ["data=math", "distributed.off_policy_overlap=true", "distributed.num_rollout_workers=2"],
    "moe_replay": ["experiment=arith_tiny_moe", "distributed.num_rollout_workers=2"],
    # the seed experiment's shape: an INT8 W8A8 rollout, score centering on its top-K, unquantized evaluation
    "int8_score_centering_topk": ["+precision=w8a8_int8", "algorithm.correction.name=score_centering",
                                  "algorithm.policy_loss=reinforce", "rollout.topk_logprobs=8", "trainer.eval_every=2"],
}
# MoE experts run on the tokens routed to them: a shard's smaller batch rounds the rollout's log-probs differently
# (the statistics of p_inf move by 1e-8 or less); tokens, rewards, updates and weights stay exact
NOISY = {"moe_replay": ("mismatch/", "response/entropy")}
# the dual with its tolerance measured on the first step (state), the mismatch dial, an alarm quick to fire
DUAL = ["model.dtype=float32", "algorithm.correction.name=dual", "algorithm.correction.tolerance=auto",
        "algorithm.correction.tolerance_steps=1", "rollout.precision.perturbation.sigma=0.05", "trainer.eval_every=2",
        "trainer.collapse.fraction=0.5", "trainer.collapse.patience=1"]
SUMMARY_KEYS = ("start_step", "steps", "initial_accuracy", "final_accuracy", "final_reward", "collapse_step",
                "tolerance", "initial_accuracy_unquantized", "final_accuracy_unquantized")


@pytest.fixture(scope="module")
def ray_cluster(quick_cfg):
    with ray_session(quick_cfg(*RAY).distributed) as info:
        yield info


def _rows(summary: dict) -> list[dict]:
    return MetricsLog(Path(summary["run_dir"]) / "metrics.jsonl").read()


def _own(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("perf/", "faults/"))} for r in rows]


def _weights(summary: dict) -> dict[str, torch.Tensor]:
    return load_file(str(Path(summary["latest_checkpoint"]) / "model.safetensors"))


def _assert_same_run(local: dict, dist: dict, noisy: tuple[str, ...] = (), want_rows: list[dict] | None = None,
                     want_summary: dict | None = None) -> None:
    """`dist` ran what `local` ran: its rows (or `want_rows`), summary (updated by `want_summary`) and weights."""
    got, want = _own(_rows(dist)), want_rows or _own(_rows(local))
    assert [sorted(r) for r in got] == [sorted(r) for r in want]
    exact = [{k: v for k, v in r.items() if not k.startswith(noisy)} for r in got], \
        [{k: v for k, v in r.items() if not k.startswith(noisy)} for r in want]
    assert json.dumps(exact[0], sort_keys=True) == json.dumps(exact[1], sort_keys=True)  # bit for bit
    if noisy:
        assert got == [pytest.approx(r, rel=1e-6, abs=1e-6) for r in want]
    same = {k for k in SUMMARY_KEYS if k != "start_step"}
    assert {k: dist.get(k) for k in same} == {k: {**local, **(want_summary or {})}.get(k) for k in same}
    a, b = _weights(local), _weights(dist)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the runner's own metrics: both time the same phases; Ray also its trainer call, publishing and restarts
    shared = {"perf/rollout_s", "perf/rollout_wait_s", "perf/grade_s", "perf/train_s", "perf/sync_s", "perf/step_s",
              "perf/staleness", "perf/rollout_tokens_per_s", "perf/train_tokens_per_s"}
    ray_own = {"faults/worker_restarts", "perf/trainer_call_s", "perf/publish_s"} if "distributed" in dist else set()
    for r, d in zip(_rows(local)[1:], _rows(dist)[1:], strict=True):  # (rows this run wrote, not a resumed one's)
        assert shared <= r.keys() and shared | (ray_own if d["step"] > dist["start_step"] else set()) <= d.keys()


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_run_in_process_and_over_ray(case, ray_cluster, quick_cfg, prepared_model) -> None:
    over = [*CASES[case], "model.dtype=float32"]
    local = train(quick_cfg(*over, f"trainer.run_name=agree-{case}-local"))
    dist = train(quick_cfg(*over, *RAY, f"trainer.run_name=agree-{case}-ray"))
    assert dist["distributed"]["rollout_workers"] == (2 if "distributed.num_rollout_workers=2" in over else 1)
    _assert_same_run(local, dist, NOISY.get(case, ()))
    rows = _rows(dist)
    if case == "dense_overlap_truncation":  # MATH prompts can be longer than the tiny model's context leaves
        assert rows[1]["data/prompt_truncated_frac"] > 0
        assert [r["perf/staleness"] for r in rows[1:]] == [0.0, 1.0] == [r["perf/staleness"] for r in _rows(local)[1:]]
    if case == "moe_replay":  # the trainer replays exactly the experts the rollout workers recorded
        assert all(r["r3/routing_disagreement_replayed"] == 0.0 for r in rows[1:])
        assert all("r3/routing_disagreement" in r for r in rows[1:])
    if case == "int8_score_centering_topk":
        assert dist["engine"]["weights"] == "int8"
        assert [r["step"] for r in rows if "eval/accuracy_unquantized" in r] == [0, 2]
        assert "final_accuracy_unquantized" in dist and "initial_accuracy_unquantized" in dist
        # the engine's top-K reached the learner: the head's mass under p_inf, strictly inside (0, 1)
        assert all(0.0 < r["correction/sc_head_mass_inf"] < 1.0 for r in rows[1:])


def test_dual_with_the_dial_resumes_from_either_runner_on_the_other(ray_cluster, quick_cfg, prepared_model) -> None:
    """A run stops after 2 of 3 steps and resumes on the other runner (in process -> Ray, Ray -> in process): the
    same rows and weights as one uninterrupted run, the dual's lambda and its measured tolerance carried by the
    checkpoint; the collapse alarm is rebuilt from the metrics log (a reward written there before the resume makes
    it fire on the resumed step, as it would have had the run seen that reward)."""
    whole = train(quick_cfg(*DUAL, "trainer.total_steps=3", "trainer.run_name=agree-dual-whole"))
    want = _own(_rows(whole))
    assert [r["reward/mean"] for r in want[1:]] == [0.0, 0.0, 0.0]  # the quick model: the alarm never fires alone
    want[2]["reward/mean"], want[3]["train/collapsed"] = 1.0, 1.0
    local, ray_ = (train, []), (train, RAY)
    ends = {}
    for name, (first, first_extra), (then, then_extra) in (("local-ray", local, ray_), ("ray-local", ray_, local)):
        part = first(quick_cfg(*DUAL, *first_extra, "trainer.total_steps=2", f"trainer.run_name=agree-dual-{name}"))
        assert part["start_step"] == 0 and part["latest_checkpoint"].endswith("step_000002")
        log = MetricsLog(Path(part["run_dir"]) / "metrics.jsonl")
        rows = log.read()
        rows[2]["reward/mean"] = 1.0  # a peak: under trainer.collapse.fraction=0.5, step 3's 0.0 is a collapse
        log.path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        ends[name] = then(quick_cfg(*DUAL, *then_extra, "trainer.total_steps=3", "trainer.resume=true",
                                    f"trainer.run_name=agree-dual-{name}"))
        assert ends[name]["start_step"] == 2
        _assert_same_run(whole, ends[name], want_rows=want, want_summary={"collapse_step": 3})
    rows = _rows(ends["local-ray"])
    assert "faults/worker_restarts" in rows[3] and "faults/worker_restarts" not in rows[2]  # step 3 ran over Ray
    assert rows[3]["correction/lambda"] != rows[1]["correction/lambda"]  # state moved and was restored
    assert whole["tolerance"]["source"] == "first 1 steps" and whole["tolerance"]["value"] > 0
    assert all(r["correction/tolerance"] == whole["tolerance"]["value"] for r in rows[2:])
    assert all(-1.0 <= r["drift/delta_cosine"] <= 1.0 and r["drift/delta_cosine"] != 0.0 for r in rows[1:])
    assert ends["local-ray"]["engine"]["perturbation"]["sigma"] == 0.05
    assert "eval/accuracy_unquantized" in rows[0]  # a perturbed rollout is evaluated beside the plain weights
