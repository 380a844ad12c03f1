"""The registry DB: pipelines and stages, model artifacts with lineage, evaluation results per
benchmark and per sample, baselines, regression checks. Every write is one transaction (a stage that
fails half way writes nothing of its own and leaves earlier rows as they were); SQL goes through the
ORM, so every value is a bound parameter."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import create_engine, event, select, update
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from parity.core.secrets import mask_url
from parity.tracking.registry import migrate
from parity.tracking.registry.models import (
    Baseline,
    EvaluationResult,
    EvaluationSample,
    ModelArtifact,
    Pipeline,
    RegressionCheck,
    Stage,
    utcnow,
)

log = logging.getLogger(__name__)


class RegistryError(RuntimeError):
    """The registry DB could not be reached or refused a write; the message names the (masked) URL."""


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    # WAL lets a reader and a writer overlap (the busy timeout, sqlite3's `timeout`, makes writers wait)
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def make_engine(url: str, busy_timeout_s: float = 30.0) -> Engine:
    """An engine on `url`; on SQLite a write waits up to `busy_timeout_s` for another writer's lock, then fails."""
    try:
        parsed = make_url(url)
    except ArgumentError as e:
        raise RegistryError(f"config key `tracking.registry_url`: not a database URL: {mask_url(url)!r}") from e
    if parsed.get_backend_name() == "sqlite":
        if parsed.database and parsed.database != ":memory:":
            from pathlib import Path

            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(parsed, connect_args={"timeout": busy_timeout_s})  # sqlite3_busy_timeout
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(parsed, pool_pre_ping=True, pool_size=2, max_overflow=2)


class Registry:
    def __init__(self, url: str, upgrade: bool = True, busy_timeout_s: float = 30.0) -> None:
        self.url = url
        self.engine = make_engine(url, busy_timeout_s)
        self._session = sessionmaker(self.engine, expire_on_commit=False)
        if upgrade:
            with self._errors("upgrade"):
                migrate.upgrade(self.engine)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except SQLAlchemyError as e:
            raise RegistryError(f"registry {mask_url(self.url)}: {what} failed: "
                                f"{mask_url(str(e.orig if getattr(e, 'orig', None) else e))}") from e

    @contextmanager
    def _tx(self, what: str) -> Iterator[Session]:
        with self._errors(what), self._session() as s, s.begin():
            yield s

    # pipelines and stages
    def start_pipeline(self, flow: str, overrides: Iterable[str] = (), experiment: str | None = None,
                       flow_run_id: str | None = None, mlflow_run_id: str | None = None) -> int:
        with self._tx("start_pipeline") as s:
            p = Pipeline(flow=flow, overrides=list(overrides), experiment=experiment, flow_run_id=flow_run_id,
                         mlflow_run_id=mlflow_run_id, status="running", started_at=utcnow())
            s.add(p)
            s.flush()
            return p.id

    def finish_pipeline(self, pipeline_id: int, status: str, reason: str | None = None) -> None:
        with self._tx("finish_pipeline") as s:
            s.execute(update(Pipeline).where(Pipeline.id == pipeline_id)
                      .values(status=status, reason=reason, finished_at=utcnow()))

    def set_pipeline_mlflow_run(self, pipeline_id: int, run_id: str) -> None:
        with self._tx("set_pipeline_mlflow_run") as s:
            s.execute(update(Pipeline).where(Pipeline.id == pipeline_id).values(mlflow_run_id=run_id))

    def start_stage(self, pipeline_id: int, name: str, mlflow_run_id: str | None = None) -> int:
        with self._tx("start_stage") as s:
            st = Stage(pipeline_id=pipeline_id, name=name, status="running", mlflow_run_id=mlflow_run_id,
                       started_at=utcnow())
            s.add(st)
            s.flush()
            return st.id

    def end_stage(self, stage_id: int, status: str, result: dict | None = None, reason: str | None = None) -> None:
        if status not in ("completed", "failed", "skipped"):
            raise ValueError(f"stage status must be completed, failed or skipped, got {status!r}")
        with self._tx("end_stage") as s:
            s.execute(update(Stage).where(Stage.id == stage_id)
                      .values(status=status, result=result, reason=reason, finished_at=utcnow()))

    def pipeline(self, pipeline_id: int) -> dict:
        with self._tx("pipeline") as s:
            p = s.get(Pipeline, pipeline_id)
            if p is None:
                raise RegistryError(f"registry {mask_url(self.url)}: no pipeline with id {pipeline_id}")
            return {"id": p.id, "flow": p.flow, "status": p.status, "reason": p.reason, "overrides": p.overrides,
                    "flow_run_id": p.flow_run_id, "mlflow_run_id": p.mlflow_run_id,
                    "stages": [{"id": st.id, "name": st.name, "status": st.status, "reason": st.reason,
                                "result": st.result} for st in p.stages]}

    def latest_pipeline(self, flow: str) -> dict | None:
        with self._tx("latest_pipeline") as s:
            pid = s.scalar(select(Pipeline.id).where(Pipeline.flow == flow).order_by(Pipeline.id.desc()).limit(1))
        return None if pid is None else self.pipeline(pid)

    def pipelines_of_flow_run(self, flow_run_id: str) -> list[int]:
        with self._tx("pipelines_of_flow_run") as s:
            return list(s.scalars(select(Pipeline.id).where(Pipeline.flow_run_id == flow_run_id)))

    # model artifacts and lineage
    def add_artifact(self, kind: str, path: str, precision: str = "bf16", *, parent_id: int | None = None,
                     pipeline_id: int | None = None, stage_id: int | None = None,
                     validation_status: str | None = None, report: dict | None = None,
                     report_path: str | None = None, facts: dict | None = None) -> int:
        with self._tx("add_artifact") as s:
            a = ModelArtifact(kind=kind, path=str(path), precision=precision, parent_id=parent_id,
                              pipeline_id=pipeline_id, stage_id=stage_id, validation_status=validation_status,
                              report=report, report_path=report_path, facts=facts, created_at=utcnow())
            s.add(a)
            s.flush()
            return a.id

    def set_mlflow_model_version(self, artifact_id: int, name: str, version: str) -> None:
        with self._tx("set_mlflow_model_version") as s:
            s.execute(update(ModelArtifact).where(ModelArtifact.id == artifact_id)
                      .values(mlflow_model_name=name, mlflow_model_version=str(version)))

    def artifact(self, artifact_id: int) -> dict:
        with self._tx("artifact") as s:
            a = s.get(ModelArtifact, artifact_id)
            if a is None:
                raise RegistryError(f"registry {mask_url(self.url)}: no model artifact with id {artifact_id}")
            return _artifact_dict(a)

    def lineage(self, artifact_id: int) -> list[dict]:
        """The artifact and its ancestors, newest first (e.g. validated -> quantized -> checkpoint)."""
        out: list[dict] = []
        with self._tx("lineage") as s:
            a = s.get(ModelArtifact, artifact_id)
            while a is not None:
                out.append(_artifact_dict(a))
                a = a.parent
        return out

    def latest_artifacts(self, kinds: Iterable[str] = ("checkpoint",), n: int = 1,
                         registered_only: bool = False) -> list[dict]:
        """Newest first; registered_only keeps those with an MLflow model version."""
        with self._tx("latest_artifacts") as s:
            q = select(ModelArtifact).where(ModelArtifact.kind.in_(list(kinds)))
            if registered_only:
                q = q.where(ModelArtifact.mlflow_model_version.is_not(None))
            rows = s.scalars(q.order_by(ModelArtifact.id.desc()).limit(n))
            return [_artifact_dict(a) for a in rows]

    def registered_versions(self, name: str) -> list[dict]:
        """The artifacts registered as versions of MLflow model `name`, oldest version first."""
        with self._tx("registered_versions") as s:
            rows = list(s.scalars(select(ModelArtifact).where(ModelArtifact.mlflow_model_name == name,
                                                              ModelArtifact.mlflow_model_version.is_not(None))))
            out = [_artifact_dict(a) for a in rows]
        return sorted(out, key=lambda a: (_version_number(a["mlflow_model_version"]), a["id"]))

    def registered_version(self, name: str, version: int | str) -> dict | None:
        """The artifact registered as version `version` of MLflow model `name` (the newest row if several)."""
        with self._tx("registered_version") as s:
            a = s.scalars(select(ModelArtifact).where(ModelArtifact.mlflow_model_name == name,
                                                      ModelArtifact.mlflow_model_version == str(version))
                          .order_by(ModelArtifact.id.desc()).limit(1)).first()
            return None if a is None else _artifact_dict(a)

    def registered_names(self) -> list[str]:
        with self._tx("registered_names") as s:
            return sorted(s.scalars(select(ModelArtifact.mlflow_model_name).distinct()
                                    .where(ModelArtifact.mlflow_model_name.is_not(None))))

    # evaluation, baselines, regression checks
    def add_evaluation(self, benchmark: str, k: int, problems: int, metrics: dict, samples: Iterable[dict], *,
                       pipeline_id: int | None = None, artifact_id: int | None = None,
                       out_dir: str | None = None, precision: str | None = None, settings: str | None = None) -> int:
        with self._tx("add_evaluation") as s:
            r = EvaluationResult(benchmark=benchmark, k=int(k), problems=int(problems), metrics=metrics,
                                 pipeline_id=pipeline_id, artifact_id=artifact_id, out_dir=out_dir,
                                 precision=precision, settings=settings, created_at=utcnow())
            s.add(r)
            s.flush()
            s.add_all([EvaluationSample(result_id=r.id, problem_id=str(x["problem_id"]), sample=int(x["sample"]),
                                        score=float(x["score"]), extracted=x.get("extracted"), status=x.get("status"))
                       for x in samples])
            return r.id

    def find_evaluation(self, artifact_id: int, benchmark: str, settings: str) -> int | None:
        """The newest result of `benchmark` for the artifact evaluated with the same settings digest, if any."""
        with self._tx("find_evaluation") as s:
            return s.scalar(select(EvaluationResult.id).where(EvaluationResult.artifact_id == artifact_id,
                                                              EvaluationResult.benchmark == benchmark,
                                                              EvaluationResult.settings == settings)
                            .order_by(EvaluationResult.id.desc()).limit(1))

    def sample_scores(self, result_id: int) -> dict[str, list[float]]:
        """problem id -> the scores of its samples, in sample order."""
        out: dict[str, list[float]] = {}
        with self._tx("sample_scores") as s:
            rows = s.execute(select(EvaluationSample.problem_id, EvaluationSample.score)
                             .where(EvaluationSample.result_id == result_id)
                             .order_by(EvaluationSample.problem_id, EvaluationSample.sample))
            for pid, score in rows:
                out.setdefault(pid, []).append(float(score))
        return out

    def evaluation(self, result_id: int) -> dict:
        with self._tx("evaluation") as s:
            r = s.get(EvaluationResult, result_id)
            if r is None:
                raise RegistryError(f"registry {mask_url(self.url)}: no evaluation result with id {result_id}")
            return {"id": r.id, "benchmark": r.benchmark, "k": r.k, "problems": r.problems, "metrics": r.metrics,
                    "artifact_id": r.artifact_id, "pipeline_id": r.pipeline_id, "out_dir": r.out_dir,
                    "precision": r.precision, "settings": r.settings}

    def set_baseline(self, benchmark: str, result_id: int, note: str | None = None) -> int:
        """The result becomes the benchmark's active baseline; earlier baselines stay, inactive."""
        with self._tx("set_baseline") as s:
            s.execute(update(Baseline).where(Baseline.benchmark == benchmark, Baseline.active.is_(True))
                      .values(active=False))
            b = Baseline(benchmark=benchmark, result_id=result_id, active=True, note=note, created_at=utcnow())
            s.add(b)
            s.flush()
            return b.id

    def baseline_result(self, benchmark: str) -> int | None:
        with self._tx("baseline_result") as s:
            return s.scalar(select(Baseline.result_id).where(Baseline.benchmark == benchmark,
                                                             Baseline.active.is_(True))
                            .order_by(Baseline.id.desc()).limit(1))

    def add_regression_check(self, *, benchmark: str, baseline_result_id: int, candidate_result_id: int,
                             paired_problems: int, delta: float, ci_low: float, ci_high: float, margin: float,
                             passed: bool, message: str, pipeline_id: int | None = None) -> int:
        with self._tx("add_regression_check") as s:
            c = RegressionCheck(benchmark=benchmark, baseline_result_id=baseline_result_id,
                                candidate_result_id=candidate_result_id, paired_problems=paired_problems,
                                delta=delta, ci_low=ci_low, ci_high=ci_high, margin=margin, passed=passed,
                                message=message, pipeline_id=pipeline_id, created_at=utcnow())
            s.add(c)
            s.flush()
            return c.id

    def count(self, table: str) -> int:
        from sqlalchemy import func

        models = {m.__tablename__: m for m in (Pipeline, Stage, ModelArtifact, EvaluationResult, EvaluationSample,
                                               Baseline, RegressionCheck)}
        if table not in models:
            raise ValueError(f"unknown registry table {table!r}; known: {', '.join(models)}")
        with self._tx("count") as s:
            return int(s.scalar(select(func.count()).select_from(models[table])) or 0)


def _artifact_dict(a: ModelArtifact) -> dict[str, Any]:
    return {"id": a.id, "kind": a.kind, "path": a.path, "precision": a.precision, "parent_id": a.parent_id,
            "pipeline_id": a.pipeline_id, "validation_status": a.validation_status, "report": a.report,
            "report_path": a.report_path, "mlflow_model_name": a.mlflow_model_name,
            "mlflow_model_version": a.mlflow_model_version, "facts": a.facts}


def _version_number(v: str | None) -> int:
    try:
        return int(str(v))
    except ValueError:
        return -1
