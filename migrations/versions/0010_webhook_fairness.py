"""webhooks: fair delivery (who was served last, in-flight caps by host), a circuit
breaker per endpoint, a version per secret

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-08

`webhook_endpoints.host`: the URL's host, which the senders cap in-flight deliveries by
(filled here from each URL). `last_claimed_at`: when a sender last took one of its
deliveries; senders serve the endpoint waiting longest first (round-robin).
`consecutive_timeouts`: attempts in a row that timed out; `answered_at`: the last answer.
`breaker_open_until`: set when `consecutive_timeouts` reaches the breaker's threshold;
nothing is sent to it until then. `secret_version`: 1 at registration, one more at each
rotation. `ix_webhook_deliveries_leased`: the in-flight deliveries the caps count.
"""

from collections.abc import Sequence
from urllib.parse import urlsplit

import sqlalchemy as sa
from alembic import op

import app.db

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

LEASED = sa.text("status = 'pending' AND lease_token IS NOT NULL")


def upgrade() -> None:
    with op.batch_alter_table("webhook_endpoints") as batch_op:
        batch_op.add_column(
            sa.Column("host", sa.String(length=255), nullable=False, server_default="")
        )
        batch_op.add_column(
            sa.Column("secret_version", sa.Integer(), nullable=False, server_default="1")
        )
        batch_op.add_column(
            sa.Column("last_claimed_at", app.db.UTCDateTime(timezone=True), nullable=True)
        )
        batch_op.add_column(
            sa.Column("consecutive_timeouts", sa.Integer(), nullable=False, server_default="0")
        )
        batch_op.add_column(
            sa.Column("answered_at", app.db.UTCDateTime(timezone=True), nullable=True)
        )
        batch_op.add_column(
            sa.Column("breaker_open_until", app.db.UTCDateTime(timezone=True), nullable=True)
        )
    endpoints = sa.table(
        "webhook_endpoints",
        sa.column("id", sa.String),
        sa.column("url", sa.String),
        sa.column("host", sa.String),
    )
    conn = op.get_bind()
    for endpoint_id, url in conn.execute(sa.select(endpoints.c.id, endpoints.c.url)).all():
        host = (urlsplit(url).hostname or "").lower()[:255]
        conn.execute(sa.update(endpoints).where(endpoints.c.id == endpoint_id).values(host=host))
    op.create_index(
        "ix_webhook_deliveries_leased",
        "webhook_deliveries",
        ["endpoint_id"],
        sqlite_where=LEASED,
        postgresql_where=LEASED,
    )


def downgrade() -> None:
    op.drop_index(
        "ix_webhook_deliveries_leased",
        table_name="webhook_deliveries",
        sqlite_where=LEASED,
        postgresql_where=LEASED,
    )
    with op.batch_alter_table("webhook_endpoints") as batch_op:
        batch_op.drop_column("breaker_open_until")
        batch_op.drop_column("answered_at")
        batch_op.drop_column("consecutive_timeouts")
        batch_op.drop_column("last_claimed_at")
        batch_op.drop_column("secret_version")
        batch_op.drop_column("host")
