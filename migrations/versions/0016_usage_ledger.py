"""usage ledger: tokens on jobs, the submitting key, gateway usage rows

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06

`jobs` gets what a job used in tokens, written by its final write (NULL: not counted, as
for every job before this revision): `prompt_tokens` and `completion_tokens` sampled
(rollout and evaluation jobs, run validations), `trained_tokens` (training jobs); and
`key_id`, the API key that submitted it (NULL: a key from TRAINYARD_API_KEYS, no key, or a
job a run or a rollout made). `gateway_usage` is append-only: one row per answered gateway
call whose tokens are known. `webhook_endpoints.project_id` gets the index a project's
listing reads.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import app.db

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TOKENS = ("prompt_tokens", "completion_tokens", "trained_tokens")


def upgrade() -> None:
    for column in TOKENS:
        op.add_column("jobs", sa.Column(column, sa.BigInteger(), nullable=True))
    op.add_column("jobs", sa.Column("key_id", sa.String(40), nullable=True))
    op.create_table(
        "gateway_usage",
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            nullable=False,
            autoincrement=True,
        ),
        sa.Column("created_at", app.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("project_id", sa.String(40), nullable=False),
        sa.Column("key_id", sa.String(40), nullable=True),
        sa.Column("model", sa.String(512), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gateway_usage")),
    )
    op.create_index(
        "ix_gateway_usage_project_created", "gateway_usage", ["project_id", "created_at"]
    )
    op.create_index("ix_gateway_usage_created", "gateway_usage", ["created_at"])
    op.create_index("ix_webhook_endpoints_project_id", "webhook_endpoints", ["project_id"])


def downgrade() -> None:
    op.drop_index("ix_webhook_endpoints_project_id", table_name="webhook_endpoints")
    op.drop_index("ix_gateway_usage_created", table_name="gateway_usage")
    op.drop_index("ix_gateway_usage_project_created", table_name="gateway_usage")
    op.drop_table("gateway_usage")
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("key_id")
        for column in reversed(TOKENS):
            batch_op.drop_column(column)
