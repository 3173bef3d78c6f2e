"""earlier attempt seconds: what a job's attempts before its last claim ran

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-07

`jobs.earlier_seconds`: the seconds of a job's attempts that went back to the queue (retried
after an error, handed back at a worker's shutdown, or recovered after its worker died),
each from its claim to the write that sent it back (to its lease's end, for a worker that
died). The write adds to it (`app.jobs.statements.job_update`) and sets
`jobs.returned_at_attempt` to the job's `attempts` after it: until a claim raises
`attempts` past it, the last attempt is already counted there (a job waiting for a retry,
or cancelled while it waited). A job's trainer or rollout seconds are `earlier_seconds`
and its last attempt's. 0 and NULL for the rows from before, which counted their last
attempt only. A column with a server default and a nullable one, on both dialects.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: str | None = "0017"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "jobs",
        sa.Column("earlier_seconds", sa.Float(), server_default=sa.text("0"), nullable=False),
    )
    op.add_column("jobs", sa.Column("returned_at_attempt", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "returned_at_attempt")
    op.drop_column("jobs", "earlier_seconds")
