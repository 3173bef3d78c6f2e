"""evaluation results: one row per scored answer of an evaluation job

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05

`evaluation_results`: the answers an evaluation job sampled and scored, keyed by the job,
the example's index and the sample's (a retried job writes a row again as a no-op), with
the answer, its score, and the error that left it unscored. A new table on both dialects.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import app.db

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "evaluation_results",
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("example", sa.Integer(), nullable=False),
        sa.Column("sample", sa.Integer(), nullable=False),
        sa.Column("example_id", sa.String(length=200), nullable=False),
        sa.Column("answer", sa.Text(), nullable=True),
        sa.Column("score", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", app.db.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["jobs.id"],
            name=op.f("fk_evaluation_results_job_id_jobs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("job_id", "example", "sample", name=op.f("pk_evaluation_results")),
    )


def downgrade() -> None:
    op.drop_table("evaluation_results")
