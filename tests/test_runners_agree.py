"""One RL loop, two runners: the same short experiment run in this process and over Ray actors (one local Ray for
the module) logs the same metric names with the same values, and ends on the same weights, feature by feature.
Both runs are deterministic on the CPU in float32 with one thread per process (per-row sampling seeds); only
perf/* (timings) and faults/* (Ray's worker restarts) are the runner's own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

from parity.distributed.cluster import ray_session  # noqa: E402
from parity.distributed.driver import train_distributed  # noqa: E402
from parity.training.loop import MetricsLog, train  # noqa: E402

RAY = ["distributed.enabled=true", "distributed.rollout_cpus=1", "distributed.trainer_cpus=1",
       "distributed.num_cpus=3", "model.dtype=float32"]
# each feature with the settings that exercise it; two rollout workers where shards must merge (routing too)
CASES = {
    "dense_overlap_truncation": ["data=math", "distributed.off_policy_overlap=true", "trainer.total_steps=3",
                                 "distributed.num_rollout_workers=2"],
    "moe_replay": ["experiment=arith_tiny_moe", "distributed.num_rollout_workers=2"],
    "int8_eval_unquantized": ["+precision=w8a8_int8", "trainer.eval_every=2"],
    "score_centering_topk": ["algorithm.correction.name=score_centering", "algorithm.policy_loss=reinforce",
                             "rollout.topk_logprobs=8"],
}
# every key a case must log (beyond the names both runners share), so a case cannot pass without its feature
MUST_LOG = {
    "dense_overlap_truncation": ["data/prompt_truncated_frac"],
    "moe_replay": ["r3/routing_disagreement", "r3/routing_disagreement_replayed"],
    "int8_eval_unquantized": ["eval/accuracy_unquantized"],
    "score_centering_topk": ["correction/sc_term_abs"],
}
# the dual with its tolerance measured over the first steps (state), the mismatch dial, an alarm that fires
DUAL = ["algorithm.correction.name=dual", "algorithm.correction.tolerance=auto",
        "algorithm.correction.tolerance_steps=2", "rollout.precision.perturbation.sigma=0.05",
        "trainer.collapse.fraction=1.0", "trainer.collapse.patience=1", "trainer.eval_every=2"]
SUMMARY_KEYS = ("start_step", "steps", "initial_accuracy", "final_accuracy", "final_reward", "collapse_step",
                "tolerance", "initial_accuracy_unquantized", "final_accuracy_unquantized")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Ray gives each 1-CPU actor one OpenMP thread; the in-process run must use as many (reduction order)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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


def _assert_same_run(local: dict, dist: dict) -> None:
    got, want = _own(_rows(dist)), _own(_rows(local))
    assert [sorted(r) for r in got] == [sorted(r) for r in want]
    assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)  # every value, bit for bit
    assert {k: dist.get(k) for k in SUMMARY_KEYS} == {k: local.get(k) for k in SUMMARY_KEYS}
    a, b = _weights(local), _weights(dist)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the runner's own metrics: both time the same phases; Ray counts worker restarts and the trainer call
    for r, d in zip(_rows(local)[1:], _rows(dist)[1:], strict=True):
        shared = {"perf/rollout_s", "perf/rollout_wait_s", "perf/grade_s", "perf/train_s", "perf/sync_s", "perf/step_s",
                  "perf/staleness", "perf/rollout_tokens_per_s", "perf/train_tokens_per_s"}
        assert shared <= r.keys() and shared <= d.keys()
        assert {"faults/worker_restarts", "perf/trainer_call_s", "perf/publish_s"} <= d.keys()


@pytest.mark.parametrize("case", list(CASES))
def test_the_same_run_in_process_and_over_ray(case, ray_cluster, quick_cfg, prepared_model) -> None:
    over = [*CASES[case], "model.dtype=float32"]
    local = train(quick_cfg(*over, f"trainer.run_name=agree-{case}-local"))
    dist = train_distributed(quick_cfg(*over, *RAY, f"trainer.run_name=agree-{case}-ray"))
    assert dist["distributed"]["rollout_workers"] == (2 if "distributed.num_rollout_workers=2" in over else 1)
    _assert_same_run(local, dist)
    rows = _rows(dist)
    for key in MUST_LOG[case]:
        assert all(key in r for r in rows[1:] if key != "eval/accuracy_unquantized"), key
    if case == "dense_overlap_truncation":  # MATH prompts are longer than the tiny model's context leaves
        assert all(r["data/prompt_truncated_frac"] > 0 for r in rows[1:])
        assert [r["perf/staleness"] for r in rows[1:]] == [0.0, 1.0, 1.0] == [r["perf/staleness"]
                                                                               for r in _rows(local)[1:]]
    if case == "moe_replay":  # the trainer replays exactly the experts the rollout workers recorded
        assert all(r["r3/routing_disagreement_replayed"] == 0.0 for r in rows[1:])
    if case == "int8_eval_unquantized":
        assert [r["step"] for r in rows if "eval/accuracy_unquantized" in r] == [0, 2]
        assert "final_accuracy_unquantized" in dist
    if case == "score_centering_topk":
        assert all(r["correction/sc_term_abs"] > 0 for r in rows[1:])


def test_dual_with_the_dial_resumes_alike_in_process_and_over_ray(ray_cluster, quick_cfg, prepared_model) -> None:
    """Both runners stop after 2 of 3 steps and resume: the same rows as one uninterrupted run, the dual's lambda
    and its measured tolerance carried by the checkpoint, the collapse alarm rebuilt from the metrics log."""
    whole = train(quick_cfg(*DUAL, "trainer.total_steps=3", "trainer.run_name=agree-dual-whole"))
    ends = {}
    for name, run, extra in (("local", train, []), ("ray", train_distributed, RAY)):
        first = run(quick_cfg(*DUAL, *extra, "trainer.total_steps=2", f"trainer.run_name=agree-dual-{name}"))
        assert first["start_step"] == 0
        ends[name] = run(quick_cfg(*DUAL, *extra, "trainer.total_steps=3", "trainer.resume=true",
                                   f"trainer.run_name=agree-dual-{name}"))
        assert ends[name]["start_step"] == 2
        assert [r["step"] for r in _rows(ends[name])] == [0, 1, 2, 3]
        _assert_same_run(whole, ends[name])
    rows = _rows(ends["ray"])
    assert rows[3]["correction/lambda"] != rows[1]["correction/lambda"]  # state moved and was restored
    assert whole["tolerance"]["source"] == "first 2 steps" and whole["tolerance"]["value"] > 0
    assert all(r["drift/delta_cosine"] != 0.0 for r in rows[1:])  # the learner measures drift along the dial
    assert ends["ray"]["engine"]["perturbation"]["sigma"] == 0.05
    fired = whole["collapse_step"]
    assert fired is not None and [r["train/collapsed"] for r in rows[1:]] == [float(s >= fired) for s in (1, 2, 3)]
