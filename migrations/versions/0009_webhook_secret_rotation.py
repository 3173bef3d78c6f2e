"""webhooks: a rotated secret kept for a grace period; finished deliveries found by age

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07

`webhook_endpoints.previous_secret` and `previous_secret_expires_at`: after
`POST /v1/webhooks/{id}/rotate-secret`, deliveries are signed with the new secret and,
until the expiry, the previous one too. `ix_webhook_deliveries_finished`: the senders'
retention pass deletes ended deliveries oldest first by `finished_at`.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import app.db

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

FINISHED = sa.text("finished_at IS NOT NULL")


def upgrade() -> None:
    with op.batch_alter_table("webhook_endpoints") as batch_op:
        batch_op.add_column(sa.Column("previous_secret", sa.String(length=128), nullable=True))
        batch_op.add_column(
            sa.Column(
                "previous_secret_expires_at", app.db.UTCDateTime(timezone=True), nullable=True
            )
        )
    op.create_index(
        "ix_webhook_deliveries_finished",
        "webhook_deliveries",
        ["finished_at"],
        sqlite_where=FINISHED,
        postgresql_where=FINISHED,
    )


def downgrade() -> None:
    op.drop_index(
        "ix_webhook_deliveries_finished",
        table_name="webhook_deliveries",
        sqlite_where=FINISHED,
        postgresql_where=FINISHED,
    )
    with op.batch_alter_table("webhook_endpoints") as batch_op:
        batch_op.drop_column("previous_secret_expires_at")
        batch_op.drop_column("previous_secret")
