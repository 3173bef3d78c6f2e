"""policy versions: the step a training job's trajectories were sampled from

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03

`policy_step`: the model step the trajectories came from (rollout jobs tag the training
job they enqueue); `max_steps_off_policy`: how far the model may have moved past it when
the job is claimed (null: any). `trained`: whether the step changed the weights (false
when no group was trainable).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("policy_step", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("max_steps_off_policy", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("trained", sa.Boolean(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("trained")
        batch_op.drop_column("max_steps_off_policy")
        batch_op.drop_column("policy_step")
