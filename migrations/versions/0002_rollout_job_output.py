"""rollout job output

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:

    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("output", sa.LargeBinary(), nullable=True))
        batch_op.add_column(sa.Column("output_bytes", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("next_job_id", sa.String(length=40), nullable=True))


def downgrade() -> None:

    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("next_job_id")
        batch_op.drop_column("output_bytes")
        batch_op.drop_column("output")
