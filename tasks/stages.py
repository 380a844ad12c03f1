"""One Prefect task per stage, each a thin call into parity returning a small serialisable dict.

Retries: only where repeating is safe and can help. prepare and quantize are pure (same inputs, same
files) and cached on their inputs; evaluate writes a fresh folder each time; train retries once as a
resume from its latest checkpoint. Errors that a retry cannot fix (bad config, bad data, a failed
validation) are never retried."""

from __future__ import annotations

import hashlib
import json
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from parity.config import ConfigError
from parity.errors import ParityError
from prefect import task
from prefect.context import TaskRunContext

from tasks.recording import as_config

PERMANENT = (ParityError, ConfigError, ValueError, KeyError, TypeError, FileNotFoundError)


class ValidationFailed(RuntimeError):
    """The quantized model failed its precision validation; the message is the report's verdict."""


def _transient(task_: Any, task_run: Any, state: Any) -> bool:
    """retry_condition_fn: retry infrastructure failures, not errors in the inputs."""
    try:
        state.result()
    except PERMANENT:
        return False
    except ValidationFailed:
        return False
    except BaseException:
        return True
    return False


def _digest(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _present_or_nonce(key: str, path: Path) -> str:
    # a cached result that points at a deleted folder must not be reused
    return key if path.exists() else f"{key}-missing-{time.time_ns()}"


def _prepare_key(_ctx: TaskRunContext, params: dict[str, Any]) -> str:
    from parity.models.prepare import resolve_model_dir

    cfg = as_config(params["cfg"])
    target = resolve_model_dir(cfg)
    return _present_or_nonce(f"prepare-{_digest(str(target))}", Path(str(target)) / "config.json")


@task(name="prepare", cache_key_fn=_prepare_key, cache_expiration=timedelta(days=30), persist_result=True,
      retries=1, retry_delay_seconds=5, retry_condition_fn=_transient)
def prepare_task(cfg: dict) -> dict:
    from parity.models.prepare import prepare_model

    return prepare_model(as_config(cfg))


def precision_label(cfg: Any) -> str:
    from parity.precision.config import resolve_precision

    p = resolve_precision(cfg)
    if (p.weights, p.activations, p.kv_cache) == ("bf16", "bf16", "bf16"):
        return "bf16"
    return f"w{p.weights}-a{p.activations}-kv{p.kv_cache}"


def _quantize_key(_ctx: TaskRunContext, params: dict[str, Any]) -> str:
    cfg = as_config(params["cfg"])
    model_dir = Path(params["model_dir"])
    stamp = (model_dir / "config.json").stat().st_mtime_ns if (model_dir / "config.json").exists() else 0
    key = f"quantize-{_digest([str(model_dir), stamp, precision_label(cfg), str(cfg.rollout.precision.export_dir)])}"
    return _present_or_nonce(key, Path(str(cfg.rollout.precision.export_dir)))


@task(name="quantize", cache_key_fn=_quantize_key, cache_expiration=timedelta(days=30), persist_result=True,
      retries=1, retry_delay_seconds=5, retry_condition_fn=_transient)
def quantize_task(cfg: dict, model_dir: str) -> dict:
    """Writes the compressed-tensors checkpoint of the starting model at the rollout precision; BF16 needs none."""
    c = as_config(cfg)
    label = precision_label(c)
    if label == "bf16":
        return {"skipped": True, "reason": "BF16 rollout: nothing to quantize", "precision": label,
                "path": model_dir}
    try:
        from parity.commands import quantize as quantize_cmd  # the precision agent's command, when present
    except ImportError:
        quantize_cmd = None
    if quantize_cmd is not None:
        out = dict(quantize_cmd.run(c.copy() if c.model.path else _with_model(c, model_dir)))
        path = out.get("out_dir") or out.get("checkpoint") or out.get("path") or out.get("config_file")
        return {"skipped": False, "precision": label, "path": str(Path(str(path)).parent
                                                                  if str(path).endswith(".json") else path),
                "result": out}
    return _export_directly(c, model_dir, label)


def _with_model(cfg: Any, model_dir: str) -> Any:
    from omegaconf import OmegaConf

    c = cfg.copy()
    OmegaConf.update(c, "model.path", str(model_dir), force_add=True)
    return c


def _export_directly(cfg: Any, model_dir: str, label: str) -> dict:
    import torch
    from parity.precision.config import resolve_precision
    from parity.precision.export import EXPORTABLE, checkpoint_dir_name, export_compressed_tensors
    from transformers import AutoModelForCausalLM

    p = resolve_precision(cfg)
    if (p.weights, p.activations) not in EXPORTABLE:
        raise ParityError(f"config key `rollout.precision`: weights={p.weights} activations={p.activations} has no "
                          f"compressed-tensors export; exportable: {sorted(EXPORTABLE)}")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = Path(str(cfg.rollout.precision.export_dir)) / checkpoint_dir_name(str(cfg.model.name), p.weights,
                                                                            p.activations)
    config_file = export_compressed_tensors(model, out, p.weights, p.activations, source_dir=model_dir)
    return {"skipped": False, "precision": label, "path": str(out), "config_file": str(config_file)}


@task(name="validate", retries=0)
def validate_task(cfg: dict, model_dir: str, quantized: dict) -> dict:
    """Quantized vs BF16 on held-out prompts. Returns {'status': passed|failed|not_required, 'report': ...};
    the flow stops on 'failed' with the report's verdict as the reason."""
    c = as_config(cfg)
    if quantized.get("skipped"):
        return {"status": "not_required", "reason": quantized.get("reason"), "report": None}
    try:
        from parity.commands import validate as validate_cmd
    except ImportError as e:
        raise ParityError("precision validation is not available (parity.commands.validate is missing): refusing "
                          "to train on an unvalidated quantized rollout") from e
    report = dict(validate_cmd.run(_with_model(c, model_dir)))
    passed = report.get("passed", report.get("ok"))
    if passed is None and "status" in report:
        passed = str(report["status"]).lower() in ("passed", "pass", "ok")
    return {"status": "passed" if passed else "failed", "report": report,
            "report_path": report.get("report_path") or report.get("report"),
            "reason": report.get("reason") or report.get("failures") or report.get("verdict")}


def _train_retry_resumes(cfg: Any) -> Any:
    """A retried train continues its own run from the latest checkpoint instead of starting over."""
    from omegaconf import OmegaConf
    from prefect.runtime import task_run

    if int(task_run.run_count or 1) > 1:
        cfg = cfg.copy()
        OmegaConf.update(cfg, "trainer.resume", True)
    return cfg


@task(name="train", retries=1, retry_delay_seconds=5, retry_condition_fn=_transient)
def train_task(cfg: dict, tracking_uri: str | None = None, mlflow_run_id: str | None = None,
               flush_wait_s: float = 10.0) -> dict:
    from parity.training.loop import train

    c = _train_retry_resumes(as_config(cfg))
    callbacks: list[Any] = []
    cb = None
    if tracking_uri and mlflow_run_id:
        from parity.tracking.mlflow_log import MlflowCallback

        cb = MlflowCallback(tracking_uri, mlflow_run_id)
        callbacks.append(cb)
    summary = train(c, callbacks=callbacks)
    if cb is not None:
        summary["mlflow_unwritten_metrics"] = 0 if cb.close(wait_s=flush_wait_s) else len(cb.buffer)
        summary["mlflow_outages"] = cb.outages
    return {k: summary.get(k) for k in ("run_dir", "initial_accuracy", "final_accuracy", "final_reward",
                                        "latest_checkpoint", "steps", "seconds", "mlflow_unwritten_metrics",
                                        "mlflow_outages")}


@task(name="evaluate", retries=1, retry_delay_seconds=5, retry_condition_fn=_transient)
def evaluate_task(cfg: dict, model_path: str) -> dict:
    from omegaconf import OmegaConf
    from parity.commands import evaluate as evaluate_cmd

    c = as_config(cfg).copy()
    OmegaConf.update(c, "eval.model_path", str(model_path))
    OmegaConf.update(c, "eval.run_name", None)
    return dict(evaluate_cmd.run(c))
