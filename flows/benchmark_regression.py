"""`benchmark-regression`: evaluate the latest registered model(s) on the benchmark suite, compare each
benchmark with its stored baseline per problem (paired bootstrap, parity.tracking.regression), record
every check, and fail the flow run, naming the benchmarks, when one drops beyond the margin.
A benchmark without a baseline gets this result as its baseline (tracking.regression.baseline_if_missing)."""

from __future__ import annotations

import time

from omegaconf import OmegaConf
from prefect import flow

from parity.config import load_config
from parity.errors import ParityError
from tasks import publish
from tasks.recording import PipelineRef, close_pipeline, open_pipeline, plain, registry, stage
from tasks.records import record_evaluation_task, regression_check_task
from tasks.stages import evaluate_task

FLOW_NAME = "benchmark-regression"


class RegressionDetected(RuntimeError):
    """At least one benchmark dropped beyond the margin; the message lists each with its interval, `checks`
    holds every check of the run."""

    def __init__(self, message: str, checks: list[dict]) -> None:
        super().__init__(message)
        self.checks = checks


def check_model(ref: PipelineRef, cfg: OmegaConf, model: dict) -> list[dict]:
    c, r = plain(cfg), ref.as_dict()
    settings = plain(cfg.tracking.regression)
    with stage(ref, "evaluate") as st:
        e = evaluate_task(c, model["path"])
        ids = record_evaluation_task(r, e, model["id"], st.run_id)
        st.done({"model": model["path"], "macro": e["macro"], "result_ids": ids})
    checks = []
    with stage(ref, "compare") as st:
        reg = registry(ref.registry_url)
        for bench, rid in ids.items():
            base = reg.baseline_result(bench)
            if base is None:
                if not cfg.tracking.regression.baseline_if_missing:
                    raise ParityError(f"benchmark {bench!r} has no baseline in the registry and "
                                      "tracking.regression.baseline_if_missing=false")
                reg.set_baseline(bench, rid, note=f"first result, model artifact {model['id']}")
                checks.append({"benchmark": bench, "baseline_set": rid, "passed": True,
                               "message": f"{bench}: no baseline yet; result {rid} is now the baseline"})
                continue
            checks.append(regression_check_task(r, bench, base, rid, settings))
        st.done({"checks": [{k: x[k] for k in ("benchmark", "passed", "message")} for x in checks]})
    return [{**x, "model": model["path"], "model_version": model.get("mlflow_model_version")} for x in checks]


def run_regression(overrides: list[str]) -> dict:
    cfg = load_config(overrides)
    ref = open_pipeline(FLOW_NAME, cfg, overrides,
                        title=f"{cfg.experiment_name} / benchmark regression / {time.strftime('%Y-%m-%d %H:%M')}")
    try:
        models = registry(ref.registry_url).latest_artifacts(("checkpoint",), n=int(cfg.tracking.regression.models),
                                                             registered_only=True)
        if not models:
            raise ParityError(f"no registered model in the registry {ref.registry_url.split('@')[-1]}: run "
                              "train-and-eval first")
        checks = [x for m in models for x in check_model(ref, cfg, m)]
        failed = [x["message"] for x in checks if not x["passed"]]
        if failed:
            raise RegressionDetected(f"{len(failed)} benchmark(s) regressed beyond the margin "
                                     f"{cfg.tracking.regression.margin}:\n" + "\n".join(failed), checks)
    except BaseException as e:
        close_pipeline(ref, ok=False, reason=f"{type(e).__name__}: {e}"[:5000])
        raise
    close_pipeline(ref, ok=True)
    return {"pipeline_id": ref.pipeline_id, "checks": checks, "margin": float(cfg.tracking.regression.margin)}


@flow(name=FLOW_NAME, log_prints=True)
def benchmark_regression(overrides: list[str] | None = None) -> dict:
    """Hydra overrides select the suite and sampling (eval.*) and the margin (tracking.regression.*). The
    verdict is published (tasks/publish.py) whether the check passes, finds a regression or cannot run."""
    overrides = list(overrides or [])
    try:
        result = run_regression(overrides)
    except Exception as e:
        checks = getattr(e, "checks", [])
        publish.regression(checks, next((x["margin"] for x in checks if x.get("margin") is not None), None), e)
        raise
    for x in result["checks"]:
        print(x["message"])
    publish.regression(result["checks"], result["margin"])
    return result
