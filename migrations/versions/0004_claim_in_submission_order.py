"""claim queued jobs in submission order

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03

A claim takes the oldest eligible queued job by submission (job ids are time-ordered), so
a job retried after an error keeps its place instead of going to the back of the queue;
`not_before` only gates when it is eligible. A partial index on the ids of queued jobs
serves that scan; the index on (status, not_before, created_at) it replaces served the
earlier order.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

QUEUED = sa.text("status = 'queued'")


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_index("ix_jobs_claim")
        batch_op.create_index(
            "ix_jobs_queued", ["id"], sqlite_where=QUEUED, postgresql_where=QUEUED
        )


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_index("ix_jobs_queued")
        batch_op.create_index("ix_jobs_claim", ["status", "not_before", "created_at"])
