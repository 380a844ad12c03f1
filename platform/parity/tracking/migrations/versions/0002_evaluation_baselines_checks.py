"""evaluation results per benchmark and per sample, baselines, regression checks

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "evaluation_results",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("pipeline_id", sa.Integer, sa.ForeignKey("pipelines.id"), index=True),
        sa.Column("artifact_id", sa.Integer, sa.ForeignKey("model_artifacts.id"), index=True),
        sa.Column("benchmark", sa.String(100), nullable=False, index=True),
        sa.Column("k", sa.Integer, nullable=False),
        sa.Column("problems", sa.Integer, nullable=False),
        sa.Column("metrics", sa.JSON, nullable=False),
        sa.Column("out_dir", sa.Text),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_table(
        "evaluation_samples",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("result_id", sa.Integer, sa.ForeignKey("evaluation_results.id"), nullable=False, index=True),
        sa.Column("problem_id", sa.String(200), nullable=False),
        sa.Column("sample", sa.Integer, nullable=False),
        sa.Column("score", sa.Float, nullable=False),
        sa.Column("extracted", sa.Text),
        sa.Column("status", sa.String(40)),
    )
    op.create_table(
        "baselines",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("benchmark", sa.String(100), nullable=False, index=True),
        sa.Column("result_id", sa.Integer, sa.ForeignKey("evaluation_results.id"), nullable=False),
        sa.Column("active", sa.Boolean, nullable=False),
        sa.Column("note", sa.Text),
        sa.Column("created_at", TS, nullable=False),
    )
    op.create_table(
        "regression_checks",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("pipeline_id", sa.Integer, sa.ForeignKey("pipelines.id"), index=True),
        sa.Column("benchmark", sa.String(100), nullable=False),
        sa.Column("baseline_result_id", sa.Integer, sa.ForeignKey("evaluation_results.id"), nullable=False),
        sa.Column("candidate_result_id", sa.Integer, sa.ForeignKey("evaluation_results.id"), nullable=False),
        sa.Column("paired_problems", sa.Integer, nullable=False),
        sa.Column("delta", sa.Float, nullable=False),
        sa.Column("ci_low", sa.Float, nullable=False),
        sa.Column("ci_high", sa.Float, nullable=False),
        sa.Column("margin", sa.Float, nullable=False),
        sa.Column("passed", sa.Boolean, nullable=False),
        sa.Column("message", sa.Text, nullable=False),
        sa.Column("created_at", TS, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("regression_checks")
    op.drop_table("baselines")
    op.drop_table("evaluation_samples")
    op.drop_table("evaluation_results")
