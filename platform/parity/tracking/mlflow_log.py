"""MLflow logging of a pipeline: one parent run, a nested run per stage, the flattened resolved config
as params (secrets masked), per-step training metrics through `MlflowCallback`, artifacts, and the
trained model registered as a model version.

MLflow is imported lazily: the callback is handed to `parity.training.loop.train`, and the numerical
core must not import it."""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from parity.core.secrets import mask_params, mask_url
from parity.tracking.naming import EXPERIMENT_KIND_TAG, TRAINING_EXPERIMENT, TRAINING_VIEW_TAG, training_view

log = logging.getLogger(__name__)
PARAM_BATCH = 100  # MLflow accepts at most 100 params per log_batch call
METRIC_BATCH = 1000
PARAM_VALUE_MAX = 6000
_BAD_METRIC_CHARS = re.compile(r"[^\w\-. :/]")


def client(tracking_uri: str) -> Any:
    from mlflow import MlflowClient

    if tracking_uri.startswith("sqlite:///"):
        Path(tracking_uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    return MlflowClient(tracking_uri=tracking_uri)


def experiment_id(c: Any, name: str, artifact_dir: str | None = None) -> str:
    """The experiment's id, created on first use. A SQLite store keeps artifacts beside it (artifact_dir),
    not in ./mlruns of whatever directory the process happens to run in. The experiment is tagged as one of
    training runs (naming.EXPERIMENT_KIND_TAG) and carries the saved view of its runs table that
    naming.experiment_url opens (naming.TRAINING_VIEW_TAG); an experiment of an older store gets both on its
    next use, a kind a user set is kept."""
    exp = c.get_experiment_by_name(name)
    if exp is None:
        location = Path(artifact_dir).resolve().as_uri() if artifact_dir else None
        try:
            return str(c.create_experiment(name, artifact_location=location, tags={
                EXPERIMENT_KIND_TAG: TRAINING_EXPERIMENT, TRAINING_VIEW_TAG: training_view(int(time.time() * 1000))}))
        except Exception:  # created concurrently by another process
            exp = c.get_experiment_by_name(name)
            if exp is None:
                raise
    tags = exp.tags or {}
    if EXPERIMENT_KIND_TAG not in tags:
        c.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, TRAINING_EXPERIMENT)
    if not _same_view(tags.get(TRAINING_VIEW_TAG)):
        c.set_experiment_tag(exp.experiment_id, TRAINING_VIEW_TAG, training_view(int(time.time() * 1000)))
    return str(exp.experiment_id)


def _same_view(value: str | None) -> bool:
    """The stored view has this version's columns (its times aside)."""
    import json

    try:
        return json.loads(value or "")["state"] == json.loads(training_view(0))["state"]
    except (ValueError, KeyError, TypeError):
        return False


def default_artifact_dir(tracking_uri: str) -> str | None:
    if tracking_uri.startswith("sqlite:///"):
        return str(Path(tracking_uri.removeprefix("sqlite:///")).parent / "mlartifacts")
    return None


_ARTIFACT_URIS: dict[str, str] = {}  # run id -> artifact URI of the runs this process created


def start_run(c: Any, exp_id: str, name: str, parent_run_id: str | None = None,
              tags: dict[str, str] | None = None) -> str:
    tags = dict(tags or {})
    if parent_run_id:
        tags["mlflow.parentRunId"] = parent_run_id
    info = c.create_run(exp_id, run_name=name, tags=tags).info
    if len(_ARTIFACT_URIS) > 10_000:
        _ARTIFACT_URIS.clear()
    _ARTIFACT_URIS[info.run_id] = info.artifact_uri
    return info.run_id


def end_run(c: Any, run_id: str, ok: bool) -> None:
    c.set_terminated(run_id, "FINISHED" if ok else "FAILED")


def param_entities(params: dict[str, Any]) -> list[Any]:
    from mlflow.entities import Param

    out = []
    for k, v in mask_params(params).items():
        s = "None" if v is None else str(v)
        out.append(Param(k, s if len(s) <= PARAM_VALUE_MAX else s[: PARAM_VALUE_MAX - 3] + "..."))
    return out


def log_params(c: Any, run_id: str, params: dict[str, Any]) -> None:
    ents = param_entities(params)
    for i in range(0, len(ents), PARAM_BATCH):
        c.log_batch(run_id, params=ents[i: i + PARAM_BATCH])


def log_metrics(c: Any, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    ents = [Metric(metric_key(k), float(v), now, int(step)) for k, v in metrics.items() if _is_number(v)]
    for i in range(0, len(ents), METRIC_BATCH):
        c.log_batch(run_id, metrics=ents[i: i + METRIC_BATCH])


def log_artifact(c: Any, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
    p = Path(path)
    if p.is_dir():
        c.log_artifacts(run_id, str(p), artifact_path)
    elif p.is_file():
        c.log_artifact(run_id, str(p), artifact_path)


def register_model(c: Any, run_id: str, model_dir: str | Path, name: str, tags: dict[str, str]) -> str:
    """Log the checkpoint folder as the run's `model` artifact and register it as a version of `name`."""
    from mlflow.exceptions import MlflowException

    log_artifact(c, run_id, model_dir, "model")
    try:
        c.create_registered_model(name)
    except MlflowException as e:
        if "RESOURCE_ALREADY_EXISTS" not in str(e.error_code) and "already exists" not in str(e):
            raise
    artifact_uri = _ARTIFACT_URIS.get(run_id) or c.get_run(run_id).info.artifact_uri  # known: no store round trip
    source = f"{artifact_uri}/model"
    mv = c.create_model_version(name, source=source, run_id=run_id, tags={k: str(v) for k, v in tags.items()})
    return str(mv.version)


CANDIDATE, CHAMPION = "candidate", "champion"  # MLflow model-registry aliases of a registered model


def set_candidate(c: Any, name: str, version: str | int) -> dict[str, str]:
    """Version `version` becomes the model's `candidate`; a model without a `champion` (its first version) gets
    this one as its champion too. Returns {alias: version} as they stand."""
    c.set_registered_model_alias(name, CANDIDATE, str(version))
    champion = alias_version(c, name, CHAMPION)
    if champion is None:
        c.set_registered_model_alias(name, CHAMPION, str(version))
        champion = str(version)
    return {CANDIDATE: str(version), CHAMPION: champion}


def alias_version(c: Any, name: str, alias: str) -> str | None:
    """The version an alias of registered model `name` points at; None when the model or the alias is unknown."""
    from mlflow.exceptions import MlflowException

    try:
        return str(c.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def metric_key(key: str) -> str:
    """MLflow accepts only [alphanumerics _ - . space : /] in names: avg@k becomes avg_at_k."""
    return _BAD_METRIC_CHARS.sub("_", key.replace("@", "_at_"))


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _endpoint(tracking_uri: str) -> tuple[str, int] | None:
    u = urlparse(tracking_uri)
    if u.scheme not in ("http", "https") or not u.hostname:
        return None
    return u.hostname, u.port or (443 if u.scheme == "https" else 80)


def reachable(tracking_uri: str, timeout_s: float = 0.5) -> bool:
    """A short TCP connect to an HTTP store (MLflow's own client retries for minutes); True otherwise."""
    ep = _endpoint(tracking_uri)
    if ep is None:
        return True
    try:
        with socket.create_connection(ep, timeout=timeout_s):
            return True
    except OSError:
        return False


class MlflowCallback:
    """`train(cfg, callbacks=[MlflowCallback(...)])`: logs each step's metrics to a run. When the store is
    unreachable the metrics stay in a buffer (training goes on) and are written, with their original
    steps and timestamps, once it answers again. An HTTP store is probed with a short TCP connect
    first, because MLflow's own client retries for minutes before it gives up.

    `flush_every_s` batches the writes: the first step is written at once, later steps at most every
    `flush_every_s` seconds (one log_batch for all of them), so the store is never more than about that far
    behind the run: a background thread writes what waits once it is due even when no further step comes
    (a long held-out evaluation, the last steps before a slow checkpoint), and `close()` writes the rest.
    Each write is a store transaction (a commit and, on SQLite, an fsync), so on a fast run one write per
    step costs more than the step's own logging; 0 writes every step at once."""

    def __init__(self, tracking_uri: str, run_id: str, retry_after_s: float = 5.0, probe_timeout_s: float = 0.5,
                 max_buffer: int = 1_000_000, mlflow_client: Any = None, flush_every_s: float = 0.0) -> None:
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self.flush_every_s = flush_every_s
        self._next_flush = 0.0
        self.retry_after_s = retry_after_s
        self.probe_timeout_s = probe_timeout_s
        self.max_buffer = max_buffer
        self._client = mlflow_client
        self.buffer: list[Any] = []
        self.outages = 0
        self.dropped = 0
        self.written = 0
        self.seconds = 0.0
        self._down_since: float | None = None
        self._next_try = 0.0
        self._lock = threading.RLock()  # the training thread and the flusher share the buffer and the client
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None

    def on_step(self, step: int, metrics: dict[str, float]) -> None:
        t0 = time.perf_counter()
        try:
            self._on_step(step, metrics)
        finally:
            self.seconds += time.perf_counter() - t0  # what logging cost the training loop

    def _on_step(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        with self._lock:
            self.buffer.extend(Metric(metric_key(k), float(v), now, int(step)) for k, v in metrics.items()
                               if _is_number(v))
            if len(self.buffer) > self.max_buffer:  # bounded memory over a very long outage: oldest go first
                self.dropped += len(self.buffer) - self.max_buffer
                del self.buffer[: len(self.buffer) - self.max_buffer]
            if time.monotonic() >= self._due():
                self.flush()
        if self.flush_every_s > 0 and self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_when_due, name="mlflow-metrics", daemon=True)
            self._flusher.start()

    def _due(self) -> float:
        return max(self._next_try, self._next_flush)

    def _flush_when_due(self) -> None:
        """The flusher thread: what waits in the buffer is written once it is due, steps or not."""
        while not self._stop.wait(min(max(self.flush_every_s / 4, 0.05), 1.0)):
            if self.buffer and time.monotonic() >= self._due():
                with self._lock:
                    if self.buffer and time.monotonic() >= self._due():
                        self.flush()

    def _reachable(self) -> bool:
        return reachable(self.tracking_uri, self.probe_timeout_s)

    def flush(self) -> bool:
        """Write the buffer; True when it is empty afterwards. Never raises."""
        with self._lock:
            return self._flush()

    def _flush(self) -> bool:
        if not self.buffer:
            return True
        try:
            if not self._reachable():
                raise ConnectionError(f"MLflow store {mask_url(self.tracking_uri)} is not reachable")
            if self._client is None:
                self._client = client(self.tracking_uri)
            while self.buffer:
                chunk = self.buffer[:METRIC_BATCH]
                self._client.log_batch(self.run_id, metrics=chunk)
                del self.buffer[: len(chunk)]
                self.written += len(chunk)
        except Exception as e:  # any store failure: keep the metrics, keep training
            if self._down_since is None:
                self._down_since = time.monotonic()
                self.outages += 1
                log.warning("MLflow logging paused, %d metric values buffered: %s", len(self.buffer),
                            mask_url(str(e))[:300])
            self._next_try = time.monotonic() + self.retry_after_s
            return False
        if self._down_since is not None:
            log.warning("MLflow store is back after %.0f s; buffered metrics written",
                        time.monotonic() - self._down_since)
            self._down_since = None
        self._next_flush = time.monotonic() + self.flush_every_s
        return True

    def close(self, wait_s: float = 0.0) -> bool:
        """Stop the flusher, then a final flush, retrying for up to wait_s seconds; False (and a warning) if
        metrics remain."""
        self._stop.set()
        if self._flusher is not None:
            self._flusher.join(timeout=30)
            self._flusher = None
        deadline = time.monotonic() + wait_s
        while not self.flush():
            if time.monotonic() >= deadline:
                log.warning("MLflow store unreachable at the end of training: %d metric values not written",
                            len(self.buffer))
                return False
            time.sleep(min(1.0, self.retry_after_s))
        return True
