"""The front door end to end: a real Prefect server on 127.0.0.1 (its home and DB in a temp dir), the
deployments served by `python -m flows.deployments`, `train-and-eval/local` triggered through the
Prefect REST API with tiny settings. Then a second run whose INT8 precision validation fails: the flow
run is Failed with the report's verdict before training, the stages before it keep their records.
`sweep/local` runs two members for real (train-and-eval subflows), each registering a version of one
model, and `python -m parity evaluate eval.registered_model=NAME[:VERSION]` evaluates those versions."""

from __future__ import annotations

import json
import time
import urllib.error
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
    """One REST call; 429/502/503 are retried with a short backoff as Prefect's own client does (the server
    answers 503 while its SQLite database is busy, which a loaded 2-core CI machine met once)."""
    for attempt in range(6):
        req = urllib.request.Request(url, method=method, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            if e.code not in (429, 502, 503) or attempt == 5:
                raise
            time.sleep(2 * (attempt + 1))
    raise AssertionError("unreachable")


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


def _run_deployment(api: str, name: str, overrides: list[str], timeout_s: float = 600,
                    parameters: dict | None = None) -> dict:
    dep = _api(f"{api}/deployments/name/{name}")
    run = _api(f"{api}/deployments/{dep['id']}/create_flow_run", "POST",
               {"parameters": {"overrides": overrides, **(parameters or {})}})
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


SWEEP_MODEL = "sweeptest-model"


@pytest.fixture(scope="module")
def sweep_run(prefect):
    """`sweep/local` with two corrections on the tiny settings: two train-and-eval subflows, each
    registering a version of SWEEP_MODEL."""
    api, out = prefect["api"], prefect["out"]
    common = [f"outputs_dir={out}", *QUICK, "eval.suite=[arithmetic]", "eval.limit=4",
              f"tracking.model_name={SWEEP_MODEL}"]
    fr = _run_deployment(api, "sweep/local", common, parameters={"corrections": ["none", "tis"]})
    children = _api(f"{api}/flow_runs/filter", "POST",
                    {"flow_runs": {"parent_flow_run_id": {"any_": [fr["id"]]}}, "sort": "START_TIME_ASC"})
    return {"flow_run": fr, "children": children}


def test_sweep_runs_each_member_with_its_records(prefect, sweep_run):
    from parity.tracking import mlflow_log
    from parity.tracking.registry import Registry

    out = prefect["out"]
    fr, children = sweep_run["flow_run"], sweep_run["children"]
    assert fr["state"]["type"] == "COMPLETED", fr["state"]
    assert len(children) == 2
    assert all(ch["state"]["type"] == "COMPLETED" for ch in children), [ch["state"] for ch in children]
    flows = {_api(f"{prefect['api']}/flows/{ch['flow_id']}")["name"] for ch in children}
    assert flows == {"train-and-eval"}

    reg = Registry(f"sqlite:///{out}/registry.db")
    c = mlflow_log.client(f"sqlite:///{out}/mlflow.db")
    versions = []
    for ch, correction in zip(children, ("none", "tis"), strict=True):
        (pid,) = reg.pipelines_of_flow_run(ch["id"])
        p = reg.pipeline(pid)
        assert p["status"] == "completed" and f"algorithm.correction.name={correction}" in p["overrides"]
        assert [(st["name"], st["status"]) for st in p["stages"]] == [
            ("prepare", "completed"), ("quantize", "skipped"), ("validate", "skipped"), ("train", "completed"),
            ("evaluate", "completed"), ("register", "completed")]
        run_name = next(o.split("=", 1)[1] for o in p["overrides"] if o.startswith("trainer.run_name="))
        assert run_name.startswith("sweep-") and run_name.endswith(f"-{correction}")
        rid = p["stages"][4]["result"]["result_ids"]["arithmetic"]
        assert len(reg.sample_scores(rid)) == 4
        parent = c.get_run(p["mlflow_run_id"])
        assert parent.info.status == "FINISHED" and parent.data.tags["parity.flow_run_id"] == ch["id"]
        assert parent.data.params["algorithm.correction.name"] == correction
        stages = c.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
        assert sorted(r.info.run_name for r in stages) == sorted(st["name"] for st in p["stages"])
        train_run = next(r for r in stages if r.info.run_name == "train")
        assert [m.step for m in c.get_metric_history(train_run.info.run_id, "reward/mean")] == [1, 2]
        versions.append((p["stages"][5]["result"]["version"], f"runs/{run_name}/checkpoints/step_000002"))
    assert [v for v, _ in versions] == ["1", "2"]
    rows = reg.registered_versions(SWEEP_MODEL)
    assert [(r["mlflow_model_version"], r["kind"]) for r in rows] == [("1", "checkpoint"), ("2", "checkpoint")]
    assert all(r["path"].endswith(tail) for r, (_, tail) in zip(rows, versions, strict=True))
    assert c.get_model_version(SWEEP_MODEL, "2").tags["precision"] == "bf16"
    reg.close()


def _eval_cfg(out: Path, *overrides: str):
    from parity.config import load_config

    return load_config([f"outputs_dir={out}", "eval.suite=[arithmetic]", "eval.limit=4", "eval.grade_workers=1",
                        "eval.max_new_tokens=8", *overrides])


def test_evaluate_a_registered_model(prefect, sweep_run, capsys):
    """`python -m parity evaluate eval.registered_model=NAME[:VERSION]` against the registry DB and MLflow
    model registry that the sweep's register stages filled."""
    import shutil

    from parity.__main__ import main
    from parity.commands.evaluate import resolve_eval_model_info
    from parity.errors import ParityError
    from parity.tracking.registry import Registry

    out = prefect["out"]
    with Registry(f"sqlite:///{out}/registry.db") as reg:
        v1, v2 = reg.registered_versions(SWEEP_MODEL)

    capsys.readouterr()
    main(["evaluate", f"outputs_dir={out}", "eval.suite=[arithmetic]", "eval.limit=4", "eval.grade_workers=1",
          "eval.max_new_tokens=8", f"eval.registered_model={SWEEP_MODEL}:1"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["model"] == v1["path"]
    reg_info = summary["registered_model"]
    assert (reg_info["name"], reg_info["version"], reg_info["source"]) == (SWEEP_MODEL, 1, "registry database")
    assert reg_info["artifact_id"] == v1["id"] and reg_info["precision"] == "bf16"
    assert summary["benchmarks"]["arithmetic"]["problems"] == 4
    assert Path(summary["out_dir"]).name.startswith(f"{SWEEP_MODEL}-v1-")
    recorded = json.loads((Path(summary["out_dir"]) / "metrics.json").read_text())["model"]
    assert recorded["registered_model"]["version"] == 1 and recorded["path"] == v1["path"]

    # no version = the latest; "latest" says the same
    for spec in (SWEEP_MODEL, f"{SWEEP_MODEL}:latest"):
        path, chosen, info = resolve_eval_model_info(_eval_cfg(out, f"eval.registered_model={spec}"))
        assert (str(path), info["version"]) == (v2["path"], 2) and "version 2" in chosen

    # unknown version / name / malformed version / two selections: one error naming the key
    for override, match in [
        (f"eval.registered_model={SWEEP_MODEL}:9", rf"`eval.registered_model`: model '{SWEEP_MODEL}' has no version 9; "
                                                   r"versions: 1, 2$"),
        ("eval.registered_model=nosuch", r"`eval.registered_model`: no registered model named 'nosuch' .*registered: "
                                         rf"(flowtest-model, )?{SWEEP_MODEL}$"),
        (f"eval.registered_model={SWEEP_MODEL}:x1", r"`eval.registered_model`: version 'x1'"),
    ]:
        with pytest.raises(ParityError, match=match):
            resolve_eval_model_info(_eval_cfg(out, override))
    with pytest.raises(ParityError, match=r"`eval.registered_model`: set it or `eval.run_name`, not both"):
        resolve_eval_model_info(_eval_cfg(out, f"eval.registered_model={SWEEP_MODEL}", "eval.run_name=x"))

    # the checkpoint folder is gone (rotation, a cleaned outputs/): the MLflow model version's copy is used;
    # with that gone too, the error names the key and both places
    ckpt = Path(v1["path"])
    ckpt.rename(ckpt.with_name("moved"))
    try:
        path, _, info = resolve_eval_model_info(_eval_cfg(out, f"eval.registered_model={SWEEP_MODEL}:1"))
        assert info["source"] == "MLflow model registry" and path.is_relative_to(out / "mlartifacts")
        assert sorted(p.name for p in path.iterdir()) == sorted(p.name for p in ckpt.with_name("moved").iterdir())
        shutil.move(path, path.with_name("model.moved"))
        try:
            with pytest.raises(ParityError, match=r"`eval.registered_model`: model 'sweeptest-model' version 1 is "
                                                  r"registered but no model folder \(config.json\) is left: "
                                                  r"checkpoint folder .*step_000002 \(registry database\); MLflow copy"):
                resolve_eval_model_info(_eval_cfg(out, f"eval.registered_model={SWEEP_MODEL}:1"))
        finally:
            shutil.move(path.with_name("model.moved"), path)
    finally:
        ckpt.with_name("moved").rename(ckpt)
