"""project claim seq: how many claims took a capped project's jobs

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-07

`projects.claim_seq`: raised by every Postgres claim that starts jobs of a project with a
running quota, in the claim's own statement (`app.jobs.statements.claim_statement`). The
claim locks the capped projects' rows and compares each locked row's `claim_seq` with the one
its snapshot read: a difference means another claim started jobs of that project after the
snapshot, whose count of running jobs is then stale, and the claim passes that project over.
That makes the capped claim one statement, as the uncapped one is. 0 for the rows from before.
Unused on SQLite, where one writer claims at a time.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0019"
down_revision: str | None = "0018"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "projects",
        sa.Column("claim_seq", sa.Integer(), server_default=sa.text("0"), nullable=False),
    )


def downgrade() -> None:
    op.drop_column("projects", "claim_seq")
