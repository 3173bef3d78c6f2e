"""tinker journal: the operations of Tinker training runs, as accepted and as done

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05

`tinker_operations`: one row per operation of a Tinker training run (`forward_backward`,
`optim_step`, saves, loads), written when it is accepted and again with its result. A
restarted process makes a run again by doing its operations over in `seq` order, and
answers the SDK's retrieve of a future from the row. `tinker_samplers`: what each sampling
session samples from, so that a restarted process samples from it again. New tables on both
dialects.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import app.db

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tinker_operations",
        sa.Column("request_id", sa.String(length=200), nullable=False),
        sa.Column("model_name", sa.String(length=128), nullable=False),
        sa.Column("model_id", sa.String(length=128), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(length=32), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("result_type", sa.String(length=8), nullable=True),
        sa.Column("result", sa.LargeBinary(), nullable=True),
        sa.Column("category", sa.String(length=16), nullable=True),
        sa.Column("step", sa.Integer(), nullable=True),
        sa.Column("path", sa.String(length=300), nullable=True),
        sa.Column("created_at", app.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("done_at", app.db.UTCDateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_tinker_operations")),
        sa.UniqueConstraint("model_name", "seq", name=op.f("uq_tinker_operations_model_name_seq")),
    )
    op.create_table(
        "tinker_samplers",
        sa.Column("sampler_id", sa.String(length=64), nullable=False),
        sa.Column("base_model", sa.Text(), nullable=False),
        sa.Column("model_path", sa.String(length=300), nullable=True),
        sa.Column("created_at", app.db.UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("sampler_id", name=op.f("pk_tinker_samplers")),
    )


def downgrade() -> None:
    op.drop_table("tinker_samplers")
    op.drop_table("tinker_operations")
