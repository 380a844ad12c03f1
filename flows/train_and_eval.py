"""`train-and-eval`: prepare -> quantize -> validate -> train -> evaluate -> register.

Parameters are Hydra overrides composed exactly as `python -m parity <command>` composes them, so any
experiment runs through this flow. A failed validation stops the flow before training, with the
validation report's verdict as the reason."""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow

from parity.config import ParityConfig, load_config, with_values
from parity.tracking import naming
from parity.tracking.naming import headline_metrics
from tasks import publish
from tasks.recording import PipelineRef, close_pipeline, log_headline, open_pipeline, plain, stage
from tasks.records import record_artifact_task, record_evaluation_task, register_model_task
from tasks.stages import (
    ValidationFailed,
    evaluate_task,
    precision_label,
    prepare,
    quantize,
    train_task,
    validate_task,
)

FLOW_NAME = "train-and-eval"


def compose(overrides: list[str], extra_config_dir: str | None = None) -> ParityConfig:
    """The run gets its own run name unless the overrides choose one, so pipelines never collide."""
    cfg = load_config(overrides, extra_config_dir=extra_config_dir)
    if not any(o.lstrip("+~").startswith("trainer.run_name=") for o in overrides):
        cfg = with_values(cfg, {"trainer.run_name": f"{cfg.experiment_name}-{time.strftime('%Y%m%d-%H%M%S')}-"
                                                    f"{time.time_ns() % 10**6:06d}"})
    return cfg


def run_stages(ref: PipelineRef, cfg: ParityConfig) -> dict:
    c = plain(cfg)
    r = ref.as_dict()
    with stage(ref, "prepare") as st:
        base = st.done(prepare(c))
    base_id = record_artifact_task(r, "base", base["model_dir"], "bf16")
    with stage(ref, "quantize") as st:
        q = quantize(c, base["model_dir"])
        if q.get("skipped"):
            st.skip(q["reason"], q)
        else:
            st.done(q)
    rollout_id = base_id if q.get("skipped") else record_artifact_task(r, "quantized", q["path"], q["precision"],
                                                                        parent_id=base_id)
    with stage(ref, "validate") as st:
        v = validate_task(c, q)
        for f in (v.get("report_path"), v.get("report_md")):
            st.artifact(f, "validation")
        if v["status"] == "not_required":
            st.skip(str(v["reason"]), v)
        else:
            st.done(v)
            # lineage keeps failed validations too: which quantized model failed, with which report
            rollout_id = record_artifact_task(r, "validated", q["path"], q["precision"], parent_id=rollout_id,
                                              validation_status=v["status"], report=v.get("report"),
                                              report_path=v.get("report_path"))
        if v["status"] == "failed":
            raise ValidationFailed(f"precision validation failed for {q['precision']}: {v.get('reason')} "
                                   f"(report: {v.get('report_path')})")
    with stage(ref, "train") as st:
        t = st.done(train_task(c, ref.tracking_uri, st.run_id, float(cfg.tracking.flush_wait_s)))
        for name in ("metrics.jsonl", "summary.json"):
            st.artifact(Path(t["run_dir"]) / name, "run")
    precision = precision_label(cfg)
    facts = naming.facts_of(cfg)  # what the checkpoint was trained as: its label on every page
    ckpt_id = record_artifact_task(r, "checkpoint", t["latest_checkpoint"], precision, parent_id=rollout_id,
                                   validation_status=v["status"], facts=facts)
    with stage(ref, "evaluate") as st:
        e = evaluate_task(c, t["latest_checkpoint"])
        e["result_ids"] = record_evaluation_task(r, e, ckpt_id, st.run_id)
        st.done({"macro": e["macro"], "out_dir": e["out_dir"], "result_ids": e["result_ids"]})
    bench_set = naming.benchmark_set(naming.benchmark_problems(e["benchmarks"]))
    log_headline(ref, headline_metrics(t, e["macro"]), step=int(t.get("steps") or 0),
                 tags={naming.BENCHMARKS_TAG: bench_set})
    registered = None
    if cfg.tracking.log_model:
        with stage(ref, "register") as st:
            registered = st.done(register_model_task(
                r, st.run_id, ckpt_id, t["latest_checkpoint"], str(cfg.tracking.model_name),
                {**naming.tags_of(facts), "precision": precision, "validation_status": v["status"],
                 "pipeline_id": str(ref.pipeline_id), "run_name": str(cfg.trainer.run_name)}))
    return {"pipeline_id": ref.pipeline_id, "mlflow_run_id": ref.run_id, "run_name": str(cfg.trainer.run_name),
            "title": ref.title, "heldout": heldout_settings(cfg),
            "precision": precision, "validation": v["status"], "checkpoint": t["latest_checkpoint"],
            "initial_accuracy": t["initial_accuracy"], "final_accuracy": t["final_accuracy"],
            "final_reward": t["final_reward"], "train_seconds": t["seconds"], "evaluation": e["macro"],
            "benchmarks": e["benchmarks"], "eval_out_dir": e["out_dir"], "registered_model": registered,
            "lib_seconds": {"prepare": base.get("lib_seconds", 0.0), "quantize": q.get("lib_seconds", 0.0),
                            "validate": v.get("lib_seconds", 0.0), "train": t.get("lib_seconds", 0.0),
                            "evaluate": e.get("lib_seconds", 0.0)}}


def heldout_settings(cfg: ParityConfig) -> dict:
    """What the training's held-out accuracy is measured on (parity.training.heldout), for the summary that prints
    it beside the benchmarks: the task whose test split it is, how many problems, how they are sampled."""
    from parity.data.tasks import synthetic_task

    return {"task": synthetic_task(cfg.data).name, "problems": int(cfg.trainer.eval_problems),
            "temperature": float(cfg.trainer.eval_temperature), "samples": int(cfg.trainer.eval_samples),
            "max_new_tokens": int(cfg.rollout.max_new_tokens)}


def run_pipeline(overrides: list[str], extra_config_dir: str | None = None, sweep: str | None = None) -> dict:
    t0 = time.monotonic()
    cfg = compose(list(overrides), extra_config_dir)
    ref = open_pipeline(FLOW_NAME, cfg, list(overrides), sweep=sweep)
    try:
        result = run_stages(ref, cfg)
    except BaseException as e:
        close_pipeline(ref, ok=False, reason=f"{type(e).__name__}: {e}"[:5000])
        publish.train_and_eval_failed(ref.title, ref.stages, e)
        raise
    close_pipeline(ref, ok=True)
    publish.train_and_eval(result, time.monotonic() - t0)
    return result


@flow(name=FLOW_NAME, log_prints=True)
def train_and_eval(overrides: list[str] | None = None, extra_config_dir: str | None = None,
                   sweep: str | None = None, chain: list[str] | None = None) -> dict:
    """Hydra overrides `chain` then `overrides`, e.g. ["algorithm.correction.name=tis"] on the served deployment's
    chain (flows/deployments.py: `make run`'s own overrides), so a run differs from the chain's in what
    `overrides` names; `sweep` tags the MLflow runs as members of that sweep (the dashboard's Compare page opens
    on them)."""
    return run_pipeline([*(chain or []), *(overrides or [])], extra_config_dir, sweep)
