"""checkpoint registry: user-defined aliases and a retention policy per model

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-04

`model_aliases`: a name for one of a model's checkpoints (`name@alias` at the gateway);
the built-in `latest` and `best` are computed, never stored. `retention_policies`: keep the
newest `keep_last` checkpoints and the best by `keep_best_by`; applied after each step.
Both go with their model (ON DELETE CASCADE).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

import app.db

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "model_aliases",
        sa.Column("model_name", sa.String(length=128), nullable=False),
        sa.Column("alias", sa.String(length=64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("created_at", app.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("updated_at", app.db.UTCDateTime(timezone=True), nullable=False),
        sa.CheckConstraint("step >= 0", name=op.f("ck_model_aliases_step_not_negative")),
        sa.ForeignKeyConstraint(
            ["model_name"],
            ["models.name"],
            name=op.f("fk_model_aliases_model_name_models"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("model_name", "alias", name=op.f("pk_model_aliases")),
    )
    op.create_table(
        "retention_policies",
        sa.Column("model_name", sa.String(length=128), nullable=False),
        sa.Column("keep_last", sa.Integer(), nullable=False),
        sa.Column("keep_best_by", sa.String(length=256), nullable=True),
        sa.Column("higher_is_better", sa.Boolean(), nullable=False),
        sa.Column("created_at", app.db.UTCDateTime(timezone=True), nullable=False),
        sa.Column("updated_at", app.db.UTCDateTime(timezone=True), nullable=False),
        sa.CheckConstraint("keep_last >= 1", name=op.f("ck_retention_policies_keep_last_positive")),
        sa.ForeignKeyConstraint(
            ["model_name"],
            ["models.name"],
            name=op.f("fk_retention_policies_model_name_models"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("model_name", name=op.f("pk_retention_policies")),
    )


def downgrade() -> None:
    op.drop_table("retention_policies")
    op.drop_table("model_aliases")
