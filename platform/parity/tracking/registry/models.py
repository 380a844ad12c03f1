"""Registry schema (SQLAlchemy 2 ORM). The tables are created only by the Alembic migrations under
parity/tracking/migrations; this module is the ORM's view of the head revision.

Lineage: a model artifact points to the artifact it was made from (checkpoint -> quantized ->
validated), so "which checkpoint was quantized into what, validated with which report" is a walk up
`parent_id`."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, Boolean, DateTime, Float, ForeignKey, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class Pipeline(Base):
    __tablename__ = "pipelines"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    flow: Mapped[str] = mapped_column(String(100))  # train-and-eval | benchmark-regression | sweep
    flow_run_id: Mapped[str | None] = mapped_column(String(64), index=True)
    experiment: Mapped[str | None] = mapped_column(String(200))
    overrides: Mapped[list[Any]] = mapped_column(JSON, default=list)
    status: Mapped[str] = mapped_column(String(20), default="running")  # running | completed | failed
    reason: Mapped[str | None] = mapped_column(Text)
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    stages: Mapped[list[Stage]] = relationship(back_populates="pipeline", order_by="Stage.id")


class Stage(Base):
    __tablename__ = "stages"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    pipeline_id: Mapped[int] = mapped_column(ForeignKey("pipelines.id"), index=True)
    name: Mapped[str] = mapped_column(String(50))  # prepare | quantize | validate | train | evaluate | register
    status: Mapped[str] = mapped_column(String(20), default="running")  # running | completed | failed | skipped
    reason: Mapped[str | None] = mapped_column(Text)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    pipeline: Mapped[Pipeline] = relationship(back_populates="stages")


class ModelArtifact(Base):
    __tablename__ = "model_artifacts"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    pipeline_id: Mapped[int | None] = mapped_column(ForeignKey("pipelines.id"), index=True)
    stage_id: Mapped[int | None] = mapped_column(ForeignKey("stages.id"))
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("model_artifacts.id"))
    kind: Mapped[str] = mapped_column(String(20))  # base | checkpoint | quantized | validated
    path: Mapped[str] = mapped_column(Text)
    precision: Mapped[str] = mapped_column(String(100), default="bf16")
    validation_status: Mapped[str | None] = mapped_column(String(20))  # passed | failed | not_required
    report: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    report_path: Mapped[str | None] = mapped_column(Text)
    mlflow_model_name: Mapped[str | None] = mapped_column(String(200))
    mlflow_model_version: Mapped[str | None] = mapped_column(String(20))
    # what the model was trained as (parity.tracking.naming.facts_of): experiment, precision, correction, seed
    facts: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    parent: Mapped[ModelArtifact | None] = relationship(remote_side="ModelArtifact.id")


class EvaluationResult(Base):
    __tablename__ = "evaluation_results"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    pipeline_id: Mapped[int | None] = mapped_column(ForeignKey("pipelines.id"), index=True)
    artifact_id: Mapped[int | None] = mapped_column(ForeignKey("model_artifacts.id"), index=True)
    benchmark: Mapped[str] = mapped_column(String(100), index=True)
    k: Mapped[int] = mapped_column(Integer)
    problems: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)
    out_dir: Mapped[str | None] = mapped_column(Text)
    precision: Mapped[str | None] = mapped_column(String(100))  # the engine's precision spec of this evaluation
    settings: Mapped[str | None] = mapped_column(String(64), index=True)  # digest of what decides its scores
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    samples: Mapped[list[EvaluationSample]] = relationship(back_populates="result", order_by="EvaluationSample.id")


class EvaluationSample(Base):
    __tablename__ = "evaluation_samples"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    result_id: Mapped[int] = mapped_column(ForeignKey("evaluation_results.id"), index=True)
    problem_id: Mapped[str] = mapped_column(String(200))
    sample: Mapped[int] = mapped_column(Integer)
    score: Mapped[float] = mapped_column(Float)
    extracted: Mapped[str | None] = mapped_column(Text)
    status: Mapped[str | None] = mapped_column(String(40))
    result: Mapped[EvaluationResult] = relationship(back_populates="samples")


class Baseline(Base):
    __tablename__ = "baselines"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    benchmark: Mapped[str] = mapped_column(String(100), index=True)
    result_id: Mapped[int] = mapped_column(ForeignKey("evaluation_results.id"))
    active: Mapped[bool] = mapped_column(Boolean, default=True)
    note: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class RegressionCheck(Base):
    __tablename__ = "regression_checks"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    pipeline_id: Mapped[int | None] = mapped_column(ForeignKey("pipelines.id"), index=True)
    benchmark: Mapped[str] = mapped_column(String(100))
    baseline_result_id: Mapped[int] = mapped_column(ForeignKey("evaluation_results.id"))
    candidate_result_id: Mapped[int] = mapped_column(ForeignKey("evaluation_results.id"))
    paired_problems: Mapped[int] = mapped_column(Integer)
    delta: Mapped[float] = mapped_column(Float)  # candidate - baseline, mean over paired problems
    ci_low: Mapped[float] = mapped_column(Float)
    ci_high: Mapped[float] = mapped_column(Float)
    margin: Mapped[float] = mapped_column(Float)
    passed: Mapped[bool] = mapped_column(Boolean)
    message: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
