"""models.step_known; NOTIFY from triggers

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02

`models.step_known`: `current_step` is the backend's step as last read by a worker, and
nothing has trained the model since without its step being read again. A claim then
records the job's start step at once, and the worker skips a separate start write.

On Postgres, a queued job and an appended event are signalled to other processes by
triggers (LISTEN/NOTIFY), delivered when the writing transaction commits: no extra round
trip per write. The channel names are app.notify.JOBS_CHANNEL and EVENTS_CHANNEL.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TRIGGERS = {
    # trigger, table, function, channel, payload column
    "jobs_notify_queued": ("jobs", "trainyard_notify_job", "trainyard_jobs", "id"),
    "job_events_notify": ("job_events", "trainyard_notify_event", "trainyard_events", "job_id"),
}


def upgrade() -> None:
    with op.batch_alter_table("models", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("step_known", sa.Boolean(), nullable=False, server_default=sa.false())
        )
    if op.get_bind().dialect.name != "postgresql":
        return
    for trigger, (table, function, channel, column) in TRIGGERS.items():
        op.execute(
            f"CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$ "
            f"BEGIN PERFORM pg_notify('{channel}', NEW.{column}); RETURN NULL; END $$"
        )
        op.execute(
            f"CREATE TRIGGER {trigger} AFTER INSERT ON {table} "
            f"FOR EACH ROW EXECUTE FUNCTION {function}()"
        )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        for trigger, (table, function, _, _) in TRIGGERS.items():
            op.execute(f"DROP TRIGGER {trigger} ON {table}")
            op.execute(f"DROP FUNCTION {function}()")
    with op.batch_alter_table("models", schema=None) as batch_op:
        batch_op.drop_column("step_known")
