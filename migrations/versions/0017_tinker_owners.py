"""tinker owners: the project of each Tinker session and sampling session

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-06

`tinker_sessions`: one row per session the SDK made (`create_session`), with the project of
the key that made it, so that after a restart another project's key still finds no session.
`tinker_samplers.project_id`: the project a sampling session belongs to (its run's, or for a
base model with no adapter, the key's that made it); NULL for the rows from before, which
keep the rule they were made under (a registered base model's project; none for a model
directory). New table and a nullable column on both dialects.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import app.db

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tinker_sessions",
        sa.Column("session_id", sa.String(length=64), nullable=False),
        sa.Column("project_id", sa.String(length=40), nullable=False),
        sa.Column("created_at", app.db.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("session_id", name=op.f("pk_tinker_sessions")),
    )
    op.add_column("tinker_samplers", sa.Column("project_id", sa.String(length=40), nullable=True))


def downgrade() -> None:
    op.drop_column("tinker_samplers", "project_id")
    op.drop_table("tinker_sessions")
