"""`benchmark-regression`: the registered model's `candidate` against its `champion` (MLflow model-registry
aliases of `tracking.model_name`; train-and-eval makes each new version the candidate, the first one the champion
too). Each is evaluated on the benchmark suite in the precision it was trained to deploy (its rollout precision,
recorded with the checkpoint) and, where that is not BF16, unquantized too; every result is recorded with its
precision and labelled with what the model was trained as (parity.tracking.naming.label). Per benchmark the
candidate's deployed score is compared with the champion's, paired per problem (parity.tracking.regression);
every check is recorded and the flow run fails naming the benchmarks that dropped beyond the margin.

A model evaluated before with the same settings (naming the same suite, sampling, precision: see
evaluation_settings) keeps its stored result: the champion is not evaluated again every night. A candidate that is
the champion is evaluated and recorded, with nothing to compare. `tracking.regression.promote=true` moves the
champion alias to a candidate that passed; otherwise promotion is a person's decision (MLflow's UI, or
`MlflowClient().set_registered_model_alias(name, "champion", version)`)."""

from __future__ import annotations

from typing import Any

from prefect import flow

from parity.config import load_config, with_values
from parity.errors import ParityError
from parity.tracking import mlflow_log, naming
from tasks import publish
from tasks.recording import PipelineRef, close_pipeline, mlflow_client, open_pipeline, plain, registry, stage
from tasks.records import record_evaluation_task, regression_check_task
from tasks.stages import evaluate_task

FLOW_NAME = "benchmark-regression"


class RegressionDetected(RuntimeError):
    """At least one benchmark dropped beyond the margin; the message lists each with its interval, `checks`
    holds every check of the run."""

    def __init__(self, message: str, checks: list[dict]) -> None:
        super().__init__(message)
        self.checks = checks


def registered(ref: PipelineRef, name: str, alias: str, version: str) -> dict:
    """The registry's artifact of model `name` version `version`, with its facts and deploy precision spec."""
    art = registry(ref.registry_url).registered_version(name, version)
    if art is None:
        raise ParityError(f"model {name!r} version {version} ({alias}) is in the MLflow model registry but not in "
                          f"the registry database {ref.registry_url.split('@')[-1]}: it was not registered by "
                          "train-and-eval, so its checkpoint folder and precision are unknown")
    facts = dict(art.get("facts") or {})
    facts.setdefault("precision_spec", art["precision"])
    if "precision" not in facts:  # a version registered before artifacts kept their facts
        facts["precision"] = naming.precision_of_spec(art["precision"])
    return {**art, "alias": alias, "version": str(version), "facts": facts,
            "title": f"{naming.label_of(facts)} v{version}"}


def models_to_check(ref: PipelineRef, name: str) -> tuple[dict, dict | None]:
    """(candidate, champion or None). A model registered before the aliases existed: its latest version is the
    candidate."""
    c = mlflow_client(ref.tracking_uri)
    cand = mlflow_log.alias_version(c, name, mlflow_log.CANDIDATE)
    if cand is None:
        rows = registry(ref.registry_url).registered_versions(name)
        if not rows:
            raise ParityError(f"config key `tracking.model_name`: no registered model {name!r} in the registry "
                              f"{ref.registry_url.split('@')[-1]}: run train-and-eval first")
        cand = str(rows[-1]["mlflow_model_version"])
    champ = mlflow_log.alias_version(c, name, mlflow_log.CHAMPION)
    return (registered(ref, name, mlflow_log.CANDIDATE, cand),
            registered(ref, name, mlflow_log.CHAMPION, champ) if champ is not None else None)


def eval_config(cfg: Any, spec: str) -> Any:
    """The check's config with the rollout precision set to `spec` (formats only: the mismatch dial of a study is
    not part of a deployment)."""
    from parity.precision.config import parse_spec

    p = parse_spec(spec)
    values: dict[str, Any] = {f"rollout.precision.{key}": p[key]
                              for key in ("weights", "activations", "kv_cache", "kv_hadamard")}
    values["rollout.precision.perturbation.sigma"] = 0.0
    for key in ("quantization", "quantization_config_file", "engine_kwargs.vllm.kv_cache_dtype"):
        values[f"actor_rollout_ref.rollout.{key}"] = None  # the seed block would choose again
    return with_values(cfg, values)


def evaluate_model(ref: PipelineRef, cfg: Any, model: dict, spec: str) -> dict[str, int]:
    """{benchmark: result id} of `model` evaluated in precision `spec`: its stored results when it was evaluated
    with the same settings before, else a new evaluation (a stage run labelled with the model and precision)."""
    from parity.tracking.regression import evaluation_settings

    c = eval_config(cfg, spec)
    settings = evaluation_settings(c)
    reg = registry(ref.registry_url)
    found = {b: reg.find_evaluation(model["id"], b, settings) for b in c.eval.suite}
    if all(found.values()):
        print(f"{model['title']} [{naming.precision_of_spec(spec)}]: evaluated before with these settings, "
              f"results {sorted(found.values())} reused")
        return dict(found)
    with stage(ref, f"evaluate {model['alias']} {naming.precision_of_spec(spec)}") as st:
        e = evaluate_task(plain(c), model["path"])
        ids = record_evaluation_task(ref.as_dict(), e, model["id"], st.run_id)
        st.done({"model": model["path"], "version": model["version"], "precision": spec, "macro": e["macro"],
                 "result_ids": ids})
    return ids


def run_regression(overrides: list[str]) -> dict:
    cfg = load_config(overrides)
    name = str(cfg.tracking.model_name)
    settings = plain(cfg.tracking.regression)
    ref = None
    try:
        probe = PipelineRef(FLOW_NAME, str(cfg.tracking.registry_url), str(cfg.tracking.tracking_uri), "", 0, "")
        cand, champ = models_to_check(probe, name)
        vs = f"champion v{champ['version']}" if champ and champ["version"] != cand["version"] else "no champion"
        ref = open_pipeline(FLOW_NAME, cfg, overrides, facts=cand["facts"],
                            title=f"{naming.label_of(cand['facts'])} / regression v{cand['version']} vs {vs}")
        deploy = {"candidate": cand["facts"]["precision_spec"]}
        results = {"candidate": {}, "champion": {}}
        for who, model in (("candidate", cand), ("champion", champ)):
            if model is None or (who == "champion" and model["version"] == cand["version"]):
                continue
            spec = model["facts"]["precision_spec"]
            deploy[who] = spec
            results[who][spec] = evaluate_model(ref, cfg, model, spec)
            if settings.get("unquantized", True) and spec != "bf16":
                results[who]["bf16"] = evaluate_model(ref, cfg, model, "bf16")
        checks: list[dict] = []
        if results["champion"]:
            with stage(ref, "compare") as st:
                cand_ids, champ_ids = results["candidate"][deploy["candidate"]], results["champion"][deploy["champion"]]
                names = (f"candidate v{cand['version']} [{naming.precision_of_spec(deploy['candidate'])}]",
                         f"champion v{champ['version']} [{naming.precision_of_spec(deploy['champion'])}]")
                for bench, rid in cand_ids.items():
                    if bench in champ_ids:
                        checks.append(regression_check_task(ref.as_dict(), bench, champ_ids[bench], rid, settings,
                                                            names))
                st.done({"checks": [{k: x[k] for k in ("benchmark", "passed", "message")} for x in checks]})
        else:
            print(f"{cand['title']} is the champion: evaluated and recorded, nothing to compare")
        checks = [{**x, "model": naming.label_of(cand["facts"]), "model_version": cand["version"]} for x in checks]
        failed = [x["message"] for x in checks if not x["passed"]]
        if failed:
            raise RegressionDetected(f"{len(failed)} benchmark(s) regressed beyond the margin "
                                     f"{cfg.tracking.regression.margin}:\n" + "\n".join(failed), checks)
        promoted = None
        if checks and settings.get("promote"):
            mlflow_client(ref.tracking_uri).set_registered_model_alias(name, mlflow_log.CHAMPION, cand["version"])
            promoted = cand["version"]
            print(f"{cand['title']} passed against champion v{champ['version']}: it is the champion now")
    except BaseException as e:
        if ref is not None:
            close_pipeline(ref, ok=False, reason=f"{type(e).__name__}: {e}"[:5000])
        raise
    close_pipeline(ref, ok=True)
    return {"pipeline_id": ref.pipeline_id, "model": name, "candidate": cand["version"],
            "champion": champ["version"] if champ else None, "deploy_precision": deploy, "results": results,
            "checks": checks, "promoted": promoted,
            "margin": float(cfg.tracking.regression.margin)}


@flow(name=FLOW_NAME, log_prints=True)
def benchmark_regression(overrides: list[str] | None = None, chain: list[str] | None = None) -> dict:
    """Hydra overrides (`chain`, the served deployment's, then `overrides`) select the model (tracking.model_name),
    the suite and sampling (eval.*) and the margin (tracking.regression.*). The verdict is published
    (tasks/publish.py) whether the check passes, finds a regression or cannot run."""
    overrides = [*(chain or []), *(overrides or [])]
    try:
        result = run_regression(overrides)
    except Exception as e:
        checks = getattr(e, "checks", [])
        publish.regression(checks, next((x["margin"] for x in checks if x.get("margin") is not None), None), e)
        raise
    for x in result["checks"]:
        print(x["message"])
    alone = None if result["checks"] else (f"candidate v{result['candidate']} is the champion; its results are "
                                           "what the next candidate is checked against")
    publish.regression(result["checks"], result["margin"], nothing_to_compare=alone)
    return result
