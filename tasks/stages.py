"""One Prefect task per stage, each a thin call into parity returning a small serialisable dict.

Retries: only where repeating is safe and can help. prepare and quantize are pure (same inputs, same
files) and cached on their inputs (a cached result is used while the folder it names is there: prepare / quantize); evaluate writes a fresh folder each time; train retries once as a
resume from its latest checkpoint. Errors that a retry cannot fix (bad config, bad data, a failed
validation) are never retried."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from prefect import task
from prefect.context import TaskRunContext

from parity.config import ConfigError
from parity.core.progress import LOGGER as PROGRESS_LOGGER
from parity.errors import ParityError
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


class _ToRunLog(logging.Handler):
    def __init__(self, run_log: Any) -> None:
        super().__init__(logging.INFO)
        self.run_log = run_log

    def emit(self, record: logging.LogRecord) -> None:
        self.run_log.info(record.getMessage())


@contextmanager
def progress_in_run_log() -> Iterator[None]:
    """The library's progress lines (parity.core.progress: the warm start, the RL steps, the evaluation, with an
    ETA) into this task run's Prefect log, which the run's page and `prefect deployment run ... --watch` (so
    `make run`'s terminal) show; without it they reach only the serving process's output. Not propagated
    meanwhile: the run logger prints them to that output already."""
    from prefect import get_run_logger

    lg = logging.getLogger(PROGRESS_LOGGER)
    handler, before = _ToRunLog(get_run_logger()), (lg.level, lg.propagate)
    lg.addHandler(handler)
    lg.setLevel(logging.INFO)
    lg.propagate = False
    try:
        yield
    finally:
        lg.removeHandler(handler)
        lg.setLevel(before[0])
        lg.propagate = before[1]


def _digest(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _prepare_target(cfg: Any) -> Path:
    from parity.models.prepare import resolve_model_dir

    return Path(str(resolve_model_dir(cfg)))


def _prepare_key(_ctx: TaskRunContext, params: dict[str, Any]) -> str:
    return f"prepare-{_digest(str(_prepare_target(as_config(params['cfg']))))}"


def _cached(task_: Any, present: bool, *args: Any) -> dict:
    """A cached stage task's result. Its cache is read only while the folder its result names is there (else it
    runs again, `refresh_cache`, and is cached anew under the same key, so the next run with these settings finds
    it); a result read from the cache was another run's: marked `cached`, with none of that run's seconds."""
    state = task_.with_options(refresh_cache=not present)(*args, return_state=True)
    result = state.result()
    if state.name == "Cached":
        result = {**result, "cached": True, "lib_seconds": 0.0}
    return result


def prepare(cfg: dict) -> dict:
    """The starting model (prepare_task), from the cache while its folder is there."""
    return _cached(prepare_task, (_prepare_target(as_config(cfg)) / "config.json").exists(), cfg)


@task(name="prepare", cache_key_fn=_prepare_key, cache_expiration=timedelta(days=30), persist_result=True,
      retries=1, retry_delay_seconds=5, retry_condition_fn=_transient)
def prepare_task(cfg: dict) -> dict:
    from parity.training.warm_start import prepare_model

    t0 = time.perf_counter()
    with progress_in_run_log():
        out = prepare_model(as_config(cfg))
    return {**out, "lib_seconds": time.perf_counter() - t0}


def precision_label(cfg: Any) -> str:
    """The rollout precision's full spec (parity.precision.config.precision_spec): what the registry stores as an
    artifact's precision ('bf16', 'wint8-aint8-kvint4_per_token_head', ...)."""
    from parity.precision.config import resolve_precision, spec_of

    return spec_of(resolve_precision(cfg))


def _quantized_weights(cfg: Any) -> bool:
    """Whether the rollout has a quantized checkpoint to write: its weights are not BF16 (a KV format or the
    mismatch dial alone is applied by the engine to the BF16 model)."""
    from parity.precision.config import resolve_precision

    return resolve_precision(cfg).weights != "bf16"


def _quantize_out(cfg: Any) -> Path | None:
    """The quantized checkpoint's folder; None for BF16 weights (nothing to write)."""
    from parity.commands.quantize import quantized_checkpoint_dir
    from parity.precision.config import resolve_precision

    return Path(quantized_checkpoint_dir(cfg, resolve_precision(cfg))) if _quantized_weights(cfg) else None


def _quantize_key(_ctx: TaskRunContext, params: dict[str, Any]) -> str:
    cfg = as_config(params["cfg"])
    model_dir = Path(params["model_dir"])
    stamp = (model_dir / "config.json").stat().st_mtime_ns if (model_dir / "config.json").exists() else 0
    out = _quantize_out(cfg)
    if out is None:
        return f"quantize-bf16-{_digest([str(model_dir), stamp])}"
    return f"quantize-{_digest([str(model_dir), stamp, precision_label(cfg), str(out)])}"


def quantize(cfg: dict, model_dir: str) -> dict:
    """The rollout's checkpoint (quantize_task), from the cache while its folder is there."""
    out = _quantize_out(as_config(cfg))
    return _cached(quantize_task, out is None or (out / "config.json").exists(), cfg, model_dir)


@task(name="quantize", cache_key_fn=_quantize_key, cache_expiration=timedelta(days=30), persist_result=True,
      retries=1, retry_delay_seconds=5, retry_condition_fn=_transient)
def quantize_task(cfg: dict, model_dir: str) -> dict:
    """The compressed-tensors checkpoint of the starting model at the rollout precision; BF16 needs none."""
    from parity.commands import quantize as quantize_cmd

    c = as_config(cfg)
    label = precision_label(c)
    if not _quantized_weights(c):
        return {"skipped": True, "reason": "BF16 rollout weights: nothing to quantize", "precision": label,
                "path": model_dir, "lib_seconds": 0.0}
    t0 = time.perf_counter()
    out = quantize_cmd.run(c)
    return {"skipped": False, "precision": label, "path": out["checkpoint_dir"], "config_file": out["config_file"],
            "checkpoint_bytes": out.get("checkpoint_bytes"), "lib_seconds": time.perf_counter() - t0}


@task(name="validate", retries=0)
def validate_task(cfg: dict, quantized: dict) -> dict:
    """Quantized vs BF16 on held-out prompts. Returns {'status': passed|failed|not_required, 'report': ...};
    the flow stops on 'failed' with the report's failures as the reason."""
    from parity.commands import validate as validate_cmd
    from parity.precision.validate import PrecisionValidationError

    if quantized.get("skipped"):
        return {"status": "not_required", "reason": quantized.get("reason"), "report": None, "lib_seconds": 0.0}
    t0 = time.perf_counter()
    try:  # this validation's own report (kept under validations/), not whichever is the latest by now
        out = validate_cmd.run(as_config(cfg))
        status, reason, paths = "passed", None, (out["report_json"], out["report_md"])
    except PrecisionValidationError as e:  # the command writes the report before it raises
        status, reason = "failed", str(e)
        paths = (getattr(e, "report_json", None), getattr(e, "report_md", None))
    report = json.loads(Path(paths[0]).read_text()) if paths[0] and Path(paths[0]).is_file() else None
    return {"status": status, "reason": reason, "report": report, "report_path": paths[0], "report_md": paths[1],
            "lib_seconds": time.perf_counter() - t0}


def _train_retry_resumes(cfg: Any) -> Any:
    """A retried train continues its own run from the latest checkpoint instead of starting over."""
    from prefect.runtime import task_run

    from parity.config import with_values

    if int(task_run.run_count or 1) > 1:
        cfg = with_values(cfg, {"trainer.resume": True})
    return cfg


@task(name="train", retries=1, retry_delay_seconds=5, retry_condition_fn=_transient)
def train_task(cfg: dict, tracking_uri: str | None = None, mlflow_run_id: str | None = None,
               flush_wait_s: float = 10.0) -> dict:
    from parity.commands.train import train

    c = _train_retry_resumes(as_config(cfg))
    callbacks: list[Any] = []
    cb = None
    if tracking_uri and mlflow_run_id:
        from parity.tracking.mlflow_log import MlflowCallback
        from tasks.recording import mlflow_client

        # the flow's client (one store connection per process), metrics batched per tracking.flush_every_s
        cb = MlflowCallback(tracking_uri, mlflow_run_id, mlflow_client=mlflow_client(tracking_uri),
                            flush_every_s=float(c.tracking.flush_every_s))
        callbacks.append(cb)
    t0 = time.perf_counter()
    with progress_in_run_log():
        summary = train(c, callbacks=callbacks)
    # the library's own time: MLflow logging from the callback is orchestration overhead
    summary["mlflow_callback_s"] = cb.seconds if cb is not None else 0.0
    summary["lib_seconds"] = time.perf_counter() - t0 - summary["mlflow_callback_s"]
    if not summary.get("latest_checkpoint"):
        raise ParityError("config key `trainer.checkpoint_every`: the run wrote no checkpoint, so there is nothing "
                          "to evaluate or register; set it > 0")
    if cb is not None:
        summary["mlflow_unwritten_metrics"] = 0 if cb.close(wait_s=flush_wait_s) else len(cb.buffer)
        summary["mlflow_outages"] = cb.outages
    out = {k: summary.get(k) for k in ("run_dir", "initial_accuracy", "final_accuracy", "final_reward", "final_mismatch",
                                       "latest_checkpoint", "steps", "seconds", "mlflow_unwritten_metrics",
                                       "mlflow_outages", "mlflow_callback_s", "lib_seconds")}
    # present only where the training measured them (a quantized rollout; a loop with the collapse alarm)
    out.update({k: summary[k] for k in ("final_accuracy_unquantized", "collapse_step") if k in summary})
    return out


@task(name="evaluate", retries=1, retry_delay_seconds=5, retry_condition_fn=_transient)
def evaluate_task(cfg: dict, model_path: str) -> dict:
    from parity.commands import evaluate as evaluate_cmd
    from parity.config import with_values
    from parity.tracking.regression import evaluation_settings

    c = with_values(as_config(cfg), {"eval.model_path": str(model_path), "eval.run_name": None,
                                     "eval.registered_model": None})
    t0 = time.perf_counter()
    with progress_in_run_log():
        out = dict(evaluate_cmd.run(c))
    # the precision it ran in and what decides its scores, recorded with each result (the regression check's reuse)
    return {**out, "precision": precision_label(c), "settings": evaluation_settings(c),
            "lib_seconds": time.perf_counter() - t0}
