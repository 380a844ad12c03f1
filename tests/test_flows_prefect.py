"""The front door end to end: a real Prefect server on 127.0.0.1 (its home and DB in a temp dir), the
deployments served by `python -m flows.deployments`, `train-and-eval/local` triggered through the
Prefect REST API with tiny settings. Then a second run whose INT8 precision validation fails: the flow
run is Failed with the report's verdict before training, the stages before it keep their records."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from scripts.run_local import (
    free_port,
    start_server,
    start_serving,
    stop_process,
    wait_deployment,
    wait_healthy,
)
from tests.conftest import QUICK

pytestmark = pytest.mark.slow
RUN_NAME = "flowtest"
INT8_FAILING = ["rollout.precision.weights=int8", "rollout.precision.activations=int8",
                "rollout.precision.validation.num_prompts=4", "rollout.precision.validation.samples_per_prompt=1",
                "rollout.precision.validation.max_new_tokens=8",
                "rollout.precision.validation.max_mean_abs_prob_diff=1e-12"]
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _api(url: str, method: str = "GET", body: dict | None = None) -> dict:
    req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read() or b"{}")


@pytest.fixture(scope="module")
def prefect(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefect")
    out = root / "outputs"
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    server = start_server(root / "home", port, root / "server.log")
    serving = None
    try:
        wait_healthy(api, server, timeout_s=300)
        serving = start_serving(root / "home", api, root / "serve.log", extra_env={"PARITY_OUTPUTS": str(out)})
        wait_deployment(api, "train-and-eval/local", serving, timeout_s=300)
        for name in ("benchmark-regression/nightly", "sweep/local"):
            wait_deployment(api, name, serving, timeout_s=60)
        yield {"api": api, "out": out, "root": root}
    finally:
        if serving is not None:
            stop_process(serving.pid)
        stop_process(server.pid)


def _run_deployment(api: str, name: str, overrides: list[str], timeout_s: float = 600) -> dict:
    dep = _api(f"{api}/deployments/name/{name}")
    run = _api(f"{api}/deployments/{dep['id']}/create_flow_run", "POST", {"parameters": {"overrides": overrides}})
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        fr = _api(f"{api}/flow_runs/{run['id']}")
        if fr["state"]["type"] in TERMINAL:
            return fr
        time.sleep(2)
    raise TimeoutError(f"flow run {run['id']} of {name} not finished after {timeout_s} s")


def _overrides(out: Path) -> list[str]:
    return [f"outputs_dir={out}", *QUICK, "eval.suite=[arithmetic]", "eval.limit=8", f"trainer.run_name={RUN_NAME}",
            "tracking.model_name=flowtest-model"]


def test_deployments_and_schedule(prefect):
    dep = _api(f"{prefect['api']}/deployments/name/benchmark-regression/nightly")
    crons = [s["schedule"].get("cron") for s in dep.get("schedules", [])]
    assert crons == ["0 2 * * *"]


def test_train_and_eval_completes_then_failed_stage_keeps_earlier_records(prefect):
    from parity.tracking import mlflow_log
    from parity.tracking.registry import Registry

    api, out = prefect["api"], prefect["out"]
    fr = _run_deployment(api, "train-and-eval/local", _overrides(out))
    assert fr["state"]["type"] == "COMPLETED", fr["state"]
    reg = Registry(f"sqlite:///{out}/registry.db")
    (pid,) = reg.pipelines_of_flow_run(fr["id"])
    p = reg.pipeline(pid)
    assert p["status"] == "completed"
    assert [(s["name"], s["status"]) for s in p["stages"]] == [
        ("prepare", "completed"), ("quantize", "skipped"), ("validate", "skipped"), ("train", "completed"),
        ("evaluate", "completed"), ("register", "completed")]
    ckpt = reg.latest_artifacts(registered_only=True)[0]
    assert ckpt["path"].endswith("runs/flowtest/checkpoints/step_000002")
    assert [a["kind"] for a in reg.lineage(ckpt["id"])] == ["checkpoint", "base"]
    rid = p["stages"][4]["result"]["result_ids"]["arithmetic"]
    assert len(reg.sample_scores(rid)) == 8

    c = mlflow_log.client(f"sqlite:///{out}/mlflow.db")
    parent = c.get_run(p["mlflow_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["parity.flow_run_id"] == fr["id"]
    assert parent.data.params["trainer.total_steps"] == "2" and parent.data.params["rollout.n"] == "4"
    children = c.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(r.info.run_name for r in children) == sorted(s["name"] for s in p["stages"])
    train_run = next(r for r in children if r.info.run_name == "train")
    assert [m.step for m in c.get_metric_history(train_run.info.run_id, "reward/mean")] == [1, 2]
    assert c.get_metric_history(train_run.info.run_id, "perf/step_s")
    mv = c.get_model_version("flowtest-model", ckpt["mlflow_model_version"])
    assert mv.tags["precision"] == "bf16" and mv.tags["validation_status"] == "not_required"

    # an INT8 rollout whose validation cannot pass: the flow stops before training, the reason is the
    # report's verdict, and the stages before it (and the first pipeline) keep their records
    fr2 = _run_deployment(api, "train-and-eval/local", [*_overrides(out), "trainer.run_name=flowtest-int8",
                                                        *INT8_FAILING])
    assert fr2["state"]["type"] == "FAILED"
    assert "precision validation failed" in fr2["state"]["message"]
    assert "abs_prob_diff_mean" in fr2["state"]["message"]
    (pid2,) = reg.pipelines_of_flow_run(fr2["id"])
    p2 = reg.pipeline(pid2)
    assert p2["status"] == "failed" and "precision validation failed" in p2["reason"]
    assert [(s["name"], s["status"]) for s in p2["stages"]] == [
        ("prepare", "completed"), ("quantize", "completed"), ("validate", "failed")]
    assert "abs_prob_diff_mean" in p2["stages"][2]["reason"]
    assert p2["stages"][2]["result"]["report"]["passed"] is False
    assert p2["stages"][1]["result"]["path"].endswith("W8A8-INT8")
    assert not (out / "runs" / "flowtest-int8").exists()  # training never started
    assert reg.pipeline(pid) == p  # the first pipeline's records are untouched
    run2 = c.get_run(p2["mlflow_run_id"])
    assert run2.info.status == "FAILED"
    val_run = next(r for r in c.search_runs([run2.info.experiment_id],
                                            f"tags.mlflow.parentRunId = '{run2.info.run_id}'")
                   if r.info.run_name == "validate")
    assert val_run.info.status == "FAILED"
    assert {a.path for a in c.list_artifacts(val_run.info.run_id, "validation")} == {
        "validation/validation.json", "validation/validation.md"}
    reg.close()


def test_benchmark_regression_fails_on_a_drop_and_records_the_check(prefect):
    """A stored baseline that got every problem right; the registered tiny model does not: the
    nightly deployment's run fails naming the benchmark, and the check is recorded."""
    from parity.tracking.registry import Registry

    api, out = prefect["api"], prefect["out"]
    reg = Registry(f"sqlite:///{out}/registry.db")
    model = reg.latest_artifacts(registered_only=True)[0]
    first = reg.pipeline(model["pipeline_id"])
    problems = sorted(reg.sample_scores(first["stages"][4]["result"]["result_ids"]["arithmetic"]))
    assert len(problems) == 8
    perfect = reg.add_evaluation("arithmetic", 1, len(problems), {"avg@k": 1.0},
                                 [{"problem_id": p, "sample": 0, "score": 1.0} for p in problems])
    reg.set_baseline("arithmetic", perfect, note="test: all correct")
    fr = _run_deployment(api, "benchmark-regression/nightly",
                         [f"outputs_dir={out}", "eval.suite=[arithmetic]", "eval.limit=8", "eval.grade_workers=1",
                          "tracking.regression.bootstrap=500"])
    assert fr["state"]["type"] == "FAILED"
    msg = fr["state"]["message"]
    assert "RegressionDetected" in msg and "arithmetic: REGRESSION" in msg and "8 paired problems" in msg
    (pid,) = reg.pipelines_of_flow_run(fr["id"])
    p = reg.pipeline(pid)
    assert [(s["name"], s["status"]) for s in p["stages"]] == [("evaluate", "completed"), ("compare", "completed")]
    assert p["status"] == "failed" and "REGRESSION" in p["reason"]
    assert reg.count("regression_checks") == 1
    reg.close()
