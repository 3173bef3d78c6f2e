"""training runs and datasets

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05

A run is a `jobs` row of kind `run` (its status, events, cancel and idempotency key are a
job's) with its schedule's state in `runs` and one row per step and per validation in
`run_metrics`. A run holds no model slot: the unique index on running jobs per model now
leaves runs out, so its children can run. `datasets`: examples uploaded once, in splits.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import app.db

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

RUNNING = sa.text("status = 'running'")
RUNNING_NOT_RUN = sa.text("status = 'running' AND kind <> 'run'")
ACTIVE_RUN = sa.text("kind = 'run' AND status IN ('queued', 'running')")


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_index("uq_jobs_running_model", sqlite_where=RUNNING, postgresql_where=RUNNING)
        batch_op.create_index(
            "uq_jobs_running_model",
            ["model_name"],
            unique=True,
            sqlite_where=RUNNING_NOT_RUN,
            postgresql_where=RUNNING_NOT_RUN,
        )
        batch_op.create_index(
            "ix_jobs_active_runs", ["id"], sqlite_where=ACTIVE_RUN, postgresql_where=ACTIVE_RUN
        )
    op.create_table(
        "runs",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("paused", sa.Boolean(), nullable=False),
        sa.Column("state", app.db.JSONType, nullable=False),
        sa.Column("waiting_on", sa.String(length=40), nullable=True),
        sa.Column("updated_at", app.db.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["id"], ["jobs.id"], name=op.f("fk_runs_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
    )
    op.create_table(
        "run_metrics",
        sa.Column("run_id", sa.String(length=40), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("data", app.db.JSONType, nullable=False),
        sa.Column("created_at", app.db.UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["jobs.id"], name=op.f("fk_run_metrics_run_id_jobs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "seq", name=op.f("pk_run_metrics")),
    )
    op.create_table(
        "datasets",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("num_examples", sa.Integer(), nullable=False),
        sa.Column("splits", app.db.JSONType, nullable=False),
        sa.Column("payload", sa.LargeBinary(), nullable=False),
        sa.Column("payload_bytes", sa.Integer(), nullable=False),
        sa.Column("created_at", app.db.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_datasets")),
    )


def downgrade() -> None:
    op.drop_table("datasets")
    op.drop_table("run_metrics")
    op.drop_table("runs")
    op.execute("DELETE FROM job_events WHERE job_id IN (SELECT id FROM jobs WHERE kind = 'run')")
    op.execute("DELETE FROM jobs WHERE kind = 'run'")
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_index(
            "ix_jobs_active_runs", sqlite_where=ACTIVE_RUN, postgresql_where=ACTIVE_RUN
        )
        batch_op.drop_index(
            "uq_jobs_running_model", sqlite_where=RUNNING_NOT_RUN, postgresql_where=RUNNING_NOT_RUN
        )
        batch_op.create_index(
            "uq_jobs_running_model",
            ["model_name"],
            unique=True,
            sqlite_where=RUNNING,
            postgresql_where=RUNNING,
        )
