"""Tasks that write the pipeline's results: model artifacts with lineage, the MLflow model version,
evaluation results per benchmark and per sample, regression checks. Retried: a registry or tracking
store that hiccups should not fail a pipeline whose training already finished."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from prefect import task

from parity.tracking import mlflow_log
from parity.tracking.regression import compare
from tasks.recording import mlflow_client, registry

RETRY = {"retries": 2, "retry_delay_seconds": 3}


@task(name="record-artifact", **RETRY)
def record_artifact_task(ref: dict, kind: str, path: str, precision: str, *, parent_id: int | None = None,
                         validation_status: str | None = None, report: dict | None = None,
                         report_path: str | None = None, facts: dict | None = None) -> int:
    return registry(ref["registry_url"]).add_artifact(
        kind, path, precision, parent_id=parent_id, pipeline_id=ref["pipeline_id"],
        validation_status=validation_status, report=report, report_path=report_path, facts=facts)


@task(name="register-model", **RETRY)
def register_model_task(ref: dict, run_id: str, artifact_id: int, model_dir: str, model_name: str,
                        tags: dict[str, str]) -> dict:
    """The trained checkpoint becomes a version of the MLflow registered model, tagged with what it was trained
    as (naming.tags_of), its precision and validation status, and becomes the model's `candidate` (MLflow's
    model-registry alias; the first version is the `champion` too); the registry row remembers the version."""
    c = mlflow_client(ref["tracking_uri"])
    version = mlflow_log.register_model(c, run_id, model_dir, model_name, tags)
    aliases = mlflow_log.set_candidate(c, model_name, version)
    registry(ref["registry_url"]).set_mlflow_model_version(artifact_id, model_name, version)
    return {"model_name": model_name, "version": version, "artifact_id": artifact_id, "aliases": aliases}


def read_samples(path: str | Path) -> dict[str, list[dict]]:
    """samples.jsonl of an evaluation, grouped by benchmark."""
    out: dict[str, list[dict]] = defaultdict(list)
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                out[row["benchmark"]].append({"problem_id": row["problem_id"], "sample": row["sample"],
                                              "score": row["score"], "extracted": row.get("extracted"),
                                              "status": row.get("status")})
            except (ValueError, KeyError) as e:
                raise ValueError(f"{path}: row {lineno}: not an evaluation sample ({e})") from e
    return dict(out)


@task(name="record-evaluation", **RETRY)
def record_evaluation_task(ref: dict, evaluation: dict, artifact_id: int | None, run_id: str | None) -> dict[str, int]:
    """One evaluation_results row per benchmark with its samples; metrics and files to the MLflow run."""
    reg = registry(ref["registry_url"])
    samples = read_samples(evaluation["samples"])
    ids: dict[str, int] = {}
    for name, row in evaluation["benchmarks"].items():
        metrics = {k: v for k, v in row.items() if k not in ("k", "problems")}
        ids[name] = reg.add_evaluation(name, row["k"], row["problems"], metrics, samples.get(name, []),
                                       pipeline_id=ref["pipeline_id"], artifact_id=artifact_id,
                                       out_dir=evaluation.get("out_dir"), precision=evaluation.get("precision"),
                                       settings=evaluation.get("settings"))
    if run_id:
        c = mlflow_client(ref["tracking_uri"])
        flat = {f"eval/{b}/{m}": v for b, row in evaluation["benchmarks"].items() for m, v in row.items()
                if isinstance(v, int | float) and not isinstance(v, bool)}
        flat.update({f"eval/macro/{m}": v for m, v in evaluation.get("macro", {}).items()})
        mlflow_log.log_metrics(c, run_id, flat)
        out_dir = Path(evaluation["out_dir"])
        for f in ("samples.jsonl", "metrics.json", "table.md"):
            mlflow_log.log_artifact(c, run_id, out_dir / f, "evaluation")
    return ids


@task(name="regression-check", **RETRY)
def regression_check_task(ref: dict, benchmark: str, baseline_result_id: int, candidate_result_id: int,
                          settings: dict[str, Any], names: tuple[str, str] = ("candidate", "baseline")) -> dict:
    reg = registry(ref["registry_url"])
    cmp = compare(benchmark, reg.sample_scores(baseline_result_id), reg.sample_scores(candidate_result_id),
                  margin=float(settings["margin"]), n_boot=int(settings["bootstrap"]),
                  level=float(settings["ci_level"]), seed=int(settings["seed"]), names=tuple(names))
    check_id = reg.add_regression_check(
        benchmark=benchmark, baseline_result_id=baseline_result_id, candidate_result_id=candidate_result_id,
        paired_problems=cmp.paired_problems, delta=cmp.delta, ci_low=cmp.ci_low, ci_high=cmp.ci_high,
        margin=cmp.margin, passed=cmp.passed, message=cmp.message, pipeline_id=ref["pipeline_id"])
    return {**cmp.as_dict(), "check_id": check_id}
