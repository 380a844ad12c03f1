"""what a model artifact was trained as (its facts, the label's source), the precision and settings of each
evaluation (so a champion's result at the same settings is reused by the regression check)

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("model_artifacts") as b:
        b.add_column(sa.Column("facts", sa.JSON))
    with op.batch_alter_table("evaluation_results") as b:
        b.add_column(sa.Column("precision", sa.String(100)))
        b.add_column(sa.Column("settings", sa.String(64)))
        b.create_index("ix_evaluation_results_settings", ["settings"])


def downgrade() -> None:
    with op.batch_alter_table("evaluation_results") as b:
        b.drop_index("ix_evaluation_results_settings")
        b.drop_column("settings")
        b.drop_column("precision")
    with op.batch_alter_table("model_artifacts") as b:
        b.drop_column("facts")
