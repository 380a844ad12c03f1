"""What every pipeline stage records, in one place: a registry row (pipelines/stages tables) and an
MLflow run nested under the pipeline's parent run. A stage that raises is marked failed with the
reason, and the rows of earlier stages stay as they were (each write is its own transaction)."""

from __future__ import annotations

import logging
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from parity.config import ParityConfig, as_plain, flatten, from_plain
from parity.tracking import mlflow_log, naming
from parity.tracking.registry import Registry
from parity.tracking.secrets import mask_url, masked_config_yaml

log = logging.getLogger(__name__)
_REGISTRIES: dict[str, Registry] = {}
_CLIENTS: dict[str, Any] = {}


def registry(url: str) -> Registry:
    """One Registry (engine and pool) per URL and process: stages of a flow run share it."""
    if url not in _REGISTRIES:
        _REGISTRIES[url] = Registry(url)
    return _REGISTRIES[url]


def mlflow_client(uri: str) -> Any:
    if uri not in _CLIENTS:
        _CLIENTS[uri] = mlflow_log.client(uri)
    return _CLIENTS[uri]


@dataclass
class PipelineRef:
    """Small and serialisable: what a task needs to find the pipeline's records. `title` names the MLflow
    runs (naming.run_title); `params`/`tags` are what every stage run of the pipeline carries (kept out of
    as_dict, which is what tasks receive)."""

    flow: str
    registry_url: str
    tracking_uri: str
    experiment_id: str
    pipeline_id: int
    run_id: str  # the MLflow parent run
    flow_run_id: str | None = None
    stages: list[str] = field(default_factory=list)
    title: str = ""
    sweep: str | None = None
    params: dict[str, Any] = field(default_factory=dict, repr=False)
    tags: dict[str, str] = field(default_factory=dict, repr=False)

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in ("params", "tags")}


def _flow_run_id() -> str | None:
    try:
        from prefect.runtime import flow_run

        return str(flow_run.id) if flow_run.id else None
    except Exception:
        return None


def open_pipeline(flow: str, cfg: ParityConfig, overrides: list[str], title: str | None = None,
                  sweep: str | None = None, facts: dict | None = None) -> PipelineRef:
    """Registry row + MLflow parent run named `title` (by default what the config runs: naming.run_title; `#2`,
    `#3` appended when the experiment already has a run of that name) in the MLflow experiment
    `tracking.experiment` (one per experiment_name by default), with the flattened resolved config as params
    (secrets masked), the resolved config as an artifact, and tags naming the experiment, precision, correction
    and seed of what it trains (`facts`, by default naming.facts_of(cfg)) and the sweep it belongs to."""
    t = cfg.tracking
    reg = registry(str(t.registry_url))
    flow_run_id = _flow_run_id()
    pid = reg.start_pipeline(flow, overrides=[mask_url(o) for o in overrides], experiment=str(cfg.experiment_name),
                             flow_run_id=flow_run_id)
    c = mlflow_client(str(t.tracking_uri))
    exp = mlflow_log.experiment_id(c, str(t.experiment), mlflow_log.default_artifact_dir(str(t.tracking_uri)))
    title = naming.unique_run_name(c, exp, title or naming.run_title(cfg))
    tags = {**naming.tags_of(facts or naming.facts_of(cfg)), naming.FLOW_TAG: flow, naming.PIPELINE_ID_TAG: str(pid),
            "parity.flow_run_id": str(flow_run_id), **({naming.SWEEP_TAG: sweep} if sweep else {})}
    run_id = mlflow_log.start_run(c, exp, title, tags={**tags, naming.KIND_TAG: "pipeline"})
    reg.set_pipeline_mlflow_run(pid, run_id)
    params = flatten(cfg)
    mlflow_log.log_params(c, run_id, params)
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "config.yaml"
        p.write_text(masked_config_yaml(cfg))
        mlflow_log.log_artifact(c, run_id, p)
    return PipelineRef(flow, str(t.registry_url), str(t.tracking_uri), exp, pid, run_id, flow_run_id, title=title,
                       sweep=sweep, params=params, tags=tags)


def log_headline(ref: PipelineRef, metrics: dict[str, float], step: int = 0,
                 tags: dict[str, str] | None = None) -> None:
    """The pipeline run's own numbers (naming.headline_metrics), shown as columns in MLflow's runs table, and the
    tags that say what they were measured on (naming.BENCHMARKS_TAG: the set the benchmark average is over)."""
    c = mlflow_client(ref.tracking_uri)
    if metrics:
        mlflow_log.log_metrics(c, ref.run_id, metrics, step=step)
    for k, v in (tags or {}).items():
        c.set_tag(ref.run_id, k, v)


def close_pipeline(ref: PipelineRef, ok: bool, reason: str | None = None) -> None:
    """Mark the pipeline finished. On the failure path a store that is down must not hide the stage's
    own error, so errors are logged there instead of raised."""
    try:
        registry(ref.registry_url).finish_pipeline(ref.pipeline_id, "completed" if ok else "failed",
                                                   None if reason is None else mask_url(reason))
        c = mlflow_client(ref.tracking_uri)
        if reason is not None:  # why it failed, on the run the Runs page and MLflow's table show
            c.set_tag(ref.run_id, naming.FAILURE_TAG, mask_url(reason)[:5000])
        mlflow_log.end_run(c, ref.run_id, ok)
    except Exception as e:
        if ok:
            raise
        log.error("could not record the failure of pipeline %s: %s", ref.pipeline_id, mask_url(str(e)))


class StageHandle:
    def __init__(self, ref: PipelineRef, name: str, stage_id: int, run_id: str) -> None:
        self.ref, self.name, self.stage_id, self.run_id = ref, name, stage_id, run_id
        self.result: dict | None = None
        self.skipped: str | None = None

    @property
    def client(self) -> Any:
        return mlflow_client(self.ref.tracking_uri)

    def done(self, result: dict) -> dict:
        self.result = result
        return result

    def artifact(self, path: str | Path | None, artifact_path: str | None = None) -> None:
        """Attach a file or folder to the stage's MLflow run (a missing one is skipped)."""
        if path and Path(path).exists():
            mlflow_log.log_artifact(self.client, self.run_id, path, artifact_path)

    def skip(self, reason: str, result: dict | None = None) -> dict:
        self.skipped = reason
        self.result = result or {}
        return self.result


def _reason(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}"
    return mask_url(msg if str(e) else "".join(traceback.format_exception_only(e)).strip())


# stage runs that carry the whole flattened config (the runs a researcher compares); the others carry the
# keys that tell runs apart (naming.identity_params)
FULL_PARAMS_STAGES = frozenset({"train", "evaluate"})


@contextmanager
def stage(ref: PipelineRef, name: str) -> Iterator[StageHandle]:
    """A stage: registry row + MLflow run `<pipeline title> / <name>` nested under the pipeline's run, with
    the pipeline's tags and its params (all of them for FULL_PARAMS_STAGES, the identifying ones otherwise)."""
    reg = registry(ref.registry_url)
    c = mlflow_client(ref.tracking_uri)
    run_id = mlflow_log.start_run(c, ref.experiment_id, naming.stage_title(ref.title or ref.flow, name),
                                  parent_run_id=ref.run_id,
                                  tags={**ref.tags, naming.STAGE_TAG: name, naming.PIPELINE_ID_TAG: str(ref.pipeline_id),
                                        naming.KIND_TAG: "stage"})
    if ref.params:
        mlflow_log.log_params(c, run_id, ref.params if name in FULL_PARAMS_STAGES
                              else naming.identity_params(ref.params))
    h = StageHandle(ref, name, reg.start_stage(ref.pipeline_id, name, mlflow_run_id=run_id), run_id)
    ref.stages.append(name)
    try:
        yield h
    except BaseException as e:
        reason = _reason(e)
        reg.end_stage(h.stage_id, "failed", result=h.result, reason=reason)
        c.set_tag(run_id, naming.FAILURE_TAG, reason[:5000])
        mlflow_log.end_run(c, run_id, ok=False)
        raise
    result = _jsonable(h.result or {})
    reg.end_stage(h.stage_id, "skipped" if h.skipped else "completed", result=result, reason=h.skipped)
    numbers = {k: v for k, v in result.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    if numbers:
        mlflow_log.log_metrics(c, run_id, {f"{name}/{k}": v for k, v in numbers.items()})
    mlflow_log.end_run(c, run_id, ok=True)


def _jsonable(x: Any) -> Any:
    import json

    return json.loads(json.dumps(x, default=str))


_TYPED: dict[str, ParityConfig] = {}
_TYPED_MAX = 8


def as_config(cfg: dict | ParityConfig) -> ParityConfig:
    """A task's config (passed as a resolved plain dict so it serialises) back as the schema's dataclasses.

    Checking it against the schema costs 0.2-0.5 s on two busy cores and every task (and cache-key function) of a
    pipeline does it for the same dict, so the typed result is kept per content digest and each caller gets its
    own deep copy, free to modify."""
    if not isinstance(cfg, dict):
        return cfg
    import copy
    import hashlib
    import json

    key = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=repr).encode()).hexdigest()
    typed = _TYPED.get(key)
    if typed is None:
        typed = from_plain(cfg)
        if len(_TYPED) >= _TYPED_MAX:
            _TYPED.pop(next(iter(_TYPED)))
        _TYPED[key] = typed
    return copy.deepcopy(typed)


def plain(cfg: ParityConfig) -> dict:
    return as_plain(cfg)
