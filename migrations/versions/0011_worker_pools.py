"""worker pools: what a model needs of a worker, and what each worker can run

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-08

`models.pool` (NULL: the `default` pool) and `models.labels` (labels a worker must have to
run its jobs, NULL: none). `workers.pool`, `backends`, `labels`, `version`: what a worker
runs, written when it registers; `draining` (it stopped claiming) and `drain_requested`
(when a drain was asked of it, through the API or `trainyard worker --drain`).
Plain added columns, nullable or with a server default, on both dialects.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import app.db

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("models", sa.Column("pool", sa.String(length=64), nullable=True))
    op.add_column("models", sa.Column("labels", app.db.JSONType, nullable=True))
    op.add_column("workers", sa.Column("pool", sa.String(length=64), nullable=True))
    op.add_column("workers", sa.Column("backends", app.db.JSONType, nullable=True))
    op.add_column("workers", sa.Column("labels", app.db.JSONType, nullable=True))
    op.add_column("workers", sa.Column("version", sa.String(length=64), nullable=True))
    op.add_column(
        "workers",
        sa.Column("draining", sa.Boolean(), server_default=sa.false(), nullable=False),
    )
    op.add_column(
        "workers",
        sa.Column("drain_requested", app.db.UTCDateTime(timezone=True), nullable=True),
    )


def downgrade() -> None:
    with op.batch_alter_table("workers") as batch_op:
        for column in ("drain_requested", "draining", "version", "labels", "backends", "pool"):
            batch_op.drop_column(column)
    with op.batch_alter_table("models") as batch_op:
        batch_op.drop_column("labels")
        batch_op.drop_column("pool")
