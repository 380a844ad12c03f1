"""pipelines, their stages, and model artifacts with lineage

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "pipelines",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("flow", sa.String(100), nullable=False),
        sa.Column("flow_run_id", sa.String(64), index=True),
        sa.Column("experiment", sa.String(200)),
        sa.Column("overrides", sa.JSON, nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("reason", sa.Text),
        sa.Column("mlflow_run_id", sa.String(64)),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("finished_at", TS),
    )
    op.create_table(
        "stages",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("pipeline_id", sa.Integer, sa.ForeignKey("pipelines.id"), nullable=False, index=True),
        sa.Column("name", sa.String(50), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("reason", sa.Text),
        sa.Column("result", sa.JSON),
        sa.Column("mlflow_run_id", sa.String(64)),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("finished_at", TS),
    )
    op.create_table(
        "model_artifacts",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("pipeline_id", sa.Integer, sa.ForeignKey("pipelines.id"), index=True),
        sa.Column("stage_id", sa.Integer, sa.ForeignKey("stages.id")),
        sa.Column("parent_id", sa.Integer, sa.ForeignKey("model_artifacts.id")),
        sa.Column("kind", sa.String(20), nullable=False),
        sa.Column("path", sa.Text, nullable=False),
        sa.Column("precision", sa.String(100), nullable=False),
        sa.Column("validation_status", sa.String(20)),
        sa.Column("report", sa.JSON),
        sa.Column("report_path", sa.Text),
        sa.Column("mlflow_model_name", sa.String(200)),
        sa.Column("mlflow_model_version", sa.String(20)),
        sa.Column("created_at", TS, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("model_artifacts")
    op.drop_table("stages")
    op.drop_table("pipelines")
