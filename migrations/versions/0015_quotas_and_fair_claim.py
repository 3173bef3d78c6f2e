"""quotas and the fair claim: per-project quotas, each job's place in the fair order

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-06

`projects` gets four quotas (NULL: no limit): `max_running_jobs`, `max_queued_jobs`,
`max_submissions_per_minute`, `max_trainer_seconds_per_day`. `jobs.fair_seq` is a job's
place in the claim order (projects take turns: `app.jobs.statements.fair_place`); the rows
already there get 0, so they keep their submission order among themselves and go first.
`jobs.submitted`: whether it came through the API (what the submissions quota counts, not
the jobs a run or a rollout makes).
The claim's index becomes (fair_seq, id) of queued jobs (`ix_jobs_queued_fair`, replacing
`ix_jobs_queued` of 0004); three more serve the quotas: a project's queued jobs, its running
ones, and its jobs by creation time.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

QUEUED = sa.text("status = 'queued'")
RUNNING = sa.text("status = 'running' AND kind <> 'run'")
QUOTAS = (
    "max_running_jobs",
    "max_queued_jobs",
    "max_submissions_per_minute",
    "max_trainer_seconds_per_day",
)


def upgrade() -> None:
    for quota in QUOTAS:
        op.add_column("projects", sa.Column(quota, sa.Integer(), nullable=True))
    op.add_column(
        "jobs",
        sa.Column("fair_seq", sa.BigInteger(), nullable=False, server_default=sa.text("0")),
    )
    op.add_column(
        "jobs",
        sa.Column("submitted", sa.Boolean(), nullable=False, server_default=sa.false()),
    )
    op.drop_index("ix_jobs_queued", table_name="jobs")
    op.create_index(
        "ix_jobs_queued_fair",
        "jobs",
        ["fair_seq", "id"],
        sqlite_where=QUEUED,
        postgresql_where=QUEUED,
    )
    op.create_index(
        "ix_jobs_project_queued",
        "jobs",
        ["project_id", "fair_seq"],
        sqlite_where=QUEUED,
        postgresql_where=QUEUED,
    )
    op.create_index(
        "ix_jobs_project_running",
        "jobs",
        ["project_id", "fair_seq"],
        sqlite_where=RUNNING,
        postgresql_where=RUNNING,
    )
    op.create_index("ix_jobs_project_created", "jobs", ["project_id", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_jobs_project_created", table_name="jobs")
    op.drop_index("ix_jobs_project_running", table_name="jobs")
    op.drop_index("ix_jobs_project_queued", table_name="jobs")
    op.drop_index("ix_jobs_queued_fair", table_name="jobs")
    op.create_index("ix_jobs_queued", "jobs", ["id"], sqlite_where=QUEUED, postgresql_where=QUEUED)
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("submitted")
        batch_op.drop_column("fair_seq")
    with op.batch_alter_table("projects") as batch_op:
        for quota in reversed(QUOTAS):
            batch_op.drop_column(quota)
