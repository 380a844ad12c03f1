"""The front door end to end: a real Prefect server on 127.0.0.1 (its home and DB in a temp dir), the
deployments served by `python -m flows.deployments`, `train-and-eval/local` triggered through the
Prefect REST API with tiny settings. Then a second run whose INT8 precision validation fails: the flow
run is Failed with the report's verdict before training, the stages before it keep their records.
`sweep/local` runs two corrections x two seeds for real (train-and-eval subflows, tests/prefect_services.py),
each registering a version of one model and named in MLflow by what it ran, and `python -m parity evaluate
eval.registered_model=NAME[:VERSION]` evaluates those versions. Server, deployments and sweep are shared by
the session (the dashboard tests read the sweep's stores)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tasks import publish
from tests.conftest import QUICK
from tests.prefect_services import (
    SWEEP_CORRECTIONS,
    SWEEP_MODEL,
    SWEEP_SEEDS,
    artifacts_of,
    flow_run_line,
    served_chain,
)
from tests.prefect_services import api as _api
from tests.prefect_services import run_deployment as _run_deployment

pytestmark = pytest.mark.slow
RUN_NAME = "flowtest"
SPEC = "wint8-aint8-kvint4_per_token_head"
INT8_FAILING = ["rollout.precision.weights=int8", "rollout.precision.activations=int8",
                "rollout.precision.validation.num_prompts=4", "rollout.precision.validation.samples_per_prompt=1",
                "rollout.precision.validation.max_new_tokens=8",
                "rollout.precision.validation.max_mean_abs_prob_diff=1e-12"]


@pytest.fixture(scope="module")
def prefect(prefect_services):
    return prefect_services


def _overrides(out: Path) -> list[str]:
    return [f"outputs_dir={out}", *QUICK, "eval.suite=[arithmetic]", "eval.limit=8", f"trainer.run_name={RUN_NAME}",
            "tracking.model_name=flowtest-model"]


def test_deployments_and_schedule(prefect):
    dep = _api(f"{prefect['api']}/deployments/name/benchmark-regression/nightly")
    crons = [s["schedule"].get("cron") for s in dep.get("schedules", [])]
    assert crons == ["0 2 * * *"]
    # each deployment keeps the chain it was served with apart from the run's own overrides (Prefect's --params
    # replaces a parameter's whole default: `overrides` given alone leave the chain in place)
    for name in ("train-and-eval/local", "benchmark-regression/nightly", "sweep/local"):
        params = _api(f"{prefect['api']}/deployments/name/{name}")["parameters"]
        assert (params["chain"], params["overrides"]) == (served_chain(prefect["root"]), []), name


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
    assert parent.info.run_name == "arith_tiny / bf16 / none / seed 0"
    children = c.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(r.info.run_name for r in children) == sorted(f"{parent.info.run_name} / {s['name']}"
                                                               for s in p["stages"])
    train_run = next(r for r in children if r.data.tags["parity.stage"] == "train")
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
    failed_md = artifacts_of(api, fr2["id"])[publish.SUMMARY_KEY]["data"]  # what the run page shows
    assert "**FAILED** in stage `validate`" in failed_md and "precision validation failed" in failed_md
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
                   if r.data.tags["parity.stage"] == "validate")
    assert run2.info.run_name == "arith_tiny / int8 / none / seed 0"
    assert val_run.info.status == "FAILED"
    report = Path(p2["stages"][2]["result"]["report_path"])  # this validation's own report, kept
    assert report.parent.name == "validations" and report.name.startswith("wint8-aint8-kvbf16-")
    assert {a.path for a in c.list_artifacts(val_run.info.run_id, "validation")} == {
        f"validation/{report.name}", f"validation/{report.with_suffix('.md').name}"}
    reg.close()


def test_benchmark_regression_checks_the_candidate_against_the_champion(prefect, sweep_store, sweep_regression):
    """The nightly deployment on the sweep's model: the candidate (v4, tis seed 1) against the champion (v1, none
    seed 0), both in the precision they were trained to deploy (INT8 W8A8 + INT4 KV; their pipelines' own
    evaluations at these settings are reused) and unquantized (evaluated now); one check per benchmark on the
    deployed scores; everything labelled with what each model was trained as."""
    from parity.tracking import mlflow_log
    from parity.tracking.registry import Registry

    fr = sweep_regression["flow_run"]
    assert fr["state"]["type"] == "COMPLETED", fr["state"]
    reg = Registry(sweep_store["registry_url"])
    (pid,) = reg.pipelines_of_flow_run(fr["id"])
    p = reg.pipeline(pid)
    assert [(st["name"], st["status"]) for st in p["stages"]] == [
        ("evaluate candidate bf16", "completed"), ("evaluate champion bf16", "completed"), ("compare", "completed")]
    v1, *_, v4 = reg.registered_versions(SWEEP_MODEL)
    for st, model in zip(p["stages"][:2], (v4, v1), strict=True):
        (rid,) = st["result"]["result_ids"].values()
        ev = reg.evaluation(rid)
        assert ev["artifact_id"] == model["id"] and ev["precision"] == "bf16" and ev["problems"] == 4
    (check,) = p["stages"][2]["result"]["checks"]
    assert check["benchmark"] == "arithmetic" and check["passed"]
    assert check["message"].startswith("arithmetic: ok: candidate v4 [int8+int4kv] ")
    assert " vs champion v1 [int8+int4kv] " in check["message"]
    # the check compared the deployed (INT8 + INT4 KV) evaluations the members' own pipelines recorded
    deploy = {m["mlflow_model_version"]: reg.pipeline(m["pipeline_id"])["stages"][4]["result"]["result_ids"]["arithmetic"]
              for m in (v1, v4)}
    c = mlflow_log.client(sweep_store["tracking_uri"])
    run = c.get_run(p["mlflow_run_id"])
    assert run.info.run_name == "arith_tiny / int8+int4kv / tis / seed 1 / regression v4 vs champion v1"
    assert (run.data.tags["parity.precision"], run.data.tags["parity.correction"], run.data.tags["parity.seed"]) == \
        ("int8+int4kv", "tis", "1")
    import sqlalchemy as sa

    eng = sa.create_engine(sweep_store["registry_url"])
    with eng.connect() as conn:
        row = conn.execute(sa.text("SELECT baseline_result_id, candidate_result_id FROM regression_checks "
                                   "WHERE pipeline_id = :p"), {"p": pid}).one()
    eng.dispose()
    assert tuple(row) == (deploy["1"], deploy["4"])
    assert reg.evaluation(deploy["4"])["precision"] == SPEC
    assert mlflow_log.alias_version(c, SWEEP_MODEL, "champion") == "1"  # promotion is off by default
    reg.close()
    # the verdict is published where users look: the flow run's artifacts and its log's Result line
    arts = artifacts_of(prefect["api"], fr["id"])
    md = arts[publish.VERDICT_KEY]["data"]
    assert md.startswith("# Benchmark regression: PASSED: 1 benchmark(s), none dropped beyond the margin (1)\n"), md
    (row,) = arts[publish.CHECKS_KEY]["rows"]
    assert (row["benchmark"], row["verdict"], row["model_version"]) == ("arithmetic", "ok", "4")
    assert row["model"] == "arith_tiny / int8+int4kv / tis / seed 1"
    _, line = flow_run_line(prefect["api"], fr["id"], r"Result: benchmark regression PASSED")
    assert line is not None


def test_benchmark_regression_fails_on_a_drop_and_records_the_check(prefect, sweep_store, sweep_regression,
                                                                      prepared_model, tmp_path):
    """A copy of the sweep's stores where the champion's stored deployed result got every problem right; the
    candidate does not: the nightly run fails naming the benchmark, with the check recorded (flagged)."""
    import sqlite3

    from flows.benchmark_regression import eval_config
    from parity.config import load_config
    from parity.tracking.registry import Registry
    from parity.tracking.regression import evaluation_settings
    from tests.prefect_services import sweep_eval

    out = tmp_path / "copy"
    out.mkdir()
    for name in ("registry.db", "mlflow.db"):  # SQLite's backup: what is still in a write-ahead log comes too
        src, dst = sqlite3.connect(Path(sweep_store["outputs_dir"]) / name), sqlite3.connect(out / name)
        src.backup(dst)
        src.close(), dst.close()
    overrides = [*sweep_eval(out, prepared_model), "tracking.regression.bootstrap=500"]
    reg = Registry(f"sqlite:///{out}/registry.db")
    v1, *_, v4 = reg.registered_versions(SWEEP_MODEL)
    cand = reg.evaluation(reg.pipeline(v4["pipeline_id"])["stages"][4]["result"]["result_ids"]["arithmetic"])
    assert cand["metrics"]["avg@k"] <= 0.25, "the tiny candidate answers at most one of the four problems"
    problems = sorted(reg.sample_scores(cand["id"]))
    settings = evaluation_settings(eval_config(load_config(overrides), SPEC))
    perfect = reg.add_evaluation("arithmetic", 1, len(problems), {"avg@k": 1.0},
                                 [{"problem_id": q, "sample": 0, "score": 1.0} for q in problems],
                                 artifact_id=v1["id"], precision=SPEC, settings=settings)
    fr = _run_deployment(prefect["api"], "benchmark-regression/nightly", overrides)
    assert fr["state"]["type"] == "FAILED"
    msg = fr["state"]["message"]
    assert "RegressionDetected" in msg and "arithmetic: REGRESSION: candidate v4 [int8+int4kv]" in msg
    assert "champion v1 [int8+int4kv] 1.0000 on 4 paired problems" in msg
    (pid,) = reg.pipelines_of_flow_run(fr["id"])
    p = reg.pipeline(pid)
    assert [st["name"] for st in p["stages"]] == ["compare"]  # every evaluation was there already
    assert p["status"] == "failed" and "REGRESSION" in p["reason"]
    assert reg.count("regression_checks") == 2  # the sweep's passing check, and this one
    reg.close()
    assert perfect
    # the failed run publishes its verdict and checks all the same (tasks/publish.py), as the registry has them
    arts = artifacts_of(prefect["api"], fr["id"])
    md = arts[publish.VERDICT_KEY]["data"]
    assert md.startswith("# Benchmark regression: REGRESSION in 1 of 1 benchmark(s): arithmetic\n"), md
    (row,) = arts[publish.CHECKS_KEY]["rows"]
    (check,) = p["stages"][0]["result"]["checks"]
    assert (row["benchmark"], row["verdict"], row["paired_problems"], row["baseline_mean"]) == (
        "arithmetic", "REGRESSION", 4, 1.0)
    assert row["ci_low"] <= row["delta"] <= row["ci_high"] < 0 and f"{row['delta']:+.4f}" in check["message"]
    assert (f"| arithmetic | REGRESSION | 100.0% | {100 * row['candidate_mean']:.1f}% | {100 * row['delta']:+.1f} |"
            in md)
    _, line = flow_run_line(prefect["api"], fr["id"], r"Result: benchmark regression REGRESSION in 1 of 1 benchmark")
    assert line is not None


def test_sweep_runs_each_member_with_its_records(prefect, sweep_store):
    """`sweep/local` with corrections x seeds: one train-and-eval subflow per member, each with its registry
    records, MLflow runs named by what they ran in the experiment's own MLflow experiment (tagged for
    MLflow's training-runs view), params on the train run, headline metrics on the pipeline run, the run
    folder's files as artifacts; the flow prints the dashboard's Compare link of the sweep."""
    from parity.tracking import mlflow_log, naming
    from parity.tracking.registry import Registry

    fr, children = sweep_store["flow_run"], sweep_store["children"]
    assert fr["state"]["type"] == "COMPLETED", fr["state"]
    assert len(children) == 4
    assert all(ch["state"]["type"] == "COMPLETED" for ch in children), [ch["state"] for ch in children]
    flows = {_api(f"{prefect['api']}/flows/{ch['flow_id']}")["name"] for ch in children}
    assert flows == {"train-and-eval"}
    sweep_id = sweep_store["sweep"]
    assert re.fullmatch(r"sweep-\d{8}-\d{6}", sweep_id)
    assert sweep_store["compare_url"] == f"http://127.0.0.1:8501/compare?sweep={sweep_id}"

    reg = Registry(sweep_store["registry_url"])
    c = mlflow_log.client(sweep_store["tracking_uri"])
    exp = c.get_experiment_by_name("arith_tiny")
    assert exp.tags[naming.EXPERIMENT_KIND_TAG] == naming.TRAINING_EXPERIMENT
    # one MLflow experiment per experiment_name (MLflow's own "Default" aside)
    assert {e.name for e in c.search_experiments()} - {"Default"} == {"arith_tiny"}
    members = [(corr, seed) for corr in SWEEP_CORRECTIONS for seed in SWEEP_SEEDS]
    versions = []
    for ch, (correction, seed) in zip(children, members, strict=True):
        (pid,) = reg.pipelines_of_flow_run(ch["id"])
        p = reg.pipeline(pid)
        assert p["status"] == "completed" and f"algorithm.correction.name={correction}" in p["overrides"]
        assert f"trainer.seed={seed}" in p["overrides"]
        assert [(st["name"], st["status"]) for st in p["stages"]] == [
            ("prepare", "completed"), ("quantize", "completed"), ("validate", "completed"), ("train", "completed"),
            ("evaluate", "completed"), ("register", "completed")]
        run_name = next(o.split("=", 1)[1] for o in p["overrides"] if o.startswith("trainer.run_name="))
        assert run_name == f"{sweep_id}-{correction}-s{seed}"
        rid = p["stages"][4]["result"]["result_ids"]["arithmetic"]
        assert len(reg.sample_scores(rid)) == 4
        assert reg.evaluation(rid)["precision"] == SPEC  # evaluated in the precision it was trained to deploy

        parent = c.get_run(p["mlflow_run_id"])
        title = f"arith_tiny / int8+int4kv / {correction} / seed {seed}"
        assert parent.info.run_name == title and parent.info.experiment_id == exp.experiment_id
        assert parent.info.status == "FINISHED" and parent.data.tags["parity.flow_run_id"] == ch["id"]
        assert parent.data.tags[naming.SWEEP_TAG] == sweep_id and parent.data.tags["parity.correction"] == correction
        assert parent.data.params["algorithm.correction.name"] == correction
        stages = c.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
        assert sorted(r.info.run_name for r in stages) == sorted(f"{title} / {st['name']}" for st in p["stages"])
        assert all(r.data.tags[naming.SWEEP_TAG] == sweep_id for r in stages)
        train_run = next(r for r in stages if r.info.run_name == f"{title} / train")
        # the train run carries the whole config: it can be filtered and compared on its own
        assert train_run.data.params == parent.data.params and len(train_run.data.params) > 100
        assert train_run.data.params["trainer.seed"] == str(seed) and train_run.data.params["trainer.lr"] == "5e-05"
        prep = next(r for r in stages if r.data.tags["parity.stage"] == "prepare")
        assert prep.data.params["algorithm.correction.name"] == correction and prep.data.params["trainer.seed"] == str(seed)
        history = [json.loads(x) for x in (Path(sweep_store["outputs_dir"]) / "runs" / run_name / "metrics.jsonl")
                   .read_text().splitlines()]
        assert [m.step for m in c.get_metric_history(train_run.info.run_id, "reward/mean")] == [1, 2]
        assert {a.path for a in c.list_artifacts(train_run.info.run_id, "run")} == {"run/metrics.jsonl",
                                                                                     "run/summary.json"}
        # the pipeline run's headline numbers are the train and evaluate stages' own
        m = parent.data.metrics
        assert m["final_reward"] == pytest.approx(history[-1]["reward/mean"])
        assert m["final_mismatch"] == pytest.approx(history[-1]["mismatch/abs_prob_diff_mean"])
        assert m["heldout_accuracy"] == pytest.approx(p["stages"][3]["result"]["final_accuracy"])
        assert m["benchmark_macro_avg"] == pytest.approx(p["stages"][4]["result"]["macro"]["avg@k"])
        summary = json.loads((Path(sweep_store["outputs_dir"]) / "runs" / run_name / "summary.json").read_text())
        if "collapse_step" in summary:  # the loop's collapse alarm reports it: the flag follows it
            assert m["collapsed"] == (0.0 if summary["collapse_step"] is None else 1.0)
        else:
            assert "collapsed" not in m
        versions.append((p["stages"][5]["result"]["version"], f"runs/{run_name}/checkpoints/step_000002"))
    assert [v for v, _ in versions] == ["1", "2", "3", "4"]
    rows = reg.registered_versions(SWEEP_MODEL)
    assert [(r["mlflow_model_version"], r["kind"]) for r in rows] == [(v, "checkpoint") for v in ("1", "2", "3", "4")]
    assert all(r["path"].endswith(tail) for r, (_, tail) in zip(rows, versions, strict=True))
    mv = c.get_model_version(SWEEP_MODEL, "2")
    assert mv.tags["precision"] == SPEC and mv.tags["parity.label"] == "arith_tiny / int8+int4kv / none / seed 1"
    assert rows[1]["facts"] == {"experiment": "arith_tiny", "precision": "int8+int4kv", "precision_spec": SPEC,
                                "correction": "none", "seed": "1", "run_name": f"{sweep_id}-none-s1"}
    # MLflow's aliases: each new version is the candidate, the first one the champion
    assert mlflow_log.alias_version(c, SWEEP_MODEL, "candidate") == "4"
    assert mlflow_log.alias_version(c, SWEEP_MODEL, "champion") == "1"
    reg.close()


def _eval_cfg(out: Path, *overrides: str):
    from parity.config import load_config

    return load_config([f"outputs_dir={out}", "eval.suite=[arithmetic]", "eval.limit=4", "eval.grade_workers=1",
                        "eval.max_new_tokens=8", *overrides])


def test_evaluate_a_registered_model(sweep_store, capsys):
    """`python -m parity evaluate eval.registered_model=NAME[:VERSION]` against the registry DB and MLflow
    model registry that the sweep's register stages filled."""
    import shutil

    from parity.__main__ import main
    from parity.commands.evaluate import resolve_eval_model_info
    from parity.errors import ParityError
    from parity.tracking.registry import Registry

    out = Path(sweep_store["outputs_dir"])
    with Registry(sweep_store["registry_url"]) as reg:
        v1, *_, v4 = reg.registered_versions(SWEEP_MODEL)

    capsys.readouterr()
    main(["evaluate", f"outputs_dir={out}", "eval.suite=[arithmetic]", "eval.limit=4", "eval.grade_workers=1",
          "eval.max_new_tokens=8", f"eval.registered_model={SWEEP_MODEL}:1"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["model"] == v1["path"]
    reg_info = summary["registered_model"]
    assert (reg_info["name"], reg_info["version"], reg_info["source"]) == (SWEEP_MODEL, 1, "registry database")
    assert reg_info["artifact_id"] == v1["id"] and reg_info["precision"] == SPEC
    assert summary["benchmarks"]["arithmetic"]["problems"] == 4
    assert Path(summary["out_dir"]).name.startswith(f"{SWEEP_MODEL}-v1-")
    recorded = json.loads((Path(summary["out_dir"]) / "metrics.json").read_text())["model"]
    assert recorded["registered_model"]["version"] == 1 and recorded["path"] == v1["path"]

    # no version = the latest; "latest" says the same
    for spec in (SWEEP_MODEL, f"{SWEEP_MODEL}:latest"):
        path, chosen, info = resolve_eval_model_info(_eval_cfg(out, f"eval.registered_model={spec}"))
        assert (str(path), info["version"]) == (v4["path"], 4) and "version 4" in chosen

    # unknown version / name / malformed version / two selections: one error naming the key
    for override, match in [
        (f"eval.registered_model={SWEEP_MODEL}:9", rf"`eval.registered_model`: model '{SWEEP_MODEL}' has no version 9; "
                                                   r"versions: 1, 2, 3, 4$"),
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
