"""`python -m parity train tracking.enabled=true`: the run logged to MLflow without a flow.

One MLflow run in experiment `tracking.experiment` (the experiment_name by default), named like the
train stage of a pipeline: `<experiment> / <precision> / <correction> / seed <n> / train`
(parity.tracking.naming; `#2` ... when the experiment has a run of that name already), tagged with those facts and `trainer.run_name`; the flattened resolved config
as params (secrets masked) and as `config.yaml`, every step's metrics through `MlflowCallback` (buffered
while the store is unreachable), the headline metrics (final reward, held-out accuracy, the collapse flag
where the loop reports one), and at the end the run folder's `metrics.jsonl` and `summary.json` under
`run/`. A training error marks the run FAILED with the reason in the tag `parity.failure`. Inside the
train-and-eval flow the `train` stage does this itself (nested under the pipeline's run), so this
module is for the plain command only."""

from __future__ import annotations

import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parity.config import flatten
from parity.core.secrets import mask_url, masked_config_yaml
from parity.errors import ParityError
from parity.tracking import mlflow_log, naming
from parity.training.loop import run_dir_of

if TYPE_CHECKING:
    from parity.config.schema import ParityConfig


def tracked_train(cfg: ParityConfig, train_fn: Callable[[Any, list], dict]) -> dict:
    """train_fn(cfg, callbacks) -> summary, with the MLflow run around it; the summary gains
    mlflow_run_id, mlflow_experiment_id and mlflow_unwritten_metrics."""
    t = cfg.tracking
    uri = str(t.tracking_uri)
    if not mlflow_log.reachable(uri, timeout_s=2.0):
        raise ParityError(f"config key `tracking.tracking_uri`: MLflow store {mask_url(uri)} is not reachable; "
                          "start it or run with tracking.enabled=false")
    run_dir = run_dir_of(cfg)
    c = mlflow_log.client(uri)
    exp = mlflow_log.experiment_id(c, str(t.experiment), mlflow_log.default_artifact_dir(uri))
    name = naming.unique_run_name(c, exp, naming.stage_title(naming.run_title(cfg), "train"))
    run_id = mlflow_log.start_run(c, exp, name, tags={
        **naming.run_tags(cfg), naming.KIND_TAG: "train", naming.STAGE_TAG: "train", naming.COMMAND_TAG: "train",
        "parity.run_dir": str(run_dir.resolve()), "parity.resume": str(bool(cfg.trainer.resume)).lower()})
    cb = mlflow_log.MlflowCallback(uri, run_id, mlflow_client=c, flush_every_s=float(t.flush_every_s))
    try:
        mlflow_log.log_params(c, run_id, flatten(cfg))
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / "config.yaml"
            p.write_text(masked_config_yaml(cfg))
            mlflow_log.log_artifact(c, run_id, p)
        summary = train_fn(cfg, [cb])
    except BaseException as e:
        cb.close(wait_s=0.0)  # what the steps before the error measured is kept
        reason = mask_url(f"{type(e).__name__}: {e}" if str(e) else "".join(traceback.format_exception_only(e)))
        try:
            c.set_tag(run_id, naming.FAILURE_TAG, reason[:5000])
            mlflow_log.end_run(c, run_id, ok=False)
        except Exception:  # the store going away must not hide the training error
            pass
        raise
    unwritten = 0 if cb.close(wait_s=float(t.flush_wait_s)) else len(cb.buffer)
    mlflow_log.log_metrics(c, run_id, naming.headline_metrics(summary), step=int(summary.get("steps") or 0))
    for name in ("metrics.jsonl", "summary.json"):
        mlflow_log.log_artifact(c, run_id, run_dir / name, "run")
    mlflow_log.end_run(c, run_id, ok=True)
    return {**summary, "mlflow_run_id": run_id, "mlflow_experiment_id": exp, "mlflow_unwritten_metrics": unwritten,
            "mlflow_callback_s": round(cb.seconds, 3)}
